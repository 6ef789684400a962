"""train_llama.py end to end on a tiny model and a tiny corpus (CPU)."""

import math
import re
import shutil

import numpy as np
import pytest

from llama.io.checkpoint import DONE, latest_checkpoint, load_checkpoint
from tests.runs import BASE, check_resume_is_exact, log_lines, losses, run
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


@pytest.mark.slow
def test_half_written_checkpoint_is_ignored(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "-x", "8", "-n", "4", "-o", "out") == 0
    crashed = tmp_path / "out" / "ckpt_00000012"
    shutil.copytree(tmp_path / "out" / "ckpt_00000008", crashed)
    (crashed / DONE).unlink()  # a crash before the marker
    (tmp_path / "out" / ".tmp_ckpt_00000016").mkdir()
    assert latest_checkpoint(tmp_path / "out").name == "ckpt_00000008"
    assert run(*BASE, *corpus, "-x", "10", "-n", "5", "-o", "out", "--resume") == 0
    assert "resuming from out/ckpt_00000008 (step 8)" in capsys.readouterr().err
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
    err = capsys.readouterr().err
    assert "built-in corpus" in err and "download_starter_pack" in err and "byte-level tokenizer" in err
    assert len(log_lines(tmp_path / "out")) == 3


def test_epochs_set_the_number_of_steps(corpus, tmp_path):
    from llama.data.dataloader import DataLoader
    batches = DataLoader(corpus[1], 4, 32).batches_per_epoch
    assert run(*BASE, *corpus, "--epochs", "0.1", "-d", "256", "-v", "0", "-o", "out") == 0
    assert len(log_lines(tmp_path / "out")) == math.ceil(0.1 * batches / 2)  # 2 micro-batches per step
