"""train_llama.py end to end on a tiny model and a tiny corpus (CPU)."""

import math
import os
import re
import resource
import shutil
import subprocess
import sys

import numpy as np
import pytest

from llama.run import trainer
from llama.io.checkpoint import DONE, latest_checkpoint, load_checkpoint
from tests.runs import BASE, REPO, check_resume_is_exact, log_lines, losses, run
from tests.sample_files import ranks_file_bytes


def test_loss_falls_and_log_is_written(corpus, tmp_path):
    assert run(*BASE, *corpus, "-x", "40", "-o", "out") == 0
    train = losses(tmp_path / "out")
    assert len(train) == 40 and np.mean(train[-5:]) < train[0] - 1.0
    assert losses(tmp_path / "out", "tel")[-1] < losses(tmp_path / "out", "tel")[0] - 1.0
    assert latest_checkpoint(tmp_path / "out").name == "ckpt_00000040"


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(corpus, tmp_path):
    check_resume_is_exact(tmp_path, corpus, "cpu")


@pytest.mark.parametrize("recipe", [["--recompute", "full", "--optimizer", "adamw8bit"],
                                    ["--optimizer-in-backward", "--optimizer", "adamw8bit"]])
def test_memory_recipes_resume_exactly(corpus, tmp_path, recipe):
    """Each recipe's run and its resume agree bit for bit (with the optimizer in the backward each
    gradient group's latest norm, from which the clip norm is estimated, comes back from the checkpoint),
    and train about as the plain run does."""
    check_resume_is_exact(tmp_path, corpus, "cpu", *recipe)
    assert run(*BASE, *corpus, "-x", "8", "-n", "4", "-o", "plain") == 0
    mine, plain = losses(tmp_path / "a"), losses(tmp_path / "plain")
    assert mine != plain and abs(mine[-1] - plain[-1]) < 0.05


def test_full_recompute_changes_no_bit_and_the_optimizer_in_the_backward_takes_one_micro_batch(corpus, tmp_path,
                                                                                                capsys):
    assert run(*BASE, *corpus, "-x", "8", "-n", "4", "-o", "plain") == 0
    assert run(*BASE, *corpus, "-x", "8", "-n", "4", "-o", "full", "--recompute", "full") == 0
    assert (tmp_path / "full" / "main.log").read_bytes() == (tmp_path / "plain" / "main.log").read_bytes()
    assert run(*BASE, *corpus, "-x", "2", "-o", "accum", "--optimizer-in-backward", "-d", "256") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --optimizer-in-backward updates the weights in each backward, so a step is one micro-batch: "
        "--total-batch-size must be B*T*GPUs (128), not 256")


@pytest.mark.slow
def test_half_written_checkpoint_is_ignored(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "-x", "8", "-n", "4", "-o", "out") == 0
    crashed = tmp_path / "out" / "ckpt_00000012"
    shutil.copytree(tmp_path / "out" / "ckpt_00000008", crashed)
    (crashed / DONE).unlink()  # a crash before the marker
    (tmp_path / "out" / ".tmp_ckpt_00000016").mkdir()
    assert latest_checkpoint(tmp_path / "out").name == "ckpt_00000008"
    assert run(*BASE, *corpus, "-x", "10", "-n", "5", "-o", "out", "--resume") == 0
    assert "resuming from out/ckpt_00000008 (step 8)" in capsys.readouterr().out
    assert sorted(log_lines(tmp_path / "out"))[-2:] == [8, 9]


def test_keeps_the_last_k_checkpoints(corpus, tmp_path):
    assert run(*BASE, *corpus, "-x", "6", "-n", "2", "-nk", "2", "-o", "out") == 0
    assert sorted(p.name for p in (tmp_path / "out").glob("ckpt_*")) == ["ckpt_00000004", "ckpt_00000006"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy reports the overflow we provoke
def test_divergence_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "-x", "4", "-n", "4", "-o", "out") == 0
    assert run(*BASE[:6], "-l", "1e38", "-u", "0", "-s", "0", "-v", "0", *corpus, "-x", "20", "-n", "1",
               "-o", "out", "--resume") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "not finite" in err and "stopping" in err and "The last good checkpoint is out/ckpt_" in err
    assert (tmp_path / "out" / "ckpt_00000004" / DONE).exists()
    for ckpt in (tmp_path / "out").glob("ckpt_*"):
        assert np.isfinite(load_checkpoint(ckpt)["params"]).all(), ckpt


@pytest.mark.parametrize("extra, message", [
    (["-e", "gpt7"], "unknown preset 'gpt7'"),
    (["-i", "nothing_*.bin"], "no shard files match nothing_"),
    (["--tokenizer", "missing.model"], "tokenizer file not found"),
    (["-d", "100"], "must be a positive multiple of B\\*T"),
    (["-t", "100"], "exceeds the model's max_seq_len 64"),
])
def test_bad_inputs_exit_with_one_line(corpus, extra, message, capsys):
    assert run(*BASE, *corpus, "-x", "2", "-o", "out", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and re.search(message, err), err


@pytest.mark.slow
def test_checkpoint_that_does_not_fit(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "-x", "2", "-o", "out") == 0
    assert run(*BASE, *corpus, "-x", "4", "-o", "out", "--resume", "-e", "small") == 2
    assert "does not match --model small" in capsys.readouterr().err
    args = [a if a != "4" else "2" for a in BASE]  # batch size 2 instead of 4: half the tokens per step
    assert run(*args, *corpus, "-x", "4", "-o", "out", "--resume") == 2
    assert "made with tokens_per_step 128, this run asks for 64" in capsys.readouterr().err
    assert run(*args, *corpus, "-x", "4", "-o", "out", "--resume", "-d", "128") == 0  # the same step in 2 micro-batches
    assert sorted(log_lines(tmp_path / "out")) == [0, 1, 2, 3]


def test_data_from_another_tokenizer(corpus, tmp_path, capsys):
    (tmp_path / "tok.model").write_bytes(ranks_file_bytes())
    assert run(*BASE, *corpus, "-x", "2", "-o", "out", "--tokenizer", "tok.model") == 2
    assert "written by a tokenizer with vocab 264, but the model's vocab is 517" in capsys.readouterr().err


@pytest.mark.slow
def test_defaults_use_the_builtin_corpus(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run("-x", "3", "-t", "64", "-v", "0", "-s", "0") == 0
    out, err = capsys.readouterr()
    assert "built-in corpus" in out and "download_starter_pack" in out and "byte-level tokenizer" in err
    assert len(log_lines(tmp_path / "out")) == 3


def test_epochs_set_the_number_of_steps(corpus, tmp_path):
    from llama.data.dataloader import DataLoader
    batches = DataLoader(corpus[1], 4, 32).batches_per_epoch
    assert run(*BASE, *corpus, "--epochs", "0.1", "-d", "256", "-v", "0", "-o", "out") == 0
    assert len(log_lines(tmp_path / "out")) == math.ceil(0.1 * batches / 2)  # 2 micro-batches per step


GIB = 2**30
# the refusal names what would fit: a recipe, a smaller batch, or both (llama/run/memory.py what_would_fit)
NO_MEMORY = r"the run needs about [\d,]+\.\d GiB of host memory, [\d,]+\.\d [GM]iB available; [-\w ]+ would fit" \
            r"( \(-d keeps the tokens per step\))?"


def test_the_readme_gpu_command_on_a_cpu_is_refused_in_one_line(corpus, tmp_path, monkeypatch, capsys):
    """-e d12 -b 8 -t 1024 on a CPU: a note that it is sized for a GPU, then the memory check's refusal
    (here of a machine with 4 GiB free) before anything large is allocated, and no lock left behind."""
    monkeypatch.setattr(trainer, "host_available", lambda: 4 * GIB)
    assert run(*corpus, "-e", "d12", "-b", "8", "-t", "1024", "-x", "2000", "-o", "out/d12") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(line.startswith("note: this run computes") and "sized for a GPU" in line for line in err)
    assert re.fullmatch("error: " + NO_MEMORY, err[-1]), err[-1]
    assert not (tmp_path / "out" / "d12" / "train.lock").exists()


def test_the_run_says_what_memory_it_needs(corpus, capsys):
    assert run(*BASE, *corpus, "-x", "1", "-o", "out") == 0
    assert re.search(r"^memory: the run needs about [\d.]+ MiB of host memory, [\d,.]+ [GM]iB available$",
                     capsys.readouterr().out, re.M)


@pytest.mark.slow
def test_a_batch_too_big_for_a_memory_cap_is_one_line(corpus, tmp_path):
    """-b 5000 -t 512 under ulimit -v 2 GiB: refused by the memory check, not a MemoryError."""
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (2 * GIB, 2 * GIB))
    result = subprocess.run([sys.executable, str(REPO / "train_llama.py"), "-e", "small", "-b", "5000", "-t", "512",
                             *corpus, "-x", "1", "--device", "cpu"], capture_output=True, text=True, cwd=tmp_path,
                            preexec_fn=cap, env={"PYTHONPATH": str(REPO), "LLAMA_PACKAGE_INDEX": "http://127.0.0.1:9/",
                                                 "LLAMA_CUDA_CACHE": os.environ["LLAMA_CUDA_CACHE"]})
    assert result.returncode == 2, result.stderr
    assert re.fullmatch("error: " + NO_MEMORY, result.stderr.strip().splitlines()[-1]), result.stderr


def test_running_out_of_memory_past_the_check_is_one_line(corpus, monkeypatch, capsys):
    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 3.00 GiB for an array")
    monkeypatch.setattr(trainer, "build_model", no_memory)
    assert run(*BASE, *corpus, "-x", "1", "-o", "out") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: out of memory (Unable to allocate 3.00 GiB for an array); lower -b or -t, or train a smaller model")


def test_meta_presets_need_the_llama3_tokenizer(corpus, capsys):
    assert run(*BASE, *corpus, "-e", "llama3.2-1b", "-x", "1", "-o", "out") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: -e llama3.2-1b is Meta's model, made for the Llama 3 tokenizer (vocab 128256), but the tokenizer here "
        "is bytes (vocab 264); get it with python3 scripts/download_starter_pack.py, or pass it with --tokenizer")
