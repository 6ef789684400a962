"""kill -9 at random moments, two thirds of them inside checkpoint writes (which run in the background
while training goes on), each followed by --resume auto (the same command, as a scheduler reruns it): the final
weights, optimizer state, main.log and samples are those of the uninterrupted run, bit for bit."""

import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from llama.io.checkpoint import load_checkpoint
from tests.runs import BASE, REPO, samples, wait_for

pytestmark = pytest.mark.slow  # 18 trainer processes killed and resumed
KILLS = 18
STEPS = 72  # enough that the kills never reach the end, however fast the machine
ARGS = [*BASE[:-6], "-s", "4", "-g", "6", "-v", "3", "-m", "1", "-x", str(STEPS), "-n", "2", "-nk", "2"]

WRITE_STEPS = ("write_tensors", "_write_file", "remove_checkpoint")
# Runs train_llama.py, SIGKILLing itself in one of two ways. "<function>" n: at the start of the nth call of
# one of llama.io.checkpoint's write steps: write_tensors (model, optimizer), _write_file (state.json, DONE
# after the rename) or remove_checkpoint (rotation). "during" n: from the nth background checkpoint write on
# (training goes on meanwhile), at a random moment in the first 10 ms of a random one of its first 7 steps
# (these and _fsync_path, each slowed by 5 ms so that the moment may fall in it or between it and the next),
# seeded by argv[3]; the step it was in (or "after" it) is written to the file argv[4] first. argv: how, n,
# the seed, the phase file, the trainer's arguments.
DIE_INSIDE = """
import os, random, runpy, signal, sys, threading, time
sys.path.insert(0, %r)
import llama.io.checkpoint as checkpoint
import llama.run.trainer as trainer
how, nth, seed, phase_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
calls, steps, phase = [], [], ["training"]
chance = random.Random(seed)
kth, delay = chance.randint(1, 7), chance.uniform(0, 0.01)

def hook(module, name, before):
    real = getattr(module, name)
    def hooked(*args, **kwargs):
        before(name)
        result = real(*args, **kwargs)
        phase[0] = "after " + name
        return result
    setattr(module, name, hooked)

def die(name):
    calls.append(name)
    if len(calls) == nth:
        os.kill(os.getpid(), signal.SIGKILL)

def die_soon():
    with open(phase_file, "w") as f:
        f.write(phase[0])
    os.kill(os.getpid(), signal.SIGKILL)

def slow(name):
    phase[0] = name
    if len(calls) >= nth:
        steps.append(name)
        if len(steps) == kth:
            threading.Timer(delay, die_soon).start()
    time.sleep(0.005)

if how == "during":
    hook(trainer, "save_checkpoint", calls.append)
    for name in WRITE_STEPS + ("_fsync_path",):
        hook(checkpoint, name, slow)
elif how != "none":
    hook(checkpoint, how, die)
sys.argv = ["train_llama.py", *sys.argv[5:]]
runpy.run_path(%r, run_name="__main__")
""".replace("WRITE_STEPS", repr(WRITE_STEPS))


def start(tmp_path, corpus, out, log_name, die=("none", 0, 0), device="cpu", args=ARGS):
    """The trainer, its stdout in log_name and its stderr in log_name.err (kept, to say why a run ended)."""
    with open(tmp_path / log_name, "w") as stdout, open(tmp_path / f"{log_name}.err", "w") as stderr:
        return subprocess.Popen([sys.executable, "-c", DIE_INSIDE % (str(REPO), str(REPO / "train_llama.py")),
                                 *map(str, die), str(tmp_path / f"{log_name}.phase"), *args, *corpus, "-o", out,
                                 "--resume", "auto", "--device", device], cwd=tmp_path, stdout=stdout, stderr=stderr)


def ended(tmp_path, log_name: str, process) -> str:
    """How a run ended, for an assertion's message: its exit code and the end of its stderr."""
    err = (tmp_path / f"{log_name}.err").read_text().strip().splitlines()
    return f"{log_name}: exit {process.returncode}; stderr ends: " + " | ".join(err[-8:])


def step_lines(path) -> int:
    return path.read_text().count(f"/{STEPS} | loss ") if path.exists() else 0


def test_kill_9_loop_resumes_bit_for_bit(corpus, tmp_path):
    kill_loop(tmp_path, corpus, "cpu")


def kill_loop(tmp_path, corpus, device: str):
    """The kill -9 loop on `device`, every run's exit code and stderr kept (tests/gpu/test_kill_resume_gpu.py
    runs it on the GPU)."""
    reference = start(tmp_path, corpus, "ref", "ref.out", device=device)  # runs beside the loop
    rng = random.Random(11)
    kills, phases = [], []
    for i in range(KILLS):
        if i % 3:  # inside a checkpoint write: at the start of one of its steps, or at a random moment
            die = (rng.choice(WRITE_STEPS) if i % 3 == 1 else "during", rng.randint(1, 2), rng.randrange(1 << 30))
            trainer = start(tmp_path, corpus, "out", f"{i}.out", die, device)
            trainer.wait(timeout=120)
            if die[0] == "during":
                phases.append((tmp_path / f"{i}.out.phase").read_text())
        else:  # after a few steps, at a random moment
            die = ("external", rng.randint(1, 4))
            trainer = start(tmp_path, corpus, "out", f"{i}.out", device=device)
            wait_for(lambda: step_lines(tmp_path / f"{i}.out") >= die[1] or trainer.poll() is not None, timeout=120)
            time.sleep(rng.uniform(0, 0.02))
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
        assert trainer.returncode == -signal.SIGKILL, (i, die, ended(tmp_path, f"{i}.out", trainer))
        kills.append(die)
    last = start(tmp_path, corpus, "out", "last.out", device=device)
    assert last.wait(timeout=120) == 0, ended(tmp_path, "last.out", last)
    assert reference.wait(timeout=120) == 0, ended(tmp_path, "ref.out", reference)
    print(f"\n{len(kills)} kills: {kills}\nwhere the kills at a random moment of a write landed: {phases}")
    assert sum(phase != "after save_checkpoint" for phase in phases) >= len(phases) / 2  # mostly inside the write

    out, ref = tmp_path / "out", tmp_path / "ref"
    assert (out / "main.log").read_bytes() == (ref / "main.log").read_bytes()
    final, expected = load_checkpoint(out / f"ckpt_{STEPS:08d}"), load_checkpoint(ref / f"ckpt_{STEPS:08d}")
    for key in ("params", "adam_m", "adam_v"):
        assert np.array_equal(final[key], expected[key]), key
    assert final["state"]["loader"] == expected["state"]["loader"]
    expected_samples = samples((tmp_path / "ref.out").read_text())
    printed = {}
    for i in [*range(KILLS), "last"]:
        for step, text in samples((tmp_path / f"{i}.out").read_text()).items():
            assert text == expected_samples[step], (i, step)
            printed[step] = text
    assert printed == expected_samples and len(expected_samples) == STEPS // 4
    assert sorted(p.name for p in out.iterdir()) == [f"ckpt_{STEPS - 2:08d}", f"ckpt_{STEPS:08d}", "main.log"]


def test_kill_9_inside_the_checkpoint_writes_of_a_qlora_run(corpus, tmp_path):
    """A run with adapters on an NF4 base writes them with the same atomic steps: killed at the start of each write
    step and at a random moment of a write, it resumes to the uninterrupted run's adapters and moments, bit for bit."""
    args = [*ARGS, "--lora", "4", "--qlora"]
    reference = start(tmp_path, corpus, "ref", "ref.out", args=args)
    kills = [(name, 2, 0) for name in WRITE_STEPS] + [("during", 2, 7)]
    for i, die in enumerate(kills):
        trainer = start(tmp_path, corpus, "out", f"{i}.out", die, args=args)
        assert trainer.wait(timeout=120) == -signal.SIGKILL, (i, die)
    assert start(tmp_path, corpus, "out", "last.out", args=args).wait(timeout=120) == 0
    assert reference.wait(timeout=120) == 0
    out, ref = tmp_path / "out", tmp_path / "ref"
    assert (out / "main.log").read_bytes() == (ref / "main.log").read_bytes()
    final, expected = load_checkpoint(out / f"ckpt_{STEPS:08d}"), load_checkpoint(ref / f"ckpt_{STEPS:08d}")
    assert final["lora"] == expected["lora"] is not None and final["state"]["base"] == expected["state"]["base"]
    for key in ("params", "adam_m", "adam_v"):
        assert np.array_equal(final[key], expected[key]), key
