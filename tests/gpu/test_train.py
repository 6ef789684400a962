"""train_llama.py on the GPU: agreement with the CPU reference, and exact resume."""

import pytest

from tests.runs import BASE, check_resume_is_exact, check_stop_and_resume_is_exact, losses, run

pytestmark = pytest.mark.gpu


def test_gpu_and_cpu_losses_agree_for_20_steps(corpus, tmp_path):
    args = ["-e", "small", "-b", "4", "-t", "64", "-l", "1e-3", "-s", "0", "-v", "0", "-x", "20", "--dtype", "fp32",
            *corpus]
    assert run(*args, "-o", "cpu", device="cpu") == 0
    assert run(*args, "-o", "gpu", device="cuda") == 0
    cpu, gpu = losses(tmp_path / "cpu"), losses(tmp_path / "gpu")
    assert len(cpu) == len(gpu) == 20
    worst = max(abs(a - b) for a, b in zip(cpu, gpu))
    print(f"\nworst |gpu - cpu| train loss over 20 steps: {worst:.2e}; last {gpu[-1]:.4f} (first {gpu[0]:.4f})")
    assert worst < 1e-4


def test_gpu_resume_is_exact(corpus, tmp_path):
    check_resume_is_exact(tmp_path, corpus, "cuda", "--dtype", "fp32")


def test_bf16_is_the_default_and_resume_is_exact(corpus, tmp_path, capsys):
    """d6 (head_dim 64) trains in bf16 by default; a resumed run reproduces it bit for bit."""
    check_resume_is_exact(tmp_path, corpus, "cuda", "-e", "d6", "-t", "64")
    assert "dtype bf16" in capsys.readouterr().out


@pytest.mark.parametrize("recipe, line", [(["--recompute", "full"], "recompute full | adamw"),
                                          (["--optimizer", "adamw8bit"], "recompute partial | adamw8bit"),
                                          (["--optimizer-in-backward"], "recompute partial | adamw in the backward")])
def test_bf16_memory_recipes_resume_exactly(corpus, tmp_path, capsys, recipe, line):
    check_resume_is_exact(tmp_path, corpus, "cuda", "-e", "d6", "-t", "64", *recipe)
    assert line in capsys.readouterr().out


def test_fp32_is_chosen_where_bf16_cannot_run(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "-x", "1", "-o", "out", device="cuda") == 0  # tiny: head_dim 8
    out = capsys.readouterr().out
    assert "dtype fp32" in out and "head_dim 64 or 128, this model's is 8" in out
    assert run(*BASE, *corpus, "-x", "1", "-o", "out2", "--dtype", "bf16", device="cuda") == 2
    assert "--dtype bf16: flash attention takes head_dim 64 or 128" in capsys.readouterr().err


def test_gpu_ctrl_c_and_resume_reproduce_the_uninterrupted_run(corpus, tmp_path, capfd, monkeypatch):
    check_stop_and_resume_is_exact(tmp_path, corpus, capfd, monkeypatch, "cuda")  # tiny: fp32
