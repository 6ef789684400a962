"""Disk faults simulated at the OS-call level, for machines where no tmpfs or read-only mount can be made.

`DiskFault(root, errno.ENOSPC, budget)`: files opened for writing under root accept `budget` more
bytes in all, then every write fails with ENOSPC (the part that fits is written first, as a real
short write would). `DiskFault(root, errno.EROFS)`: creating, writing, renaming or truncating
anything under root fails with EROFS. Nothing happens until `armed` is set (at once by default).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class DiskFault:
    def __init__(self, root: str | Path, err: int, budget: int = 0, armed: bool = True):
        self.root, self.err, self.budget, self.armed = Path(root).resolve(), err, budget, armed
        self.failures = 0  # how many calls failed

    def _hits(self, path) -> bool:
        if not self.armed or isinstance(path, int):
            return False
        return Path(os.path.abspath(os.fsdecode(path))).is_relative_to(self.root)

    def _fail(self, path=None):
        self.failures += 1
        raise OSError(self.err, os.strerror(self.err), *([os.fsdecode(path)] if path is not None else []))

    def install(self, monkeypatch) -> "DiskFault":
        real_open, real_os_open = builtins.open, os.open
        real = {name: getattr(os, name) for name in ("mkdir", "replace", "rename", "truncate")}

        def fake_open(file, mode="r", *args, **kwargs):
            writing = any(c in mode for c in "wax+")
            if writing and self._hits(file):
                if self.err != errno.ENOSPC:
                    self._fail(file)
                return _FillingFile(real_open(file, mode, *args, **kwargs), self)
            return real_open(file, mode, *args, **kwargs)

        def fake_os_open(path, flags, *args, **kwargs):
            if flags & WRITE_FLAGS and self.err != errno.ENOSPC and self._hits(path):
                self._fail(path)
            return real_os_open(path, flags, *args, **kwargs)

        def guarded(name):
            def call(path, *args, **kwargs):
                if self.err != errno.ENOSPC and self._hits(path) and not (name == "mkdir" and os.path.exists(path)):
                    self._fail(path)
                return real[name](path, *args, **kwargs)
            return call

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)
        monkeypatch.setattr(os, "open", fake_os_open)
        for name in real:
            monkeypatch.setattr(os, name, guarded(name))
        return self


class _FillingFile:
    """A file on a disk with fault.budget bytes left."""

    def __init__(self, file, fault: DiskFault):
        self._file, self._fault = file, fault

    def write(self, data):
        size = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
        if self._fault.armed and size > self._fault.budget:
            if not isinstance(data, str):
                self._file.write(memoryview(data).cast("B")[:self._fault.budget])
            self._fault.budget = 0
            self._fault._fail()
        if self._fault.armed:
            self._fault.budget -= size
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def __iter__(self):
        return iter(self._file)
