"""Ctrl-C and SIGTERM: the step finishes, a checkpoint is written, the exit code says which signal;
a resumed run prints and logs exactly what the uninterrupted run does."""

import shutil
import signal
import subprocess
import sys

import numpy as np

from llama.io.checkpoint import DONE, load_checkpoint
from tests.test_run_dir import REPO, signal_at, wait_for
from tests.test_train import BASE, corpus, log_lines, run, samples  # noqa: F401 (fixture)

ARGS = [*BASE[:-6], "-s", "3", "-g", "8", "-v", "2", "-m", "2", "-x", "10", "-n", "4"]  # samples every 3 steps


def final_state(folder):
    ckpt = load_checkpoint(folder / "ckpt_00000010")
    return ckpt["params"], ckpt["adam_m"], ckpt["adam_v"]


def check_stop_and_resume_is_exact(tmp_path, corpus, capfd, monkeypatch, device):
    assert run(*ARGS, *corpus, "-o", "ref", device=device) == 0
    reference = samples(capfd.readouterr().out)
    assert sorted(reference) == [3, 6, 9, 10]
    unhook = signal_at(monkeypatch, 5)
    assert run(*ARGS, *corpus, "-o", "out", device=device) == 130
    first = capfd.readouterr()
    assert "SIGINT received: finishing this step, then writing a checkpoint" in first.err
    assert "stopped by SIGINT after step 6/10" in first.out and "checkpoint out/ckpt_00000006" in first.out
    assert (tmp_path / "out" / "ckpt_00000006" / DONE).exists()
    unhook()
    assert run(*ARGS, *corpus, "-o", "out", "--resume", device=device) == 0
    second = capfd.readouterr()
    assert "resuming from out/ckpt_00000006 (step 6)" in second.err
    assert {**samples(first.out), **samples(second.out)} == reference and sorted(samples(second.out)) == [6, 9, 10]
    assert (tmp_path / "out" / "main.log").read_bytes() == (tmp_path / "ref" / "main.log").read_bytes()
    for mine, ref in zip(final_state(tmp_path / "out"), final_state(tmp_path / "ref")):
        assert np.array_equal(mine, ref)  # bit for bit


def test_sigint_finishes_the_step_saves_and_resume_matches_the_uninterrupted_run(corpus, tmp_path, capfd, monkeypatch):
    check_stop_and_resume_is_exact(tmp_path, corpus, capfd, monkeypatch, "cpu")


def test_a_second_ctrl_c_stops_at_once_without_saving(corpus, tmp_path, capsys, monkeypatch):
    signal_at(monkeypatch, 5, times=2)
    assert run(*ARGS, *corpus, "-o", "out") == 130
    err = capsys.readouterr().err
    assert "stopped at once by a second SIGINT, without saving" in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ckpt_00000004", "main.log"]


def test_resumed_samples_match_the_uninterrupted_run(corpus, tmp_path, capsys):
    """Defect 7: the sample at a resume step that is a multiple of -s was skipped, and every later one
    differed."""
    assert run(*ARGS, *corpus, "-n", "3", "-nk", "0", "-o", "a") == 0
    uninterrupted = samples(capsys.readouterr().out)
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "ckpt_00000006", tmp_path / "b" / "ckpt_00000006")
    (tmp_path / "a" / "main.log").replace(tmp_path / "b" / "main.log")
    assert run(*ARGS, *corpus, "-n", "3", "-o", "b", "--resume") == 0
    resumed = samples(capsys.readouterr().out)
    assert sorted(resumed) == [6, 9, 10]
    assert resumed == {step: text for step, text in uninterrupted.items() if step >= 6}


def test_sigterm_from_outside_saves_and_exits_143(corpus, tmp_path):
    trainer = subprocess.Popen([sys.executable, str(REPO / "train_llama.py"), *BASE, *corpus, "-x", "100000", "-v", "0",
                                "-n", "0", "-o", "out", "--device", "cpu"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(log_lines(tmp_path / "out")) >= 3 if (tmp_path / "out" / "main.log").exists() else False)
        trainer.send_signal(signal.SIGTERM)
        out, err = trainer.communicate(timeout=60)
    finally:
        trainer.kill()
    assert trainer.returncode == 143, err
    steps = len(log_lines(tmp_path / "out"))
    assert "SIGTERM received" in err and f"stopped by SIGTERM after step {steps}/100000" in out
    assert load_checkpoint(tmp_path / "out" / f"ckpt_{steps:08d}")["state"]["step"] == steps
