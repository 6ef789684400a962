import numpy as np
import pytest

from llama.data.dataloader import DataLoader
from llama.data.datasets import CorpusError, prepare_builtin_corpus, prepare_tinyshakespeare, stdlib_sources
from llama.data.shards import HEADER_INTS, ShardError, open_shard, read_header, write_shard
from llama.data.tokenizer import ByteTokenizer


def test_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 128256, 1000)
    write_shard(tmp_path / "a.bin", tokens, 128256)
    info = read_header(tmp_path / "a.bin")
    assert (info.format, info.num_tokens, info.vocab_size) == ("llama3", 1000, 128256)
    assert np.array_equal(open_shard(tmp_path / "a.bin", 128256), tokens)
    assert not list(tmp_path.glob("*.tmp"))


def gpt2_shard(path, tokens):
    header = np.zeros(HEADER_INTS, np.int32)
    header[:3] = [20240520, 1, len(tokens)]
    path.write_bytes(header.tobytes() + np.asarray(tokens, np.uint16).tobytes())


def test_reads_gpt2_shards(tmp_path):
    gpt2_shard(tmp_path / "g.bin", [50256, 1, 2, 3])
    info = read_header(tmp_path / "g.bin")
    assert (info.format, info.dtype, info.vocab_size) == ("gpt2", np.uint16, 0)
    assert open_shard(tmp_path / "g.bin", 50257).tolist() == [50256, 1, 2, 3]
    with pytest.raises(ShardError, match="token id 50256 is outside"):
        open_shard(tmp_path / "g.bin", 50000)


def test_corrupt_shards(tmp_path):
    path = tmp_path / "s.bin"
    write_shard(path, np.arange(100), 258)
    raw = bytearray(path.read_bytes())
    cases = {
        "bad magic number 12345": lambda r: r.__setitem__(slice(0, 4), np.int32(12345).tobytes()),
        "unsupported llama3 shard version 3": lambda r: r.__setitem__(slice(4, 8), np.int32(3).tobytes()),
        "truncated or corrupt": lambda r: r.__delitem__(slice(-8, None)),
        "too short for a shard header": lambda r: r.__delitem__(slice(100, None)),
    }
    for message, corrupt in cases.items():
        broken = bytearray(raw)
        corrupt(broken)
        path.write_bytes(bytes(broken))
        with pytest.raises(ShardError, match=message):
            open_shard(path)
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="vocab 258, but the model's vocab is 128256"):
        open_shard(path, 128256)
    with pytest.raises(ShardError, match="outside the vocabulary"):
        write_shard(path, [5, 300], 258)
    with pytest.raises(ShardError, match="cannot read"):
        read_header(tmp_path / "missing.bin")


def make_shards(tmp_path, sizes):
    start = 0
    for i, n in enumerate(sizes):
        write_shard(tmp_path / f"d_{i}.bin", np.arange(start, start + n), 10 ** 6)
        start += n
    return str(tmp_path / "d_*.bin")


def epoch_inputs(loader):
    return np.concatenate([loader.next_batch()[0].ravel() for _ in range(loader.batches_per_epoch)])


def test_loader_covers_every_token_once_per_epoch(tmp_path):
    B, T = 2, 4
    pattern = make_shards(tmp_path, [B * T * 3 + 1, B * T * 2 + 1, B * T + 1])  # whole batches, +1 for the last target
    loader = DataLoader(pattern, B, T, seed=1)
    assert loader.batches_per_epoch == 6
    first = epoch_inputs(loader)
    expected = np.concatenate([np.arange(0, 24), np.arange(25, 41), np.arange(42, 50)])
    assert np.array_equal(np.sort(first), expected)
    second = epoch_inputs(loader)
    assert np.array_equal(np.sort(second), expected) and not np.array_equal(first, second)
    x, y = DataLoader(pattern, B, T, shuffle=False).next_batch()
    assert x.dtype == np.int32 and np.array_equal(y, x + 1)


def test_loader_splits_by_rank_without_overlap(tmp_path):
    pattern = make_shards(tmp_path, [3 * 2 * 2 * 5 + 1, 3 * 2 * 2 * 2 + 1])
    parts = [epoch_inputs(DataLoader(pattern, 3, 2, rank=r, world_size=2, seed=4)) for r in range(2)]
    assert not set(parts[0]) & set(parts[1])
    assert len(parts[0]) == len(parts[1]) == 3 * 2 * 7
    with pytest.raises(ValueError, match="rank 2 is outside"):
        DataLoader(pattern, 3, 2, rank=2, world_size=2)


def test_loader_resumes_to_identical_batches(tmp_path):
    pattern = make_shards(tmp_path, [101, 57, 80])
    loader = DataLoader(pattern, 2, 5, seed=7)
    for _ in range(loader.batches_per_epoch - 2):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(6)]  # crosses into the next epoch
    resumed = DataLoader(pattern, 2, 5, seed=7)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (resumed.next_batch() for _ in range(6))):
        assert np.array_equal(x, rx) and np.array_equal(y, ry)
    with pytest.raises(ValueError, match="seed was 7"):
        DataLoader(pattern, 2, 5, seed=8).load_state_dict(state)


def test_loader_errors(tmp_path):
    with pytest.raises(ShardError, match="no shard files match"):
        DataLoader(str(tmp_path / "none_*.bin"), 2, 4)
    pattern = make_shards(tmp_path, [5])
    with pytest.raises(ShardError, match=r"a step reads 2 rows of 5 tokens from one shard, and the largest of its 1 "
                                         r"shard\(s\) holds 5 tokens \(1 such rows; 5 tokens in all\): lower -b or -t"):
        DataLoader(pattern, 2, 4)
    with pytest.raises(ShardError, match="written by a tokenizer with vocab 1000000"):
        DataLoader(make_shards(tmp_path, [100]), 2, 4, vocab_size=50)
    gpt2_shard(tmp_path / "g.bin", np.arange(100))  # no vocab in the header: the tokens are checked
    with pytest.raises(ShardError, match="token id 99 is outside the model's vocabulary"):
        DataLoader(str(tmp_path / "g.bin"), 2, 4, vocab_size=50).next_batch()


def test_prepare_tinyshakespeare(tmp_path):
    text = "\n\n".join(f"Speaker {i}:\nLine {i}." for i in range(5000)) + "\n"
    (tmp_path / "input.txt").write_text(text)
    train, val = prepare_tinyshakespeare(tmp_path / "input.txt", tmp_path, ByteTokenizer())
    v, t = open_shard(val, ByteTokenizer.vocab_size), open_shard(train, ByteTokenizer.vocab_size)
    assert len(v) == 32768 and v[0] == 256
    assert len(v) + len(t) == len(text.encode()) + 5000  # one begin_of_text per section
    assert ByteTokenizer().decode(np.concatenate([v, t])) == text.replace("Speaker", "<|begin_of_text|>Speaker")


def test_prepare_tinyshakespeare_splits_a_short_text(tmp_path):
    """A text under 2 x 32,768 tokens gives half of it to val, the rest to train (never an empty shard)."""
    text = "\n\n".join(f"Speaker {i}:\nLine {i}." for i in range(50)) + "\n"
    (tmp_path / "input.txt").write_text(text)
    train, val = prepare_tinyshakespeare(tmp_path / "input.txt", tmp_path, ByteTokenizer())
    v, t = open_shard(val, ByteTokenizer.vocab_size), open_shard(train, ByteTokenizer.vocab_size)
    assert len(v) == (len(text.encode()) + 50) // 2 and len(v) + len(t) == len(text.encode()) + 50
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CorpusError, match="empty.txt is too short to split"):
        prepare_tinyshakespeare(tmp_path / "empty.txt", tmp_path, ByteTokenizer())


@pytest.mark.slow
def test_builtin_corpus(tmp_path):
    files = stdlib_sources()
    assert len(files) > 100 and not any("site-packages" in str(p) for p in files)
    train, val = prepare_builtin_corpus(tmp_path, ByteTokenizer())
    assert read_header(train).num_tokens > 1_000_000 and read_header(val).vocab_size == 264
    mtime = train.stat().st_mtime_ns
    assert prepare_builtin_corpus(tmp_path, ByteTokenizer()) == (train, val)
    assert train.stat().st_mtime_ns == mtime  # reused, not rebuilt
