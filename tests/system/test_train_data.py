"""train_llama.py checks its data before the first step and says what is wrong in one line (issue 63 items 3 to
5, 13 to 15, 17): a prepared dataset only whole, every loss mask of the shard's length, something for --sft to
count, a note for loss masks without --sft and for a document mask without documents, and a `data:` line."""

import json

import numpy as np
import pytest

from llama.data.prepare import PrepareOptions, prepare_dataset
from llama.data.shards import write_mask, write_shard
from llama.data.tokenizer import ByteTokenizer
from tests.runs import BASE, TEXT, log_lines, run

BYTES = ByteTokenizer()
QUICK = [*BASE, "-x", "1", "-v", "0", "-o", "out"]


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """A dataset prepare_data made of the tiny corpus (byte-level, several shards), tmp_path the working folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": part}) + "\n" for part in TEXT.split("\n\n")))
    prepare_dataset([str(tmp_path / "corpus.jsonl")], BYTES,
                    PrepareOptions("c", tmp_path / "data", val_every=10, shard_tokens=20_000))
    return tmp_path / "data"


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("error: ") == 1, err
    return err.strip().splitlines()[-1]


def test_a_prepared_dataset_trains_with_a_data_line(prepared, tmp_path, capsys):
    assert run(*QUICK, "-i", "data/c_train_*.bin", "-j", "data/c_val_*.bin") == 0
    out = capsys.readouterr().out
    assert "data: train data/c_train_*.bin (3 shards, " in out and ", val data/c_val_*.bin (1 shard, " in out


def test_a_dataset_without_its_manifest_is_refused_before_the_run(prepared, tmp_path, capsys):
    """Item 3: the shards a killed preparation left were trained on without a word."""
    (prepared / "c.manifest.json").unlink()
    assert run(*QUICK, "-i", "data/c_train_*.bin") == 2
    assert error_line(capsys).startswith("error: data holds shards of c but not its manifest c.manifest.json, which "
                                         "scripts/prepare_data.py writes last: the preparation did not finish")
    assert not (tmp_path / "out").exists()


def chat_shards(folder, masks):
    """Unmarked shards (as written before manifests) with the given loss masks."""
    folder.mkdir()
    for i, mask in enumerate(masks):
        write_shard(folder / f"chat_{i}.bin", np.arange(mask.size) % 200 + 1, BYTES.vocab_size)
        write_mask(folder / f"chat_{i}.mask.bin", mask)
    return str(folder / "chat_*.bin")


def test_a_loss_mask_shorter_than_its_shard_stops_the_run_before_its_first_step(tmp_path, monkeypatch, capsys):
    """Item 4: 45 steps trained before the loader reached the short mask."""
    monkeypatch.chdir(tmp_path)
    pattern = chat_shards(tmp_path / "chat", [np.ones(3000, np.uint8)] * 2 + [np.ones(2990, np.uint8)])
    write_shard(tmp_path / "chat" / "chat_2.bin", np.arange(3000) % 200 + 1, BYTES.vocab_size)
    assert run(*QUICK, "-i", pattern, "--sft") == 2
    assert error_line(capsys).endswith("chat_2.mask.bin: a mask of 2990 tokens in 4014 bytes, but its shard holds "
                                       "3000 tokens")
    assert not (tmp_path / "out").exists()


def test_sft_with_nothing_counted_is_an_error_and_masks_without_sft_a_note(tmp_path, monkeypatch, capsys):
    """Items 5 and 13: conversations without a reply trained at loss 0.000000; masks without --sft said nothing."""
    monkeypatch.chdir(tmp_path)
    pattern = chat_shards(tmp_path / "chat", [np.zeros(3000, np.uint8)] * 2)
    assert run(*QUICK, "-i", pattern, "--sft") == 2
    assert error_line(capsys) == (f"error: --sft: the loss masks of {pattern} count no token (conversations without "
                                  "an assistant reply): nothing to learn from; prepare conversations with replies")
    assert run(*QUICK, "-i", pattern) == 0
    assert (f"note: {pattern} has loss masks (.mask.bin: chat data), which count only without --sft: every token is "
            "trained on; pass --sft to train on the assistant's replies") in capsys.readouterr().err


def test_a_document_mask_without_documents_says_so(tmp_path, monkeypatch, capsys):
    """Item 15: --doc-mask on with data that holds no <|begin_of_text|> trained as off, without a word."""
    monkeypatch.chdir(tmp_path)
    write_shard(tmp_path / "plain.bin", np.frombuffer(TEXT.encode(), np.uint8), BYTES.vocab_size)
    assert run(*QUICK, "-i", "plain.bin", "--doc-mask", "on") == 0
    assert ("note: --doc-mask: the first shard of plain.bin holds no <|begin_of_text|> (id 256) to start a document, "
            "so every row attends as with --doc-mask off") in capsys.readouterr().err
    assert len(log_lines(tmp_path / "out")) == 1


@pytest.mark.parametrize("data, message", [
    (["-i", "corpus.jsonl"], "corpus.jsonl is a .jsonl file, not token shards: tokenize it first with python3 "
                             "scripts/prepare_data.py corpus.jsonl and pass the shards it writes"),
    (["-i", "data"], "data is a folder: name its shards with a glob, e.g. -i 'data/*_train_*.bin'"),
    (["-i", "data/c_val_*.bin", "-b", "200"], "data/c_val_*.bin: a step reads 200 rows of 33 tokens from one shard, "
                                              "and the largest of its 1 shard(s) holds 4,"),
])
def test_what_is_not_training_data_is_named_with_what_to_run(prepared, data, message, capsys):
    """Item 14: a .txt was 'bad magic number 1952540759', too little data 'no shard holds one batch'."""
    assert run(*QUICK, *data) == 2
    assert error_line(capsys).startswith(f"error: {message}")
