"""Files read into the page cache ahead of their reader, so that the disk works while the program does
something else: the one-GPU `--resume` starts reading its checkpoint when the process finds it, beside the
plan, the kernels and the model's build, and stream_checkpoint then finds its first parts in memory.

`ReadAhead(ranges)` starts THREADS daemon threads that read the (file, offset, bytes) ranges in their order,
in pieces (READ_PIECE bytes), into scratch buffers (the page cache keeps what they read). They stay at most
`ahead` bytes beyond what the reader says it has consumed (`consumed(nbytes)`), so that the memory still holds
what was read ahead when the reader gets there. `close()` (or leaving the `with` block) stops them. A read
that fails stops the read-ahead silently: the reader reads the same bytes itself and reports the error.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from ..runtime.machine import host_available
from .safetensors_file import READ_PIECE, SafetensorsError, read_into

THREADS = 4  # reads in flight
AHEAD_BYTES = 16 << 30  # at most this far ahead of the reader, and at most half the memory left (host_available)


class ReadAhead:
    def __init__(self, ranges: list[tuple[Path, int, int]], ahead: int | None = None, threads: int = THREADS,
                 piece: int = READ_PIECE):
        if ahead is None:
            room = host_available()
            ahead = AHEAD_BYTES if room is None else min(AHEAD_BYTES, room // 2)
        self.ahead = max(piece, ahead)
        self.piece, self.pieces, start = piece, [], 0  # pieces: (file, offset, bytes, bytes of the ranges before it)
        for file, offset, nbytes in ranges:
            for done in range(0, nbytes, piece):
                self.pieces.append((file, offset + done, min(piece, nbytes - done), start))
                start += min(piece, nbytes - done)
        self.fds = {file: os.open(file, os.O_RDONLY) for file in dict.fromkeys(file for file, *_ in ranges)}
        self.next, self.done, self.stopped = 0, 0, False
        self.read_bytes = 0  # what the threads have read
        self.changed = threading.Condition()
        self.threads = [threading.Thread(target=self._read, name=f"read-ahead {i}", daemon=True)
                        for i in range(min(threads, len(self.pieces)))]
        for thread in self.threads:
            thread.start()

    def consumed(self, nbytes: int) -> None:
        """The reader has consumed nbytes more of the ranges (in their order)."""
        with self.changed:
            self.done += nbytes
            self.changed.notify_all()

    def close(self) -> None:
        """Stop the threads (a read in flight finishes first) and close the files."""
        with self.changed:
            self.stopped = True
            self.changed.notify_all()
        for thread in self.threads:
            thread.join()
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> None:
        scratch = np.empty(self.piece, np.uint8)
        while True:
            with self.changed:
                while (not self.stopped and self.next < len(self.pieces)
                       and self.pieces[self.next][3] - self.done >= self.ahead):
                    self.changed.wait()
                if self.stopped or self.next >= len(self.pieces):
                    return
                file, offset, nbytes, _ = self.pieces[self.next]
                self.next += 1
            try:
                read_into(self.fds[file], memoryview(scratch[:nbytes]), offset, file)
            except (OSError, SafetensorsError):
                with self.changed:
                    self.stopped = True
                    self.changed.notify_all()
                return
            with self.changed:
                self.read_bytes += nbytes
