"""Each rank's shard of the initial weights drawn on its GPU (Zero.fill_master: ShardLayout.owned_flat, fill_shard,
ops.fill_parameters), on the CPU: where a shard's pieces take their flat values, against ShardLayout.shard, and
the launches that fill a shard, run on an emulated device by the kernel's numpy twin, against the shard of
init_parameters, padding included."""

import numpy as np
import pytest

from llama import ops
from llama.config import get_preset
from llama.runtime.cuda import DeviceArray
from llama.params import ParameterLayout, init_parameters
from llama.parallel.zero import ShardLayout, fill_shard, model_shards
from llama.twins.init import standard_normals

CONFIG = get_preset("tiny").replace(dim=48, n_heads=3, n_kv_heads=1)  # vocab 97: the embedding's bucket is padded
LAYOUT = ParameterLayout(CONFIG)
BASE = 0x10000  # the emulated device memory's address


@pytest.mark.parametrize("world, boundaries, align", [
    (1, LAYOUT.layer_starts(), 16), (2, LAYOUT.layer_starts(), 16), (5, LAYOUT.layer_starts(), 16),
    (2, LAYOUT.layer_starts(), 256),  # pieces of whole 8-bit blocks
    (4, (5, 1000, 1001), 16),  # a bucket of one value: pieces of padding alone
])
def test_owned_flat_is_where_shard_puts_each_value(world, boundaries, align):
    shards = ShardLayout(LAYOUT.size, world, boundaries, align)
    assert (shards.padded_size > LAYOUT.size) == (world > 1)
    flat = np.arange(1, LAYOUT.size + 1, dtype=np.float64)  # no zeros: the padding is told apart
    drawn = np.zeros(LAYOUT.size, np.int64)
    for rank in range(world):
        built, at = np.full(shards.shard_size, np.nan), 0
        for shard_start, flat_start, flat_end, shard_end in shards.owned_flat(rank):
            values = flat_end - flat_start
            assert shard_start == at and values >= 0 and shard_end - shard_start >= values
            built[shard_start:shard_start + values] = flat[flat_start:flat_end]
            built[shard_start + values:shard_end] = 0.0
            drawn[flat_start:flat_end] += 1
            at = shard_end
        assert at == shards.shard_size
        assert np.array_equal(built, shards.shard(flat, rank))
    assert (drawn == 1).all()  # every value drawn once, by one rank


class EmulatedDevice:
    """fp32 device memory at BASE as a host array (NaN until written), and what fill_shard launches into it run
    on the host: init_normal by its numpy twin (out[i] = fp32(std * z(seed, start + i))), uploads and memsets."""

    def __init__(self, size: int, monkeypatch):
        self.memory = np.full(size, np.nan, np.float32)
        monkeypatch.setattr("llama.ops.init.kernel", lambda module, name, signature: self.init_normal)
        monkeypatch.setattr(DeviceArray, "upload", lambda array, host: self.values(array).__setitem__(..., host))
        monkeypatch.setattr(DeviceArray, "fill_zero", lambda array: self.values(array).fill(0.0))

    def array(self) -> DeviceArray:
        return DeviceArray(BASE, self.memory.shape, np.float32, None)

    def values(self, array: DeviceArray) -> np.ndarray:
        at = (array.ptr - BASE) // 4
        return self.memory[at:at + array.size]

    def init_normal(self, grid, block, ptr, n, start, seed, std):
        philox_blocks = (start + n + 3) // 4 - start // 4  # a thread each
        assert philox_blocks <= grid[0] * block < philox_blocks + block
        at = (ptr - BASE) // 4
        self.memory[at:at + n] = (standard_normals(seed, start, n) * std).astype(np.float32)


@pytest.mark.parametrize("world, optimizer, tied", [
    (1, "adamw", False), (2, "adamw", False), (3, "adamw", True), (2, "adamw8bit", False), (3, "adamw8bit", True),
])
def test_a_shard_filled_on_the_device_is_the_shard_of_init_parameters(monkeypatch, world, optimizer, tied):
    config = CONFIG.replace(tie_embeddings=tied)
    layout = ParameterLayout(config)
    shards = model_shards(layout, world, optimizer)
    expected = init_parameters(config, seed=11)
    for rank in range(world):
        device, counted = EmulatedDevice(shards.shard_size, monkeypatch), []
        fill_shard(device.array(), shards, rank,
                   lambda out, start: ops.fill_parameters(out, layout, 11, start, counted.append))
        assert np.array_equal(device.memory.view(np.uint32), shards.shard(expected, rank).view(np.uint32))
        assert sum(counted) == sum(end - start for _, start, end, _ in shards.owned_flat(rank))
