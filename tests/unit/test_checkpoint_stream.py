"""A checkpoint read without its data, then streamed in parts through a few reused buffers (the resume of one
GPU, llama/io/checkpoint.py stream_checkpoint), hands over exactly the bytes that the host read gives, the
weights checked to be finite; an older checkpoint is found past a newer one."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.io.checkpoint import (MODEL, OPTIMIZER, CheckpointError, checkpoint_pieces, load_checkpoint,
                                 moment_tensors, newest_usable, read_data, save_checkpoint, stream_checkpoint)
from llama.optim import AdamW8bitState
from llama.params import ParameterLayout

CONFIG = get_preset("tiny").replace(vocab_size=264)
STATE = {"run": {"batch_size": 1, "seq_len": 1, "tokens_per_step": 1, "seed": 0},
         "sample_rng": np.random.PCG64(0).state,
         "loader": {"epoch": 0, "shard_pos": 0, "batch_pos": 0, "seed": 0, "files": [], "B": 1, "T": 1, "rank": 0,
                    "world_size": 1}}


def random_state(size: int, step: int, quantized: bool) -> tuple:
    """Random weights and moments of size values (8-bit ones quantized from random fp32 ones), seeded by step."""
    rng = np.random.default_rng(step)
    params, m, v = (rng.standard_normal(size, dtype=np.float32) for _ in range(3))
    if quantized:
        state = AdamW8bitState(size)
        state.load(m, np.abs(v))
        m, v = state.quantized()
    return params, m, v


def saved(tmp_path, step: int = 1, quantized: bool = False):
    """A checkpoint of random weights and moments."""
    return save_checkpoint(tmp_path, step, CONFIG, *random_state(ParameterLayout(CONFIG).size, step, quantized), STATE)


def expected_bytes(loaded: dict) -> dict[str, bytes]:
    """The bytes of each state buffer from a checkpoint read on the host."""
    tensors = {"params": loaded["params"]} | moment_tensors(loaded["adam_m"], loaded["adam_v"])
    return {name: array.tobytes() for name, array in tensors.items()}


def streamed(checkpoint: dict, sizes: dict[str, int], buffer_bytes: int, buffers: int = 3,
             moments: bool = True) -> dict[str, bytes]:
    """What stream_checkpoint hands over, by state name (sizes: their bytes), each byte once, each part in one of
    the buffers, and the parts of a name in the order of its bytes where the file holds them so."""
    pool = [np.zeros(buffer_bytes, np.uint8) for _ in range(buffers)]
    out = {name: np.zeros(n, np.uint8) for name, n in sizes.items()}
    written = {name: np.zeros(n, np.int64) for name, n in sizes.items()}

    def upload(name: str, offset: int, data: np.ndarray) -> None:
        assert any(np.shares_memory(data, buffer) for buffer in pool) and 0 < data.size <= buffer_bytes
        out[name][offset:offset + data.size] = data
        written[name][offset:offset + data.size] += 1

    stream_checkpoint(checkpoint, pool, upload, moments)
    assert all((counts == 1).all() for name, counts in written.items() if moments or name == "params")
    return {name: array.tobytes() for name, array in out.items()}


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("buffer_bytes", [1 << 20, 4000, 12])
def test_the_streamed_parts_are_the_bytes_the_host_read_gives(tmp_path, quantized, buffer_bytes):
    folder = saved(tmp_path, quantized=quantized)
    lazy = load_checkpoint(folder, read=False)
    assert lazy["quantized"] == quantized and lazy["params"] is lazy["adam_m"] is lazy["adam_v"] is None
    expected = expected_bytes(load_checkpoint(folder))
    sizes = {name: len(data) for name, data in expected.items()}
    assert streamed(lazy, sizes, buffer_bytes) == expected
    weights_only = streamed(lazy, sizes, buffer_bytes, moments=False)
    assert weights_only["params"] == expected["params"]


def test_the_pieces_are_the_tensors_where_the_files_hold_them(tmp_path):
    """Each tensor's file range, read with np.fromfile, is its values; the weights land at their layout offsets."""
    folder = saved(tmp_path)
    loaded, layout = load_checkpoint(folder), ParameterLayout(CONFIG)
    pieces = checkpoint_pieces(load_checkpoint(folder, read=False))
    assert len(pieces) == len(layout.tensors) + 2
    for file, at, nbytes, name, to in pieces:
        values = np.fromfile(file, np.float32, nbytes // 4, offset=at)
        target = loaded["params"].view(np.uint8)[to:to + nbytes].view(np.float32) if name == "params" else loaded[name]
        assert file.name == (MODEL if name == "params" else OPTIMIZER) and np.array_equal(values, target)


def test_weights_that_are_not_finite_stop_the_stream(tmp_path):
    folder = saved(tmp_path)
    loaded = load_checkpoint(folder)
    loaded["params"][-1] = np.inf
    save_checkpoint(tmp_path, 2, CONFIG, loaded["params"], loaded["adam_m"], loaded["adam_v"], STATE)
    lazy = load_checkpoint(tmp_path / "ckpt_00000002", read=False)  # passes: its data is not read
    with pytest.raises(CheckpointError, match=r"model.safetensors: the weights are not finite$"):
        stream_checkpoint(lazy, [np.zeros(1 << 12, np.uint8) for _ in range(2)], lambda *part: None)
    with pytest.raises(CheckpointError, match=r"model.safetensors: the weights are not finite$"):
        read_data(lazy)


def test_a_file_cut_short_after_the_check_is_a_checkpoint_error(tmp_path):
    folder = saved(tmp_path)
    lazy = load_checkpoint(folder, read=False)
    with open(folder / OPTIMIZER, "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    with pytest.raises(CheckpointError, match="optimizer.safetensors is .* bytes, but its header promises"):
        stream_checkpoint(lazy, [np.zeros(1 << 12, np.uint8) for _ in range(2)], lambda *part: None)


def test_an_older_checkpoint_is_found_past_a_newer_one(tmp_path):
    first, second = saved(tmp_path, 1), saved(tmp_path, 2)
    found, skipped = newest_usable(tmp_path, read=False, before=second)
    assert found["path"] == first and skipped == [] and found["params"] is None
    assert newest_usable(tmp_path, before=first) == (None, [])
    assert newest_usable(tmp_path)[0]["path"] == second
