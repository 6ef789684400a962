"""Progress displays on real terminals (ptys of 80 columns), pipes and files: which display each case
gets, a bar that fits 80 columns with whole stats, and files without bars or carriage returns."""

import fcntl
import os
import pty
import re
import struct
import termios
import time

import numpy as np
import pytest

from llama.data.datasets import encode_documents
from llama.data.tokenizer import ByteTokenizer
from llama.runtime.progress import EVERY_PHASE, MIN_BAR, Display, TrainingProgress, choose_display, fit_stats, phase

ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def open_terminal(columns: int = 80):
    """(the slave end of a pty of `columns` columns as a text stream, the master's fd)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return os.fdopen(slave, "w"), master


def read_terminal(master: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the slave end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def screen_lines(raw: str) -> list[str]:
    """What a terminal shows of each redraw: the text between carriage returns and newlines."""
    return [line.rstrip() for line in re.split(r"[\r\n]", ESCAPES.sub("", raw)) if line.strip()]


@pytest.fixture
def streams(tmp_path):
    """A terminal, a pipe's write end and a file, as text streams; closed afterwards."""
    terminal, master = open_terminal()
    read_end, write_end = os.pipe()
    opened = {"terminal": terminal, "pipe": os.fdopen(write_end, "w"), "file": open(tmp_path / "log", "w")}
    yield opened
    for stream in opened.values():
        stream.close()
    os.close(master)
    os.close(read_end)


@pytest.mark.parametrize("stdout, stderr, bar_on, step_lines", [
    ("terminal", "terminal", "stdout", False),  # python3 train_llama.py
    ("terminal", "file", "stdout", False),  # 2>err.log: the bar moves to stdout
    ("file", "terminal", "stderr", True),  # >log: the bar on the terminal, the lines in the file
    ("pipe", "terminal", None, True),  # | tee log: lines only, nothing to glue them to
    ("file", "file", None, True),
    ("pipe", "pipe", None, True),
])
def test_one_display_from_who_watches(streams, stdout, stderr, bar_on, step_lines):
    display = choose_display(streams[stdout], streams[stderr])
    expected = {"stdout": streams[stdout], "stderr": streams[stderr], None: None}[bar_on]
    assert display == Display(expected, step_lines)


def test_stats_are_left_out_whole():
    stats = ["loss 6.1234", "31,234 tok/s (last step)", "lr 3.00e-03"]
    assert fit_stats(stats, 38) == "loss 6.1234 | 31,234 tok/s (last step)"
    assert fit_stats(stats, 37) == "loss 6.1234"
    assert fit_stats(stats, 5) == ""


def test_the_bar_fits_80_columns_with_whole_stats():
    terminal, master = open_terminal(80)
    stats = ["loss 6.1234", "31,234 tok/s (last step)", "lr 3.00e-03", "norm 0.512", "MFU 41.2%"]
    with TrainingProgress(1000, 0, 1, Display(terminal, step_lines=False)) as progress:
        for step in range(12):
            progress.step(step, "never shown", stats)
    terminal.close()
    lines = screen_lines(read_terminal(master))
    os.close(master)
    assert lines and "never shown" not in "".join(lines)
    for line in lines:
        assert len(line) <= 80, line
        bar = line.split("|")[1]
        assert len(bar) >= MIN_BAR, line
        assert line.partition(", ")[2] in ("", "loss 6.1234 | 31,234 tok/s (last step)"), line
    assert re.fullmatch(r"12/1000 \|.{10,}\| 00:0\d<\S+, loss 6.1234 \| 31,234 tok/s \(last step\)", lines[-1])


def test_files_get_lines_and_no_bars(tmp_path, monkeypatch):
    """Output redirected to files: step lines every print_every steps and at the last, no carriage
    return anywhere, and the corpus-tokenizing bar writes nothing."""
    out, err = open(tmp_path / "out.log", "w"), open(tmp_path / "err.log", "w")
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    with TrainingProgress(5, 0, 2) as progress:
        for step in range(5):
            progress.step(step, f"step {step + 1}/5", ["loss 1.0"])
    tokens = encode_documents(["some text", "more text"], ByteTokenizer(), "tokenizing")
    out.close()
    err.close()
    assert len(tokens) == 20 and np.all(tokens[[0, 10]] == 256)
    assert (tmp_path / "out.log").read_text() == "step 2/5\nstep 4/5\nstep 5/5\n"
    assert (tmp_path / "err.log").read_text() == ""


def test_phases_in_a_file_are_lines_with_their_time(tmp_path, monkeypatch):
    """A phase past report_after: its name, a progress line (every LINE_EVERY seconds, here every update)
    and its time; a short one: nothing, unless EVERY_PHASE asks for every phase's time."""
    err = open(tmp_path / "err.log", "w")
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("llama.runtime.progress.LINE_EVERY", 0.0)
    monkeypatch.delenv(EVERY_PHASE, raising=False)
    lines_only = Display(None, step_lines=True)
    with phase("loading", total=2000, unit="param", report_after=0.05, display=lines_only) as progress:
        time.sleep(0.2)
        progress.update(1000)
    with phase("quick", display=lines_only):
        pass
    monkeypatch.setenv(EVERY_PHASE, "1")
    with phase("counted", display=lines_only):
        pass
    err.close()
    lines = (tmp_path / "err.log").read_text().splitlines()
    assert lines[0] == "loading ..."
    assert re.fullmatch(r"loading: 50% \(1.00k/2.00k param\) after 0\.\d s", lines[1]), lines[1]
    assert re.fullmatch(r"loading: done in 0\.\d s", lines[2]), lines[2]
    assert re.fullmatch(r"counted: done in 0\.0 s", lines[3]) and len(lines) == 4, lines


def test_phases_on_a_terminal_are_a_bar_once_they_take_a_while():
    terminal, master = open_terminal(80)
    with phase("quick", total=10, display=Display(terminal, step_lines=False), report_after=5.0) as progress:
        progress.update(10)
    with phase("building", total=4, unit="kernel", display=Display(terminal, step_lines=False),
               report_after=0.05) as progress:
        time.sleep(0.1)
        progress.update(4)
    terminal.close()
    lines = screen_lines(read_terminal(master))
    os.close(master)
    assert lines and not any("quick" in line for line in lines)
    assert re.match(r"building: 100%\|.*\| 4/4 ", lines[-1]), lines
