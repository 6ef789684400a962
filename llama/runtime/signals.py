"""Stopping a run cleanly on SIGINT (Ctrl-C) and SIGTERM (what job schedulers send before a kill).

Inside `GracefulStop`, the first signal only sets `requested`: the trainer finishes the step it is in,
writes a checkpoint and exits with `exit_code`, 128 + the signal number (130 for SIGINT, 143 for
SIGTERM). A second signal raises StopNow at once: no checkpoint is written.
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopNow(BaseException):
    """A second SIGINT or SIGTERM: stop at once, without saving."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


class GracefulStop:
    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # only there can Python handle signals
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise StopNow(signum)
        self.signum = signum
        # os.write, not print: the signal may arrive while Python is inside a print to stderr
        os.write(2, f"\n{self.name} received: finishing this step, then writing a checkpoint "
                    "(press Ctrl-C again to stop at once without saving)\n".encode())

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 0
