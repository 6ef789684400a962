"""A prepared dataset is whole or it is not used (issue 63 items 1, 3 to 6, 14): prepare_data writes aside and
moves the dataset into place with its manifest last; the loader checks every shard, sidecar and manifest
before the first batch, and says what a file that is not a shard is."""

import json

import numpy as np
import pytest

from llama.data.dataloader import DataLoader
from llama.data.manifest import check_listed
from llama.data.prepare import PrepareError, PrepareOptions, prepare_dataset
from llama.data.shards import ShardError, mask_path, read_header, write_mask, write_shard
from llama.data.tokenizer import ByteTokenizer, Llama3Tokenizer
from tests.sample_files import ranks_file_bytes

BYTES = ByteTokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepare(tmp_path, inputs, tokenizer=BYTES, **options):
    options = {"name": "d", "out_dir": tmp_path / "out", "val_every": 0, "shard_tokens": 100} | options
    return prepare_dataset([str(i) for i in inputs], tokenizer, PrepareOptions(**options))


def files_under(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def llama3(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(ranks_file_bytes())
    return Llama3Tokenizer(path)


def test_overwrite_with_a_bad_input_leaves_the_old_dataset_whole(tmp_path):
    """Item 1: --overwrite deleted the old dataset first, then failed at the bad line 51."""
    write_jsonl(tmp_path / "good.jsonl", [{"text": f"document {i} " * 5} for i in range(60)])
    prepare(tmp_path, [tmp_path / "good.jsonl"], val_every=10)
    before = files_under(tmp_path / "out")
    assert len(before) > 10 and "d.manifest.json" in {p.name for p in before}
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps({"text": f"new {i} " * 9}) + "\n" for i in range(50))
                                        + '{"text": \n')
    with pytest.raises(PrepareError, match=r"bad\.jsonl:51: invalid JSON"):
        prepare(tmp_path, [tmp_path / "bad.jsonl"], val_every=10, overwrite=True)
    assert files_under(tmp_path / "out") == before  # no partial folder left either


def test_overwrite_replaces_the_dataset_whole(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "a" * 80}] * 20)
    prepare(tmp_path, [tmp_path / "a.jsonl"])
    write_jsonl(tmp_path / "a.jsonl", [{"text": "b" * 80}] * 3)
    summary = prepare(tmp_path, [tmp_path / "a.jsonl"], overwrite=True)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["d.manifest.json"] + [p.name for p in summary.writers["train"].paths]
    assert len(DataLoader(str(tmp_path / "out" / "d_train_*.bin"), 1, 8).files) == 3


def test_prepared_shards_are_listed_and_the_loader_checks_them(tmp_path):
    write_jsonl(tmp_path / "x.jsonl", [{"text": "abcdefgh" * 10}] * 10)
    summary = prepare(tmp_path, [tmp_path / "x.jsonl"], val_every=5)
    manifest = json.loads((tmp_path / "out" / "d.manifest.json").read_text())
    assert [e["file"] for e in manifest["splits"]["train"]] == [p.name for p in summary.writers["train"].paths]
    assert all(read_header(p).listed for p in summary.writers["train"].paths)
    assert len(DataLoader(str(tmp_path / "out" / "d_train_*.bin"), 1, 8).files) == len(summary.writers["train"].paths)


@pytest.mark.parametrize("damage, message", [
    (lambda out: (out / "d.manifest.json").unlink(),
     r"out holds shards of d but not its manifest d\.manifest\.json, which scripts/prepare_data\.py writes last: the "
     r"preparation did not finish.*prepare it again: python3 scripts/prepare_data\.py INPUTS --name d --out-dir "),
    (lambda out: (out / "d_train_000003.bin").unlink(), r"d_train_000003\.bin is missing, which d\.manifest\.json "
                                                         r"lists: the dataset is not whole"),
    (lambda out: write_shard(out / "d_train_000002.bin", np.arange(50), 264, listed=True),
     r"d_train_000002\.bin is not a shard that d\.manifest\.json lists \(it lists 100 tokens, the file holds 50\)"),
    (lambda out: (out / "d.manifest.json").write_text("{}"), r"is not a dataset manifest of this version"),
])
def test_a_dataset_that_is_not_whole_is_refused(tmp_path, damage, message):
    """Item 3: a preparation killed halfway left 3 of 65 shards, and the trainer took them for the dataset."""
    write_jsonl(tmp_path / "x.jsonl", [{"text": "abcdefgh" * 10}] * 4)
    prepare(tmp_path, [tmp_path / "x.jsonl"])  # shards 0 to 3, the last one shorter
    damage(tmp_path / "out")
    with pytest.raises(ShardError, match=message):
        DataLoader(str(tmp_path / "out" / "d_train_00000[0-2].bin"), 1, 8)  # a part of it, which exists


def test_shards_without_a_mark_need_no_manifest(tmp_path):
    """llm.c's shards, the starter pack's and datasets prepared before manifests: used as they are."""
    write_shard(tmp_path / "old_train_000000.bin", np.arange(100) % 7, 7)
    assert not read_header(tmp_path / "old_train_000000.bin").listed
    assert check_listed([read_header(tmp_path / "old_train_000000.bin")]) == {}
    assert DataLoader(str(tmp_path / "old_train_*.bin"), 2, 8).batches_per_epoch == 6


def test_a_sidecar_shorter_than_its_shard_is_found_before_the_first_batch(tmp_path):
    """Item 4: found only when the loader reached it, after 45 steps."""
    for i in range(3):
        write_shard(tmp_path / f"c_{i}.bin", np.arange(3000) % 7, 7)
        write_mask(tmp_path / f"c_{i}.mask.bin", np.ones(3000 - 10 * (i == 2), np.uint8))
    loader = DataLoader(str(tmp_path / "c_*.bin"), 2, 8)
    with pytest.raises(ShardError, match=r"c_2\.mask\.bin: a mask of 2990 tokens in 4014 bytes, but its shard holds "
                                         r"3000 tokens"):
        loader.check_masks()


def test_a_prepared_sidecar_cut_short_is_refused_by_its_manifest(tmp_path, llama3):
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok there"}]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}] * 20)
    summary = prepare(tmp_path, [tmp_path / "chat.jsonl"], tokenizer=llama3)
    sidecar = mask_path(summary.writers["train"].paths[-1])
    sidecar.write_bytes(sidecar.read_bytes()[:-10])
    with pytest.raises(ShardError, match=rf"{sidecar.name}: \d+ bytes, where d\.manifest\.json lists a loss mask of"):
        DataLoader(str(tmp_path / "out" / "d_train_*.bin"), 1, 8)


def test_conversations_without_a_reply_are_counted_and_none_at_all_is_an_error(tmp_path, llama3):
    """Item 5: chat data without an assistant turn trained with loss 0.000000 to the end."""
    asked = {"messages": [{"role": "user", "content": "hello?"}]}
    answered = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    write_jsonl(tmp_path / "chat.jsonl", [asked, answered, asked])
    summary = prepare(tmp_path, [tmp_path / "chat.jsonl"], tokenizer=llama3)
    assert summary.writers["train"].counted == 3  # "ok" is two tokens here, and <|eot_id|>
    assert (f"conversations without an assistant reply, of which nothing counts in the loss: 2 "
            f"({tmp_path / 'chat.jsonl'}:1, {tmp_path / 'chat.jsonl'}:3)") in summary.lines()
    assert "counted in the loss: 3 tokens (the assistant's replies)" in summary.lines()
    assert DataLoader(str(tmp_path / "out" / "d_train_*.bin"), 1, 4).counted_tokens() == 3
    write_jsonl(tmp_path / "chat.jsonl", [asked, asked])
    with pytest.raises(PrepareError, match=r"no training conversation has an assistant reply, so nothing would count "
                                           r"in --sft's loss \(.*chat\.jsonl:1, .*chat\.jsonl:2\)"):
        prepare(tmp_path, [tmp_path / "chat.jsonl"], tokenizer=llama3, name="none")
    assert not list((tmp_path / "out").glob("none*")) and not list((tmp_path / "out").glob(".none*"))


def test_empty_documents_are_skipped_and_named(tmp_path):
    """Item 6: an empty .txt became a shard of 2 tokens, without a word."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("")
    (tmp_path / "in" / "b.txt").write_text("text")
    summary = prepare(tmp_path, [tmp_path / "in"])
    assert summary.writers["train"].total_tokens == 6 and summary.writers["train"].documents == 1
    assert f"skipped: 1 empty documents ({tmp_path / 'in' / 'a.txt'})" in summary.lines()
    with pytest.raises(PrepareError, match=r"no text in the inputs: every document is empty \(.*a\.txt\)"):
        prepare(tmp_path, [tmp_path / "in" / "a.txt"], name="e")


def test_a_failed_preparation_leaves_no_folder_and_a_name_is_not_a_path(tmp_path):
    """Item 6: failures left empty data/NAME folders; --name my/data ended in a missing-folder error."""
    (tmp_path / "x.jsonl").write_text('{"text": \n')
    with pytest.raises(PrepareError):
        prepare(tmp_path, [tmp_path / "x.jsonl"], out_dir=tmp_path / "data" / "x")
    assert not (tmp_path / "data").exists()
    (tmp_path / "y.txt").write_text("fine")
    with pytest.raises(PrepareError, match=r"--name 'my/data' is the shards' file name prefix, not a path: choose a "
                                           r"plain name, and the folder with --out-dir"):
        prepare(tmp_path, [tmp_path / "y.txt"], name="my/data", out_dir=tmp_path / "data" / "my" / "data")
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("name, message", [
    ("notes.txt", r"notes\.txt is a \.txt file, not token shards: tokenize it first with python3 "
                  r"scripts/prepare_data\.py .*notes\.txt and pass the shards it writes"),
    ("d_train_*.mask.bin", r"names loss-mask sidecars only \(d_train_000000\.mask\.bin, \.\.\.\), which go with their "
                           r"shards: pass the shards, e\.g\. -i '.*d_train_000000\.bin', with --sft for chat data"),
    ("d.manifest.json", r"d\.manifest\.json is a dataset's manifest, not a shard: pass the shards it lists, e\.g\. "
                        r"-i '.*/out/d_train_\*\.bin'"),
    ("", r"out/? is a folder: name its shards with a glob, e\.g\. -i '.*out/\*_train_\*\.bin'"),
])
def test_what_is_not_a_shard_is_named_with_what_to_run(tmp_path, llama3, name, message):
    """Item 14: a .txt was 'bad magic number 1952540759', a .mask.bin 'no shard files match'."""
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}] * 4)
    prepare(tmp_path, [tmp_path / "chat.jsonl"], tokenizer=llama3)
    (tmp_path / "out" / "notes.txt").write_text("some text")
    with pytest.raises(ShardError, match=message):
        DataLoader(str(tmp_path / "out" / name), 1, 8)


def test_a_preparation_killed_halfway_is_named_when_nothing_matches(tmp_path):
    (tmp_path / "out" / ".d.partial").mkdir(parents=True)
    write_shard(tmp_path / "out" / ".d.partial" / "d_train_000000.bin", np.arange(50) % 7, 7, listed=True)
    with pytest.raises(ShardError, match=r"no shard files match .*d_train_\*\.bin; .*\.d\.partial holds a preparation "
                                         r"that did not finish \(stopped or killed\): run python3 scripts/prepare_data"):
        DataLoader(str(tmp_path / "out" / "d_train_*.bin"), 1, 8)
