"""Ctrl-C and SIGTERM: the step finishes, a checkpoint is written, the exit code says which signal;
a resumed run prints and logs exactly what the uninterrupted run does."""

import re
import shutil
import signal
import subprocess
import sys

import pytest

from llama.io.checkpoint import load_checkpoint
from tests.runs import SIGNAL_ARGS as ARGS  # samples every 3 steps
from tests.runs import BASE, REPO, check_stop_and_resume_is_exact, log_lines, run, samples, signal_at, wait_for


@pytest.mark.slow
def test_sigint_finishes_the_step_saves_and_resume_matches_the_uninterrupted_run(corpus, tmp_path, capfd, monkeypatch):
    check_stop_and_resume_is_exact(tmp_path, corpus, capfd, monkeypatch, "cpu")


def test_the_summary_after_ctrl_c_gives_each_loss_its_step(corpus, tmp_path, capsys, monkeypatch):
    """Stopped in step 6 of 10, validating every 4: the train loss is step 6's, the val loss step 4's."""
    signal_at(monkeypatch, 5)
    assert run(*BASE, *corpus, "-v", "4", "-x", "10", "-o", "out") == 130
    train = float(log_lines(tmp_path / "out")[5].split("trl:")[1].split()[0])
    val = float(log_lines(tmp_path / "out", "tel")[4].split("tel:")[1])
    assert re.search(rf"^stopped by SIGINT after step 6/10 \| 6 steps in [\d.]+ s, [\d,]+ tok/s on average \| "
                     rf"train loss {train:.4f} at step 6 \| val loss {val:.4f} at step 4 \| "
                     r"checkpoint out/ckpt_00000006",
                     capsys.readouterr().out, re.M)


def test_a_second_ctrl_c_stops_at_once_without_saving(corpus, tmp_path, capsys, monkeypatch):
    signal_at(monkeypatch, 5, times=2)
    assert run(*ARGS, *corpus, "-o", "out") == 130
    err = capsys.readouterr().err
    assert "stopped at once by a second SIGINT, without saving" in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ckpt_00000004", "main.log"]


@pytest.mark.slow
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


@pytest.mark.slow
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
