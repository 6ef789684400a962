"""An output folder belongs to one run.

`RunDir` claims the folder for the lifetime of a training run:
- Lock: `train.lock` holds the trainer's PID under an exclusive flock, which the kernel drops when
  the process ends, even by kill -9. A second trainer on the folder fails at once and is told the
  PID of the first; a lock left by a process that is gone is taken over with a note. Where the
  filesystem has no flock, the PID alone decides: a lock whose process no longer runs is stale.
- Ownership: a folder that holds another run (main.log or checkpoints) is refused unless the run is
  continued (--resume) or replaced (--overwrite, which moves the old run into `old_run_<n>/`).
- A refused run leaves nothing: the folders made for it (the run's and its parents) are removed on the
  way out when they are still empty, so that a run that never trained leaves no trace.
- Leftovers of a crash (`.tmp_ckpt_*` folders of an unfinished checkpoint) are removed.
- `open_log`: main.log, cut back to the length it had at the checkpoint a run resumes from.
- `default_output_dir`: where a run goes when no folder is given: `out`, then `out_2`, `out_3`, ...,
  so that the same command run again keeps the earlier runs.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path

LOCK = "train.lock"
LOG = "main.log"


class RunDirError(Exception):
    """An output folder this run cannot use; the message is one line."""


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (UnicodeDecodeError, ValueError):
        return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def describe_contents(path: Path) -> str:
    """What a folder holds, for an error line: "does not exist", "is empty", "holds main.log, notes.txt"."""
    if not path.is_dir():
        return "does not exist"
    names = sorted(p.name for p in path.iterdir() if p.name != LOCK)
    if not names:
        return "is empty"
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"holds {shown}"


class RunDir:
    """The folder of one training run, claimed for the run's lifetime (see the module's docstring);
    resume (True, or "auto") lets it hold a run already."""

    def __init__(self, path: str | Path, resume: bool | str = False, overwrite: bool = False):
        self.path = Path(path)
        self.resume, self.overwrite = resume, overwrite
        self.log_path = self.path / LOG
        self._lock_fd: int | None = None
        self._locked = False
        self._made: list[Path] = []  # the folders this run created, deepest first

    def __enter__(self) -> "RunDir":
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"the output folder {self.path} is a file; choose another --output-dir")
        try:
            self._make_folders()
            self._lock()
            self._check_owner()
            for leftover in self.path.glob(".tmp_ckpt_*"):
                shutil.rmtree(leftover)
        except BaseException as e:
            self._unlock()
            self._remove_if_unused()
            if isinstance(e, OSError):
                raise RunDirError(f"cannot use {self.path} as the output folder: {e.strerror or e}") from None
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._unlock()
        self._remove_if_unused()

    def _make_folders(self) -> None:
        """mkdir -p, remembering which folders did not exist before."""
        missing = [p for p in (self.path, *self.path.parents) if not p.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        self._made = missing

    def _remove_if_unused(self) -> None:
        """The folders this run made, while they are empty: a run refused or stopped before it wrote
        anything leaves no folder behind."""
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:  # not empty (the run wrote something), or gone already
                return
        self._made = []

    def _lock(self) -> None:
        path = self.path / LOCK
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            self._lock_fd = fd  # closed by _unlock if anything below fails
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._busy(_read_pid(fd))
            except OSError:  # no flock on this filesystem: the PID decides
                holder = _read_pid(fd)
                if holder not in (None, os.getpid()) and _running(holder):
                    self._busy(holder)
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder removed the file as we opened it: lock the new one
            self._lock_fd = None
        stale = _read_pid(fd)
        if stale not in (None, os.getpid()):
            print(f"note: took over the lock of {self.path} left by PID {stale}, which no longer holds it",
                  file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._locked = True

    def _busy(self, holder: int | None) -> None:
        raise RunDirError(f"another trainer (PID {holder or 'unknown'}) is using {self.path}; "
                          "wait for it to end, or choose another --output-dir")

    def _unlock(self) -> None:
        if self._lock_fd is None:
            return
        if self._locked:
            try:
                os.unlink(self.path / LOCK)  # while still holding it: a waiting trainer then sees a new file
            except OSError:
                pass
        os.close(self._lock_fd)
        self._lock_fd, self._locked = None, False

    def _previous_run(self) -> list[Path]:
        found = sorted(self.path.glob("ckpt_*"))
        if self.log_path.is_file() and self.log_path.stat().st_size:
            found.append(self.log_path)
        return found

    def _check_owner(self) -> None:
        previous = self._previous_run()
        if not previous or self.resume:
            return
        checkpoints = sum(p.name.startswith("ckpt_") for p in previous)
        parts = [LOG] if self.log_path in previous else []
        if checkpoints:
            parts.append(f"{checkpoints} checkpoint folder(s)")
        what = " and ".join(parts)
        if not self.overwrite:
            raise RunDirError(f"{self.path} already holds a run ({what}); continue it with --resume, or start over "
                              f"with --overwrite (which moves the old run into {self.path / 'old_run_<n>'})")
        n = 1
        while (self.path / f"old_run_{n}").exists():
            n += 1
        aside = self.path / f"old_run_{n}"
        aside.mkdir()
        for p in previous:
            os.replace(p, aside / p.name)
        print(f"note: --overwrite: moved the previous run ({what}) to {aside}; delete it when you no longer need it",
              file=sys.stderr)

    def open_log(self, keep_bytes: int | None) -> "MainLog":
        return MainLog(self.log_path, keep_bytes)


class MainLog:
    """main.log, appended line by line; a write that fails (full disk) is a one-line RunDirError.

    A resumed run opens it with the length the log had when its checkpoint was written: lines a
    crashed run wrote after that are cut, so none appears twice."""

    def __init__(self, path: Path, keep_bytes: int | None):
        self.path = path
        try:
            if keep_bytes is not None and path.exists() and path.stat().st_size > keep_bytes:
                os.truncate(path, keep_bytes)
            self._file = open(path, "a")
        except OSError as e:
            raise RunDirError(f"cannot write {path}: {e.strerror or e}") from None

    def write(self, line: str) -> None:
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as e:
            raise RunDirError(f"cannot write {self.path}: {e.strerror or e}") from None

    def synced_size(self) -> int:
        """The log's length once it is on disk: what a checkpoint records."""
        os.fsync(self._file.fileno())
        return os.fstat(self._file.fileno()).st_size

    def __enter__(self) -> "MainLog":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._file.close()
        except OSError:  # the flush of a full disk; the error that stopped the run is the one to report
            pass


class FollowerRunDir:
    """The run's folder as ranks other than 0 of a multi-GPU run see it: they read its checkpoints;
    rank 0 alone locks it, writes main.log and saves checkpoints."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.log_path = self.path / LOG

    def __enter__(self) -> "FollowerRunDir":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def open_log(self, keep_bytes: int | None) -> "NoLog":
        return NoLog()


class NoLog:
    """MainLog's interface, writing nothing (ranks other than 0)."""

    def write(self, line: str) -> None:
        pass

    def synced_size(self) -> int:
        return 0

    def __enter__(self) -> "NoLog":
        return self

    def __exit__(self, *exc) -> None:
        pass


def holds_run(path: Path) -> bool:
    """Whether a folder holds a run: a non-empty main.log, a checkpoint, or the lock of a trainer."""
    log = path / LOG
    return (log.is_file() and log.stat().st_size > 0) or any(path.glob("ckpt_*")) or (path / LOCK).exists()


def default_runs(base: str = "out") -> dict[int, Path]:
    """{n: folder} of the default run folders that hold a run (base is 1, then base_2, base_3, ...), in order."""
    numbered = {1: Path(base)} | {int(p.name.rsplit("_", 1)[1]): p for p in Path().glob(f"{base}_*")
                                  if p.name.rsplit("_", 1)[1].isdigit()}
    return {n: numbered[n] for n in sorted(numbered) if holds_run(numbered[n])}


def default_output_dir(continuing: bool, base: str = "out") -> Path:
    """The run folder when none is given: base, base_2, base_3, ... numbered in the order the runs
    began. A new run takes the number after the last that holds a run; a run continued or replaced
    (continuing: --resume, --overwrite) is the last that holds one (base when none does)."""
    runs = default_runs(base)
    if not runs:
        return Path(base)
    last = max(runs)
    return runs[last] if continuing else Path(f"{base}_{last + 1}")
