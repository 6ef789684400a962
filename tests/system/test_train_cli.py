"""train_llama.py's command line: values checked by argparse, llm.c's forms, --help, progress lines."""

import re

import numpy as np
import pytest

import train_llama
from llama.data.shards import open_shard, write_shard
from llama.data.tokenizer import ByteTokenizer
from tests.runs import BASE, REPO, log_lines, run


@pytest.mark.parametrize("extra, message", [
    (["-b", "0"], "-b/--batch-size: expected a positive integer, got '0'"),
    (["-t", "0"], "-t/--seq-len: expected a positive integer, got '0'"),
    (["-d", "-128"], "-d/--total-batch-size: expected a positive integer"),
    (["-x", "0"], "-x/--steps: expected a positive number of steps, or -1 for one epoch, got '0'"),
    (["-x", "-5"], "-x/--steps: expected a positive number of steps, or -1 for one epoch, got '-5'"),
    (["--epochs", "0"], "--epochs: expected a finite number > 0, got '0'"),
    (["-l", "-0.001"], "-l/--lr: expected a finite number > 0, got '-0.001'"),
    (["-l", "nan"], "-l/--lr: expected a finite number > 0, got 'nan'"),
    (["-l", "inf"], "-l/--lr: expected a finite number > 0, got 'inf'"),
    (["-u", "-1"], "-u/--warmup: expected an integer >= 0"),
    (["-q", "-0.5"], "-q/--final-lr-frac: expected a fraction in \\[0, 1\\]"),
    (["-q", "1.5"], "-q/--final-lr-frac: expected a fraction in \\[0, 1\\]"),
    (["--grad-clip", "-1"], "--grad-clip: expected a finite number >= 0"),
    (["-v", "-1"], "-v/--val-every: expected an integer >= 0"),
    (["-s", "-1"], "-s/--sample-every: expected an integer >= 0"),
    (["-n", "-1"], "-n/--checkpoint-every: expected an integer >= 0"),
    (["-g", "-1"], "-g/--gen-tokens: expected a positive integer"),
    (["--top-k", "-1"], "--top-k: expected an integer >= 0"),
    (["-m", "0"], "-m/--val-batches: expected a positive integer"),
    (["--seed", "-1"], "--seed: expected an integer >= 0"),
    (["-y", "2"], "-y/--resume: expected 1, 0 or auto, got .2."),
    (["--resume", "--overwrite"], "--resume continues the run in --output-dir, --overwrite replaces it"),
])
def test_bad_values_are_usage_errors(corpus, extra, message, capsys):
    with pytest.raises(SystemExit) as stop:
        run(*BASE, *corpus, "-x", "1", "-o", "out", *extra)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search("error: (argument )?" + message, err), err


def test_val_data_without_train_data_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        run("-e", "tiny", "-x", "1", "-t", "32", "-s", "0", "-j", "val.bin")
    assert stop.value.code == 2
    assert "error: -j/--val-data needs -i/--train-data" in capsys.readouterr().err


@pytest.mark.slow
def test_llmc_forms_resume_with_y_1_and_one_epoch_with_x_minus_1(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "-x", "2", "-o", "out") == 0
    assert run(*BASE, *corpus, "-x", "4", "-o", "out", "-y", "1") == 0
    assert "resuming from out/ckpt_00000002 (step 2)" in capsys.readouterr().out
    assert sorted(log_lines(tmp_path / "out")) == [0, 1, 2, 3]
    write_shard(tmp_path / "short.bin", np.asarray(open_shard(corpus[1])[:1000]), ByteTokenizer.vocab_size)
    assert run(*BASE, "-i", "short.bin", "-x", "-1", "-d", "256", "-v", "0", "-n", "0", "-o", "epoch") == 0
    assert len(log_lines(tmp_path / "epoch")) == 3  # 30 rows of 33 tokens: 3 whole steps of 2 x 4 rows


def test_help_shows_every_default(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as stop:
        train_llama.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    entries = [e for e in re.split(r"\n  (?=-)", text) if e.startswith("-") and not e.startswith("-h, --help")]
    assert len(entries) >= 30
    for entry in entries:
        assert "default" in entry, entry
    assert "(default: 4 on the CPU, 8 on a GPU)" in text and "(default: 0.1)" in text


def test_help_and_readme_agree_on_how_long_the_default_run_takes(capsys):
    with pytest.raises(SystemExit):
        train_llama.main(["--help"])
    assert "the defaults: a few minutes on a CPU" in capsys.readouterr().out
    assert "the run takes a few minutes on a CPU" in (REPO / "README.md").read_text()


STEP_LINE = re.compile(r"^step +(\d+)/6 \| loss (\d+\.\d{6}) \| lr \d\.\d\de[-+]\d\d \| norm \d+\.\d{4} \| "
                       r"\d+\.\d ms \| [\d,]+ tok/s$", re.M)


def test_without_a_terminal_each_step_prints_a_line_and_the_run_ends_with_a_summary(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "-x", "6", "-n", "4", "-o", "out") == 0
    out = capsys.readouterr().out
    printed = {int(step) - 1: loss for step, loss in STEP_LINE.findall(out)}
    logged = {s: line.split("trl:")[1].split()[0] for s, line in log_lines(tmp_path / "out").items()}
    assert printed == logged and sorted(printed) == list(range(6))
    summary = out.strip().splitlines()[-1]
    train_loss, val_loss = float(logged[5]), float(log_lines(tmp_path / "out", "tel")[5].split("tel:")[1])
    assert re.fullmatch(rf"done: step 6/6 \| 6 steps in \d+\.\d s, [\d,]+ tok/s on average \| train loss "
                        rf"{train_loss:.4f} at step 6 \| val loss {val_loss:.4f} at step 5 \| checkpoint "
                        rf"out/ckpt_00000006 \| log out/main.log", summary)


def test_print_every_thins_the_lines(corpus, capsys):
    assert run(*BASE, *corpus, "-x", "6", "-o", "out", "--print-every", "4") == 0
    assert [int(step) for step, _ in STEP_LINE.findall(capsys.readouterr().out)] == [4, 6]  # and always the last


def test_on_a_terminal_the_bar_replaces_the_lines(corpus, capsys, monkeypatch):
    monkeypatch.setattr(train_llama.sys.stdout, "isatty", lambda: True)
    assert run(*BASE, *corpus, "-x", "3", "-o", "out") == 0
    out = capsys.readouterr().out
    assert not STEP_LINE.findall(out) and "done: step 3/3" in out
