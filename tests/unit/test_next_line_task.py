"""scripts/make_next_line_task.py: next-line items from a validation shard's text, in the user JSONL format."""

import json
import runpy
from pathlib import Path

import numpy as np
import pytest

from llama.data.datasets import encode_documents
from llama.data.shards import write_shard
from llama.data.tokenizer import ByteTokenizer
from llama.eval.tasks import load_user_task

SCRIPT = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "make_next_line_task.py"))
TEXT = "\n".join(f"line number {i} of the text" if i % 5 else "" for i in range(200))


def test_each_item_is_the_next_line_among_three_distinct_distractors_from_elsewhere():
    lines = TEXT.split("\n")
    items = SCRIPT["next_line_items"](TEXT, 30, 3, seed=1)
    assert len(items) == 30
    for item in items:
        answer = item["choices"][item["label"]]
        i = lines.index(answer)
        assert item["context"] == "\n".join(lines[i - 3:i]) + "\n"
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        assert all(abs(lines.index(c) - i) > 3 for c in item["choices"] if c != answer)
        assert all(c.strip() for c in item["choices"])  # blank lines are never choices


def test_the_items_follow_the_seed():
    items = SCRIPT["next_line_items"](TEXT, 30, 3, seed=1)
    assert SCRIPT["next_line_items"](TEXT, 30, 3, seed=1) == items
    assert SCRIPT["next_line_items"](TEXT, 30, 3, seed=2) != items
    assert {item["label"] for item in items} == {0, 1, 2, 3}


def test_short_lines_and_repeated_lines_are_not_distractors():
    text = "\n".join(["a first line here", "a second line", "a third line", "ok", "the answer line",
                      "the answer line", *[f"filler number {i}" for i in range(10)]])
    for item in SCRIPT["next_line_items"](text, 20, 3, seed=0):
        answer = item["choices"][item["label"]]
        others = [c for i, c in enumerate(item["choices"]) if i != item["label"]]
        assert "ok" not in others and answer not in others


def test_a_text_of_too_few_distinct_lines_is_an_error():
    with pytest.raises(ValueError, match="too few distinct lines"):
        SCRIPT["next_line_items"]("\n".join(["the same line again"] * 50), 5, 2, seed=0)


def test_the_script_writes_a_task_that_eval_loads_from_a_shard(tmp_path, capsys):
    docs = [TEXT[:2000], TEXT[2000:]]
    shard = tmp_path / "val.bin"
    write_shard(shard, encode_documents(docs, ByteTokenizer()), ByteTokenizer.vocab_size)
    assert SCRIPT["validation_text"](shard, ByteTokenizer()) == TEXT
    out = tmp_path / "next_line.jsonl"
    assert SCRIPT["main"](["--val-shard", str(shard), "--out", str(out), "--items", "25"]) == 0
    assert f"wrote 25 items (4 lines of context, 4 choices) from the 200 lines of {shard}" in capsys.readouterr().out
    task = load_user_task(out)
    assert len(task.items) == 25 and all(len(item.choices) == 4 for item in task.items)
    assert json.loads(out.read_text().splitlines()[0])["context"].endswith("\n")


def test_a_shard_of_another_vocabulary_is_one_line_of_error(tmp_path, capsys):
    shard = tmp_path / "val.bin"
    write_shard(shard, np.arange(10, dtype=np.uint32), 128256)
    assert SCRIPT["main"](["--val-shard", str(shard), "--out", str(tmp_path / "x.jsonl")]) == 1
    error = capsys.readouterr().err.splitlines()[-1]  # after the note that the byte-level tokenizer is used
    assert error.startswith(f"error: {shard}: written by a tokenizer with vocab 128256")
