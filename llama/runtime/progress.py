"""Progress that reads well wherever the output goes: one display, chosen from whether a person watches
a terminal on either stream.

- stdout is a terminal: a bar there, and no step lines (the bar says the same).
- stdout is a file and stderr a terminal: the bar on stderr, llm.c's step lines into the file.
- stdout is a pipe (`| tee log`, `| less`) or neither stream is a terminal: the step lines alone. A
  pipe's lines may reach the very terminal a bar would be drawn on, and would be glued to it.
A file never gets a bar or a carriage return. The training bar fits the terminal's width: the stats
that do not fit beside a bar of MIN_BAR columns are left out whole, the least important first.
A phase that may take seconds (building kernels, initializing or loading the weights, capturing graphs,
writing or reading a checkpoint: phase()) says so once it has taken REPORT_AFTER seconds: a bar where
bars are drawn, else lines on stderr: its name, its progress every LINE_EVERY seconds, and its time.
"""

from __future__ import annotations

import io
import os
import stat
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm

MIN_BAR = 10  # columns the bar itself keeps
BAR_FORMAT = "{n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}"  # then ", " and the stats
STAT_SEPARATOR = " | "
REPORT_AFTER = 2.0  # seconds: a phase that takes longer reports itself
LINE_EVERY = 10.0  # seconds between a phase's progress lines in a pipe or a file
SCALED = 10_000  # totals from which a bar counts in k, M, G
EVERY_PHASE = "LLAMA_PHASE_TIMES"  # environment: set, every phase's time is a line, however short (bench_startup)


@dataclass(frozen=True)
class Display:
    bar_file: TextIO | None  # the terminal bars are drawn on; None: no bars
    step_lines: bool  # llm.c's step lines on stdout


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or closed
        return False


def _is_pipe(stream) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return False


def choose_display(stdout: TextIO | None = None, stderr: TextIO | None = None) -> Display:
    """The display for these streams (default: sys.stdout and sys.stderr)."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    if _is_terminal(stdout):
        return Display(stdout, step_lines=False)
    if _is_terminal(stderr) and not _is_pipe(stdout):
        return Display(stderr, step_lines=True)
    return Display(None, step_lines=True)


def bar(iterable=None, show: bool = True, **kwargs) -> tqdm:
    """A tqdm bar (tokenizing, downloading, building a model) on the terminal a person watches; where
    nobody does, or with show False, it writes nothing."""
    file = choose_display().bar_file
    return tqdm(iterable, file=file, disable=file is None or not show, dynamic_ncols=True, **kwargs)


def terminal_columns(stream: TextIO, default: int = 80) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return default


def fit_stats(stats: list[str], room: int) -> str:
    """As many of the stats, in order, as fit in `room` columns, each whole."""
    shown: list[str] = []
    for item in stats:
        if len(STAT_SEPARATOR.join([*shown, item])) > room:
            break
        shown.append(item)
    return STAT_SEPARATOR.join(shown)


class TrainingProgress:
    """The trainer's progress over steps start..total: a bar, or llm.c's lines every print_every steps
    (and at the last), as the display says. Use as a context manager."""

    def __init__(self, total: int, start: int, print_every: int, display: Display | None = None):
        self.display = display or choose_display()
        self.total, self.print_every = total, print_every
        self.bar = tqdm(total=total, initial=start, unit="step", file=self.display.bar_file,
                        disable=self.display.bar_file is None, dynamic_ncols=True, bar_format=BAR_FORMAT)

    def __enter__(self) -> "TrainingProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def write(self, text: str) -> None:
        """A message (a validation loss, a sample) on stdout, above the bar when there is one."""
        tqdm.write(text, file=sys.stdout)

    def warn(self, text: str) -> None:
        """A warning on stderr, above the bar when there is one."""
        tqdm.write(text, file=sys.stderr)

    def step(self, step: int, line: str, stats: list[str]) -> None:
        """Step `step` (0-based) is done: its llm.c line, and its stats for the bar, most important first."""
        if self.display.step_lines and ((step + 1) % self.print_every == 0 or step + 1 == self.total):
            self.write(line)
        if not self.bar.disable:
            self.bar.set_postfix_str(fit_stats(stats, self._room()), refresh=False)
            self.bar.update(1)

    def _room(self) -> int:
        """Columns left for the stats beside a bar of MIN_BAR columns, at the widest count and times."""
        meter = dict(self.bar.format_dict, n=self.total, bar_format=BAR_FORMAT.replace("{bar}", ""), postfix=None)
        fixed = len(tqdm.format_meter(**meter)) + len(", ") + 2  # tqdm's postfix separator; times may grow
        return terminal_columns(self.display.bar_file) - MIN_BAR - fixed


class Phase:
    """A phase's report, as phase() makes it; update(n) counts n more units of its work done."""

    def __init__(self, description: str, total: int | None, unit: str, display: Display, report_after: float):
        self.description, self.total, self.unit, self.report_after = description, total, unit, report_after
        self.start = self.last_line = time.monotonic()
        self.done, self.announced, self.lock = 0, False, threading.Lock()
        self.bar = None if display.bar_file is None else tqdm(
            total=total, desc=description, unit=unit, unit_scale=(total or 0) >= SCALED, file=display.bar_file,
            delay=report_after, dynamic_ncols=True)
        self.timer = threading.Timer(report_after, self._announce) if self.bar is None else None
        if self.timer is not None:
            self.timer.daemon = True
            self.timer.start()

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)
            return
        self.done += n
        now = time.monotonic()
        if self.announced and now - self.last_line >= LINE_EVERY:
            self.last_line = now
            share = f"{self.done / self.total:.0%} " if self.total else ""
            self._line(f"{self.description}: {share}({self._amount()}) after {now - self.start:.1f} s")

    def close(self) -> None:
        """The end: the bar's last state, or the line with the time the phase took."""
        if self.bar is not None:
            self.bar.close()
            return
        self.timer.cancel()
        elapsed = time.monotonic() - self.start
        if self.announced or elapsed >= self.report_after or os.environ.get(EVERY_PHASE):
            self._line(f"{self.description}: done in {elapsed:.1f} s")

    def _announce(self) -> None:
        self.announced = True
        self._line(f"{self.description} ...")

    def _amount(self) -> str:
        done = tqdm.format_sizeof(self.done)
        return f"{done}/{tqdm.format_sizeof(self.total)} {self.unit}" if self.total else f"{done} {self.unit}"

    def _line(self, text: str) -> None:
        with self.lock:
            print(text, file=sys.stderr, flush=True)


@contextmanager
def phase(description: str, total: int | None = None, unit: str = "it", report_after: float = REPORT_AFTER,
          display: Display | None = None):
    """Report a phase of work (see the module's docstring) while the block runs; yields its Phase, whose
    update(n) counts the work done out of total (None: unknown)."""
    report = Phase(description, total, unit, display or choose_display(), report_after)
    try:
        yield report
    finally:
        report.close()
