"""Running train_llama.py in the tests: the tiny corpus text and base arguments, runs in this process,
their main.log and samples, signals at a chosen step, and the exact-resume checks that the CPU and
GPU tests share. REPO is the repository root."""

import os
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np

import train_llama
from llama.run import trainer
from llama.io.checkpoint import DONE, load_checkpoint, moment_tensors

REPO = Path(__file__).resolve().parents[1]

TEXT = "\n\n".join(f"ROMEO {i % 7}:\nWhat light through yonder window breaks? It is the east.\n"
                   f"JULIET {i % 5}:\nO Romeo, Romeo, wherefore art thou Romeo?" for i in range(400)) + "\n"
BASE = ["-e", "tiny", "-b", "4", "-t", "32", "-l", "3e-3", "-s", "0", "-v", "2", "-m", "2"]


def run(*args, device="cpu"):
    return train_llama.main([*args, "--device", device])


def log_lines(out_dir, kind="trl"):
    lines = (out_dir / "main.log").read_text().splitlines()
    return {int(l.split()[0][2:]): l for l in lines if f" {kind}:" in l}


def losses(out_dir, kind="trl"):
    return [float(l.split(f"{kind}:")[1].split()[0]) for _, l in sorted(log_lines(out_dir, kind).items())]


def checkpoint_steps(out_dir) -> list[int]:
    """The steps of the checkpoint folders in out_dir, complete or not."""
    return sorted(int(p.name[5:]) for p in out_dir.glob("ckpt_*"))


def samples(stdout: str) -> dict[int, str]:
    """{step: text} of the complete samples a run printed."""
    return {int(step): text for step, text in re.findall(r"--- sample at step (\d+) ---\n(.*?)\n---\n", stdout, re.S)}


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def signal_at(monkeypatch, step: int, signum=signal.SIGINT, times: int = 1):
    """Send this process `signum` `times` times while step `step` runs (from its learning-rate lookup).
    Returns a function that removes the hook."""
    real = trainer.learning_rate

    def hooked(s, *args, **kwargs):
        if s == step:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return real(s, *args, **kwargs)

    monkeypatch.setattr(trainer, "learning_rate", hooked)
    return lambda: monkeypatch.setattr(trainer, "learning_rate", real)


def check_resume_is_exact(tmp_path, corpus, device, *extra):
    """extra arguments (another model, --dtype) come after BASE and override it."""
    assert run(*BASE, *extra, *corpus, "-x", "8", "-n", "4", "-nk", "0", "-o", "a", device=device) == 0
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "ckpt_00000004", tmp_path / "b" / "ckpt_00000004")
    assert run(*BASE, *extra, *corpus, "-x", "8", "-n", "4", "-o", "b", "--resume", device=device) == 0
    a, b = log_lines(tmp_path / "a"), log_lines(tmp_path / "b")
    assert sorted(b) == [4, 5, 6, 7] and all(a[s] == b[s] for s in b)
    assert log_lines(tmp_path / "b", "tel") == {s: l for s, l in log_lines(tmp_path / "a", "tel").items() if s >= 4}
    final_a, final_b = load_checkpoint(tmp_path / "a" / "ckpt_00000008"), load_checkpoint(tmp_path / "b" / "ckpt_00000008")
    arrays_a, arrays_b = checkpoint_arrays(final_a), checkpoint_arrays(final_b)
    for key in arrays_a:
        assert np.array_equal(arrays_a[key], arrays_b[key]), key  # bit for bit
    assert final_a["state"]["loader"] == final_b["state"]["loader"]


# the run that check_stop_and_resume_is_exact stops and resumes (tests/system/test_signals.py's ARGS)
SIGNAL_ARGS = [*BASE[:-6], "-s", "3", "-g", "8", "-v", "2", "-m", "2", "-x", "10", "-n", "4"]  # samples every 3 steps


def checkpoint_arrays(ckpt) -> dict[str, np.ndarray]:
    """A loaded checkpoint's weights and moments by name (8-bit moments as their codes and scales)."""
    return {"params": ckpt["params"], **moment_tensors(ckpt["adam_m"], ckpt["adam_v"])}


def final_state(folder) -> list[np.ndarray]:
    return list(checkpoint_arrays(load_checkpoint(folder / "ckpt_00000010")).values())


def check_stop_and_resume_is_exact(tmp_path, corpus, capfd, monkeypatch, device):
    assert run(*SIGNAL_ARGS, *corpus, "-o", "ref", device=device) == 0
    reference = samples(capfd.readouterr().out)
    assert sorted(reference) == [3, 6, 9, 10]
    unhook = signal_at(monkeypatch, 5)
    assert run(*SIGNAL_ARGS, *corpus, "-o", "out", device=device) == 130
    first = capfd.readouterr()
    assert "SIGINT received: finishing this step, then writing a checkpoint" in first.err
    assert "stopped by SIGINT after step 6/10" in first.out and "checkpoint out/ckpt_00000006" in first.out
    assert (tmp_path / "out" / "ckpt_00000006" / DONE).exists()
    unhook()
    assert run(*SIGNAL_ARGS, *corpus, "-o", "out", "--resume", device=device) == 0
    second = capfd.readouterr()
    assert "resuming from out/ckpt_00000006 (step 6)" in second.out
    assert {**samples(first.out), **samples(second.out)} == reference and sorted(samples(second.out)) == [6, 9, 10]
    assert (tmp_path / "out" / "main.log").read_bytes() == (tmp_path / "ref" / "main.log").read_bytes()
    for mine, ref in zip(final_state(tmp_path / "out"), final_state(tmp_path / "ref")):
        assert np.array_equal(mine, ref)  # bit for bit
