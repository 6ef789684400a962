"""scripts/prepare_data.py's logic (llama/data/prepare.py): inputs, framing, splits, shards, bad input, chat."""

import json
import re
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from llama.data import prepare
from llama.data.dataloader import DataLoader
from llama.data.prepare import PrepareError, PrepareOptions, chat_tokens_and_mask, prepare_dataset
from llama.data.shards import ShardError, mask_path, open_mask, open_shard, write_mask, write_shard
from llama.data.tokenizer import ByteTokenizer, Llama3Tokenizer
from tests.sample_files import ranks_file_bytes

BYTES = ByteTokenizer()
BOS, EOS = BYTES.bos_id, BYTES.eos_id


@pytest.fixture
def llama3(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(ranks_file_bytes())  # 256 bytes + 5 merges: ids 0..260, specials from 261
    return Llama3Tokenizer(path)


def run(tmp_path, inputs, tokenizer=BYTES, **options):
    options = {"name": "d", "out_dir": tmp_path / "out", "val_every": 0} | options
    return prepare_dataset([str(i) for i in inputs], tokenizer, PrepareOptions(**options))


def tokens_of(summary, split):
    paths = summary.writers[split].paths
    return np.concatenate([open_shard(p) for p in paths]) if paths else np.zeros(0, np.uint32)


def framed(*texts):
    return [t for text in texts for t in [BOS, *text.encode(), EOS]]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_folder_of_txt_files_is_one_document_per_file_framed_bos_eos(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "b.txt").write_text("beta")
    (tmp_path / "in" / "sub" / "a.txt").write_text("alpha\n\nstill alpha")
    (tmp_path / "in" / "notes.md").write_text("not an input")
    summary = run(tmp_path, [tmp_path / "in"])
    assert tokens_of(summary, "train").tolist() == framed("beta", "alpha\n\nstill alpha")  # sorted paths
    assert [p.name for p in summary.writers["train"].paths] == ["d_train_000000.bin"]
    assert summary.writers["train"].documents == 2 and not summary.writers["val"].paths


def test_jsonl_with_a_chosen_text_field_and_a_glob(tmp_path):
    write_jsonl(tmp_path / "1.jsonl", [{"body": "one", "id": 1}, {"body": "two"}])
    (tmp_path / "2.jsonl").write_text('{"body": "three"}\n\n   \n')  # blank lines are no documents
    summary = run(tmp_path, [tmp_path / "*.jsonl"], text_field="body")
    assert tokens_of(summary, "train").tolist() == framed("one", "two", "three")


def test_a_json_array_is_one_document_per_object(tmp_path):
    (tmp_path / "data00.json").write_text(json.dumps([{"story": "once"}, {"story": "upon"}]))
    assert tokens_of(run(tmp_path, [tmp_path], text_field="story"), "train").tolist() == framed("once", "upon")
    (tmp_path / "data00.json").write_text(json.dumps([{"story": "once"}, "upon"]))
    with pytest.raises(PrepareError, match=r"data00\.json: record 2: a JSON str, not an object"):
        run(tmp_path, [tmp_path], text_field="story", overwrite=True)
    (tmp_path / "data00.json").write_text('[{"story": "once"},\n{"story": }]')
    with pytest.raises(PrepareError, match=r"data00\.json:2: invalid JSON"):
        run(tmp_path, [tmp_path], text_field="story", overwrite=True)


def test_every_nth_document_goes_to_validation(tmp_path):
    write_jsonl(tmp_path / "x.jsonl", [{"text": str(i)} for i in range(7)])
    summary = run(tmp_path, [tmp_path / "x.jsonl"], val_every=3)
    assert tokens_of(summary, "val").tolist() == framed("0", "3", "6")
    assert tokens_of(summary, "train").tolist() == framed("1", "2", "4", "5")
    assert [p.name for p in summary.writers["val"].paths] == ["d_val_000000.bin"]


def test_shards_hold_exactly_shard_tokens_and_documents_cross_them(tmp_path):
    write_jsonl(tmp_path / "x.jsonl", [{"text": "abcdefg"[: i % 7 + 1]} for i in range(20)])
    whole = tokens_of(run(tmp_path, [tmp_path / "x.jsonl"], name="whole"), "train")
    summary = run(tmp_path, [tmp_path / "x.jsonl"], shard_tokens=16)
    sizes = [open_shard(p).size for p in summary.writers["train"].paths]
    assert sizes == [16] * (whole.size // 16) + ([whole.size % 16] if whole.size % 16 else [])
    assert [p.name for p in summary.writers["train"].paths][:2] == ["d_train_000000.bin", "d_train_000001.bin"]
    assert np.array_equal(tokens_of(summary, "train"), whole)


def test_streaming_a_corpus_many_times_the_shard_size_keeps_memory_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "CHUNK_BYTES", 100_000)  # chunks of 50 documents
    doc = "x" * 2000
    write_jsonl(tmp_path / "big.jsonl", [{"text": doc}] * 4000)  # 8M tokens, 32 MB as uint32
    tracemalloc.start()
    summary = run(tmp_path, [tmp_path / "big.jsonl"], shard_tokens=250_000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(summary.writers["train"].paths) == 33 and summary.writers["train"].total_tokens == 4000 * 2002
    assert peak < 6_000_000  # a few shards (1 MB) and chunks of documents (0.4 MB), never the 32 MB corpus


def test_workers_give_the_same_shards_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "CHUNK_DOCUMENTS", 3)  # many chunks in flight
    write_jsonl(tmp_path / "x.jsonl", [{"text": f"document {i} " * (i % 5)} for i in range(40)])
    one = run(tmp_path, [tmp_path / "x.jsonl"], name="one", val_every=4, shard_tokens=50)
    two = run(tmp_path, [tmp_path / "x.jsonl"], name="two", val_every=4, shard_tokens=50, workers=2)
    for split in ("train", "val"):
        assert [p.read_bytes() for p in one.writers[split].paths] == [p.read_bytes() for p in two.writers[split].paths]


@pytest.mark.parametrize("line, error", [
    (b'{"text": "ok"', "x.jsonl:2: invalid JSON"),
    (b'{"title": "no text"}', "x.jsonl:2: no 'text' field"),
    (b'{"text": 7}', "x.jsonl:2: a int, not a string"),
    (b'["a", "list"]', "x.jsonl:2: a JSON list, not an object"),
    (b'{"text": "caf\xe9"}', "x.jsonl:2: not UTF-8 (byte 0xe9"),
])
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, line, error):
    (tmp_path / "x.jsonl").write_bytes(b'{"text": "fine"}\n' + line + b'\n{"text": "after"}\n')
    with pytest.raises(PrepareError, match="^.*" + re.escape(error)) as e:
        run(tmp_path, [tmp_path / "x.jsonl"])
    assert "\n" not in str(e.value) and str(tmp_path / "x.jsonl") in str(e.value)
    assert not list((tmp_path / "out").glob("*"))  # nothing left behind


def test_an_unterminated_string_is_not_at_at_its_column(tmp_path):
    """Issue 63 item 17: "Unterminated string starting at at column 10"."""
    (tmp_path / "a.json").write_text('[{"text": "once}]')
    with pytest.raises(PrepareError, match=re.escape("a.json:1: invalid JSON (Unterminated string starting at column 11)")):
        run(tmp_path, [tmp_path / "a.json"])


def test_a_txt_file_that_is_not_utf8_names_its_line(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"line one\nline two\nbad \xff here\n")
    with pytest.raises(PrepareError, match=r"a\.txt:3: not UTF-8 \(byte 0xff\)"):
        run(tmp_path, [tmp_path / "a.txt"])


def test_skip_bad_counts_the_skipped_records(tmp_path):
    (tmp_path / "x.jsonl").write_bytes(b'{"text": "a"}\nnot json\n{"text": "b"}\n{"t": 1}\n')
    summary = run(tmp_path, [tmp_path / "x.jsonl"], skip_bad=True)
    assert tokens_of(summary, "train").tolist() == framed("a", "b")
    assert summary.skipped == 2 and "skipped: 2 bad records (--skip-bad)" in summary.lines()


def test_missing_inputs_and_unknown_kinds_are_errors(tmp_path):
    with pytest.raises(PrepareError, match="no such file"):
        run(tmp_path, [tmp_path / "missing.txt"])
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(PrepareError, match=r"unknown input kind '\.csv'"):
        run(tmp_path, [tmp_path / "a.csv"])


def test_parquet_without_pyarrow_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(PrepareError, match=r"x\.parquet: reading \.parquet needs pyarrow \(pip install pyarrow\)$"):
        run(tmp_path, [tmp_path / "x.parquet"])


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["one", "two"], "n": [1, 2]}), tmp_path / "x.parquet")
    assert tokens_of(run(tmp_path, [tmp_path / "x.parquet"]), "train").tolist() == framed("one", "two")


def test_existing_shards_are_kept_unless_overwrite(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    run(tmp_path, [tmp_path / "a.txt"])
    with pytest.raises(PrepareError, match="already holds d's shards.*--overwrite"):
        run(tmp_path, [tmp_path / "a.txt"])
    (tmp_path / "a.txt").write_text("second")
    assert tokens_of(run(tmp_path, [tmp_path / "a.txt"], overwrite=True), "train").tolist() == framed("second")


def test_an_interrupt_leaves_no_shard_behind(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "x.jsonl", [{"text": "abcdefgh"}] * 10)
    written = []

    def interrupt_on_the_third(path, *args, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(path)
        real_write(path, *args, **kwargs)

    real_write = prepare.write_shard
    monkeypatch.setattr(prepare, "write_shard", interrupt_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, [tmp_path / "x.jsonl"], shard_tokens=10)
    assert len(written) == 2 and not (tmp_path / "out").exists()  # the folder made for the dataset too


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "the end?"},
                {"role": "assistant", "content": "in the end"}]


def test_a_conversation_is_exactly_what_encode_chat_renders(llama3):
    ids, mask = chat_tokens_and_mask(llama3, CONVERSATION)
    prompt = llama3.encode_chat(CONVERSATION[:-1])  # what generate.py --chat sends, ending with the header
    assert ids.tolist() == prompt + llama3.encode("in the end") + [llama3.eot_id]
    assert ids.tolist() == llama3.encode_chat(CONVERSATION)[:-len(llama3.encode_header("assistant"))]
    assert mask.shape == ids.shape


def test_the_loss_mask_counts_assistant_content_and_eot_only(tmp_path, llama3):
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "ok"}]}])
    summary = run(tmp_path, [tmp_path / "chat.jsonl"], tokenizer=llama3)
    bos, eos, start, end, eot = 261, 262, 267, 268, 270  # 261 ranks, then Meta's special tokens in order
    nl = [10, 10]
    expected = ([bos, start, *b"user", end, *nl, *b"hi", eot] + [start, *b"assistant", end, *nl]
                + [*b"ok", eot] + [eos])
    counted = [0] * (1 + 1 + 4 + 1 + 2 + 2 + 1) + [0] * (1 + 9 + 1 + 2) + [1, 1, 1] + [0]
    shard = summary.writers["train"].paths[0]
    assert open_shard(shard).tolist() == expected
    assert open_mask(mask_path(shard), len(expected)).tolist() == counted
    assert "conversations with loss masks" in summary.lines()[0]


def test_chat_data_must_be_chat_throughout_and_needs_the_llama3_tokenizer(tmp_path, llama3):
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, {"text": "plain"}])
    with pytest.raises(PrepareError, match=r"chat\.jsonl:2: no 'messages' list"):
        run(tmp_path, [tmp_path / "chat.jsonl"], tokenizer=llama3)
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "robot", "content": "beep"}]}])
    with pytest.raises(PrepareError, match=r"chat\.jsonl:1: a message must be"):
        run(tmp_path, [tmp_path / "chat.jsonl"], tokenizer=llama3)
    with pytest.raises(PrepareError, match="chat data needs the Llama 3 tokenizer"):
        run(tmp_path, [tmp_path / "chat.jsonl"])


def test_the_loader_returns_each_targets_loss_mask(tmp_path):
    for i in range(3):  # token t counts where t % 3 == 0, so each target's mask is known from the target
        tokens = np.arange(i * 1000, i * 1000 + 300 + 50 * i)
        write_shard(tmp_path / f"m_train_{i:06d}.bin", tokens, 5000)
        write_mask(tmp_path / f"m_train_{i:06d}.mask.bin", tokens % 3 == 0)
    pattern = str(tmp_path / "m_train_*.bin")  # matches the .mask.bin sidecars too
    loader, plain = DataLoader(pattern, B=2, T=16, seed=3), DataLoader(pattern, B=2, T=16, seed=3)
    assert [Path(f).name for f in loader.files] == [f"m_train_{i:06d}.bin" for i in range(3)]
    for _ in range(loader.batches_per_epoch + 2):
        inputs, targets, mask = loader.next_batch(with_mask=True)
        assert [a.tolist() for a in plain.next_batch()] == [inputs.tolist(), targets.tolist()]
        assert mask.dtype == np.uint8 and mask.tolist() == (targets % 3 == 0).tolist()


def test_prepared_chat_shards_train_with_their_masks(tmp_path, llama3):
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 6)
    summary = run(tmp_path, [tmp_path / "chat.jsonl"], tokenizer=llama3, shard_tokens=200)
    loader = DataLoader(str(tmp_path / "out" / "d_train_*.bin"), B=1, T=32, shuffle=False)
    assert len(loader.files) == len(summary.writers["train"].paths) > 1
    inputs, targets, mask = loader.next_batch(with_mask=True)
    ids, counted = chat_tokens_and_mask(llama3, CONVERSATION)
    assert targets[0].tolist() == ids[1:33].tolist() and mask[0].tolist() == counted[1:33].tolist()


def test_the_loader_says_when_a_shard_has_no_mask(tmp_path):
    write_jsonl(tmp_path / "x.jsonl", [{"text": "plain text " * 20}])
    summary = run(tmp_path, [tmp_path / "x.jsonl"])
    loader = DataLoader(str(summary.writers["train"].paths[0]), B=1, T=8)
    with pytest.raises(ShardError, match="has no loss mask"):
        loader.next_batch(with_mask=True)
