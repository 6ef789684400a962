"""One job at a time in a background thread (the trainer's checkpoint writes), and a line for slow I/O.

`BackgroundJob.start(job)` runs job() in a thread while the caller goes on; a second start() first
waits for the job in flight, so at most one runs. `collect()` hands back the result of a finished
job once (None while none finished), and re-raises its exception in the caller's thread instead:
a failed job is never lost. `collect(wait=True)` waits for the job in flight first; `seconds` is
how long the last collected job ran. The thread is a
daemon: a process that stops at once (a second Ctrl-C) does not wait for it, and what it leaves
half-done is what a kill -9 would leave, which the job must survive.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator

SLOW = 2.0  # seconds: I/O that takes longer says so in a line


class BackgroundJob:
    def __init__(self, name: str):
        self.name = name
        self._thread: threading.Thread | None = None
        self._outcome: tuple[object, BaseException | None, float] | None = None
        self.seconds = 0.0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Callable[[], object]) -> object:
        """Wait for the job in flight and collect it (its exception is raised here, and job does not
        run), then start job; returns the collected result (None if there was none)."""
        previous = self.collect(wait=True)
        self._outcome = None
        self._thread = threading.Thread(target=self._run, args=(job,), name=self.name, daemon=True)
        self._thread.start()
        return previous

    def _run(self, job: Callable[[], object]) -> None:
        began = time.perf_counter()
        try:
            self._outcome = (job(), None, time.perf_counter() - began)
        except BaseException as e:  # handed to the caller's thread by collect()
            self._outcome = (None, e, time.perf_counter() - began)

    def collect(self, wait: bool = False) -> object:
        """The result of the finished job (once), None if none finished; raises the job's exception."""
        if self._thread is None or (self._thread.is_alive() and not wait):
            return None
        while self._thread.is_alive():  # a join with a timeout: the main thread's signal handlers still run
            self._thread.join(0.1)
        result, error, self.seconds = self._outcome
        self._thread = self._outcome = None
        if error is not None:
            raise error
        return result


@contextlib.contextmanager
def report_if_slow(what: str, nbytes: int, file=None) -> Iterator[None]:
    """After the block, one line with its time and rate when it took more than SLOW seconds."""
    began = time.perf_counter()
    yield
    elapsed = time.perf_counter() - began
    if elapsed > SLOW:
        print(f"{what}: {nbytes / 1e9:.2f} GB in {elapsed:.1f} s ({nbytes / 1e9 / elapsed:.2f} GB/s)",
              file=file or sys.stderr)
