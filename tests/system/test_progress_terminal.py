"""train_llama.py's progress as a person sees it, on an 80-column terminal (a pty): with stderr in a
file the bar still shows, behind `| tee` the step lines come clean, and files get no bars."""

import os
import re
import subprocess
import sys

import pytest

from tests.runs import BASE, REPO
from tests.unit.test_progress import open_terminal, read_terminal, screen_lines

STEP_LINE = re.compile(r"^step +\d+/5 \| loss \d+\.\d{6} \|", re.M)


def train(data, cwd, stdout, stderr):
    """Run 5 steps on data (arguments) with these streams: 'terminal' (an 80-column pty), 'pipe',
    'out_file' or 'err_file'; returns what the terminal showed and what came through the pipe."""
    terminal, master = open_terminal(80)
    streams = {"terminal": terminal, "pipe": subprocess.PIPE}
    with open(cwd / "out.log", "w") as out_file, open(cwd / "err.log", "w") as err_file:
        streams.update(out_file=out_file, err_file=err_file)
        env = {"PYTHONPATH": str(REPO), "LLAMA_PACKAGE_INDEX": "http://127.0.0.1:9/", "TERM": "xterm",
               "LLAMA_CUDA_CACHE": str(cwd / "cache")}
        proc = subprocess.Popen([sys.executable, str(REPO / "train_llama.py"), *BASE, *data, "-x", "5", "-o", "out",
                                 "--device", "cpu"], stdout=streams[stdout], stderr=streams[stderr], cwd=cwd, env=env,
                                text=True)
        terminal.close()  # the child holds its own copy
        piped = proc.stdout.read() if stdout == "pipe" else ""
        assert proc.wait(timeout=120) == 0
    shown = read_terminal(master)
    os.close(master)
    return shown, piped


@pytest.mark.slow
def test_progress_with_stderr_in_a_file_shows_on_the_terminal(corpus, tmp_path):
    """python3 train_llama.py 2>err.log: the bar on stdout's terminal, fitting 80 columns."""
    shown, _ = train(corpus, tmp_path, "terminal", "err_file")
    lines = screen_lines(shown)
    bars = [line for line in lines if re.match(r"\d/5 \|", line)]
    assert bars and bars[-1].startswith("5/5 |") and all(len(line) <= 80 for line in bars), lines
    assert not STEP_LINE.search(shown) and "done: step 5/5" in shown
    err = (tmp_path / "err.log").read_text()
    assert "\r" not in err and "memory: the run needs" in shown  # the header is where the progress is


@pytest.mark.slow
def test_progress_through_tee_is_clean_lines(corpus, tmp_path):
    """python3 train_llama.py | tee log: stdout a pipe, stderr the terminal: step lines, and no bar on the
    terminal to glue them to."""
    shown, piped = train(corpus, tmp_path, "pipe", "terminal")
    assert len(STEP_LINE.findall(piped)) == 5 and "\r" not in piped
    assert "\r" not in shown.replace("\r\n", "\n")
    # issue 49: the log that tee writes is complete: the header goes where the step lines go
    assert "memory: the run needs" in piped and "device cpu | model tiny" in piped and "CPU | dtype fp32" in piped


@pytest.mark.slow
def test_files_get_lines_without_bars(tmp_path):
    """>out.log 2>err.log on the built-in corpus: no bar of its tokenizing nor of training in the files."""
    train(["-v", "0"], tmp_path, "out_file", "err_file")
    out, err = (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()
    assert "built-in corpus" in out and len(STEP_LINE.findall(out)) == 5 and "\r" not in out + err
    assert out.index("memory: the run needs") < out.index("data: the built-in corpus") < STEP_LINE.search(out).start()
