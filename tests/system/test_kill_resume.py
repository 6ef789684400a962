"""kill -9 at random moments, half of them inside checkpoint writes, each followed by --resume auto (the
same command, as a scheduler reruns it): the final weights, optimizer state, main.log and samples are those of
the uninterrupted run, bit for bit."""

import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from llama.io.checkpoint import load_checkpoint
from tests.runs import BASE, REPO, samples, wait_for

pytestmark = pytest.mark.slow  # a dozen trainer processes killed and resumed
STEPS = 48  # enough that 12 kills never reach the end, however fast the machine
ARGS = [*BASE[:-6], "-s", "4", "-g", "6", "-v", "3", "-m", "1", "-x", str(STEPS), "-n", "2", "-nk", "2",
        "--device", "cpu"]

# Runs train_llama.py, SIGKILLing itself at the start of the nth call of one of llama.io.checkpoint's write
# steps: write_tensors (model, optimizer), _write_file (state.json, DONE after the rename) or
# remove_checkpoint (rotation). argv: function name (or "none"), n, the trainer's arguments.
DIE_INSIDE = """
import os, runpy, signal, sys
sys.path.insert(0, %r)
import llama.io.checkpoint as checkpoint
name, nth = sys.argv[1], int(sys.argv[2])
if name != "none":
    real, calls = getattr(checkpoint, name), []
    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(checkpoint, name, dying)
sys.argv = ["train_llama.py", *sys.argv[3:]]
runpy.run_path(%r, run_name="__main__")
""" % (str(REPO), str(REPO / "train_llama.py"))
WRITE_STEPS = ("write_tensors", "_write_file", "remove_checkpoint")


def start(tmp_path, corpus, out, log_name, die=("none", 0)):
    with open(tmp_path / log_name, "w") as stdout:
        return subprocess.Popen([sys.executable, "-c", DIE_INSIDE, die[0], str(die[1]), *ARGS, *corpus, "-o", out,
                                 "--resume", "auto"], cwd=tmp_path, stdout=stdout, stderr=subprocess.DEVNULL)


def step_lines(path) -> int:
    return path.read_text().count(f"/{STEPS} | loss ") if path.exists() else 0


def test_kill_9_loop_resumes_bit_for_bit(corpus, tmp_path):
    reference = start(tmp_path, corpus, "ref", "ref.out")  # runs beside the loop
    rng = random.Random(11)
    kills = []
    for i in range(12):
        if i % 2:  # inside a checkpoint write
            die = (rng.choice(WRITE_STEPS), rng.randint(1, 2))
            trainer = start(tmp_path, corpus, "out", f"{i}.out", die)
            trainer.wait(timeout=120)
        else:  # after a few steps, at a random moment
            die = ("external", rng.randint(1, 4))
            trainer = start(tmp_path, corpus, "out", f"{i}.out")
            wait_for(lambda: step_lines(tmp_path / f"{i}.out") >= die[1] or trainer.poll() is not None, timeout=120)
            time.sleep(rng.uniform(0, 0.02))
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
        assert trainer.returncode == -signal.SIGKILL, (i, die, trainer.returncode)
        kills.append(die)
    last = start(tmp_path, corpus, "out", "last.out")
    assert last.wait(timeout=120) == 0 and reference.wait(timeout=120) == 0
    print(f"\n{len(kills)} kills: {kills}")

    out, ref = tmp_path / "out", tmp_path / "ref"
    assert (out / "main.log").read_bytes() == (ref / "main.log").read_bytes()
    final, expected = load_checkpoint(out / f"ckpt_{STEPS:08d}"), load_checkpoint(ref / f"ckpt_{STEPS:08d}")
    for key in ("params", "adam_m", "adam_v"):
        assert np.array_equal(final[key], expected[key]), key
    assert final["state"]["loader"] == expected["state"]["loader"]
    expected_samples = samples((tmp_path / "ref.out").read_text())
    printed = {}
    for i in [*range(12), "last"]:
        for step, text in samples((tmp_path / f"{i}.out").read_text()).items():
            assert text == expected_samples[step], (i, step)
            printed[step] = text
    assert printed == expected_samples and len(expected_samples) == STEPS // 4
    assert sorted(p.name for p in out.iterdir()) == [f"ckpt_{STEPS - 2:08d}", f"ckpt_{STEPS:08d}", "main.log"]
