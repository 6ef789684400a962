"""train_llama.py on the GPU: agreement with the CPU reference, and exact resume."""

import pytest

from tests.test_signals import check_stop_and_resume_is_exact
from tests.test_train import BASE, check_resume_is_exact, corpus, losses, run  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


def test_gpu_and_cpu_losses_agree_for_20_steps(corpus, tmp_path):
    args = ["-e", "small", "-b", "4", "-t", "64", "-l", "1e-3", "-s", "0", "-v", "0", "-x", "20", *corpus]
    assert run(*args, "-o", "cpu", device="cpu") == 0
    assert run(*args, "-o", "gpu", device="cuda") == 0
    cpu, gpu = losses(tmp_path / "cpu"), losses(tmp_path / "gpu")
    assert len(cpu) == len(gpu) == 20
    worst = max(abs(a - b) for a, b in zip(cpu, gpu))
    print(f"\nworst |gpu - cpu| train loss over 20 steps: {worst:.2e}; last {gpu[-1]:.4f} (first {gpu[0]:.4f})")
    assert worst < 1e-4


def test_gpu_resume_is_exact(corpus, tmp_path):
    check_resume_is_exact(tmp_path, corpus, "cuda")


def test_gpu_ctrl_c_and_resume_reproduce_the_uninterrupted_run(corpus, tmp_path, capfd, monkeypatch):
    check_stop_and_resume_is_exact(tmp_path, corpus, capfd, monkeypatch, "cuda")
