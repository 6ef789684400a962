"""ZeRO's arithmetic on the CPU: shard layout, re-sharding across world sizes, and the sharded
AdamW step against the unsharded one (llama/parallel/zero.py, llama/optim.py)."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.optim import (DYNAMIC_SIGNED, DYNAMIC_UNSIGNED, QUANT_BLOCK, AdamWConfig, adamw_update, clip_scale,
                         dequantize_blocks, global_norm, quantize_blocks)
from llama.params import ParameterLayout
from llama.parallel import zero as zero_module
from llama.parallel.zero import (ALIGN, ShardLayout, Zero, flat_gather_length, home_lengths, home_slot,
                                 model_shards, replica_copies)

LAYOUT = ParameterLayout(get_preset("tiny"))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_buckets_cover_the_padded_buffer_and_pieces_are_aligned(world):
    shards = ShardLayout(LAYOUT.size, world, LAYOUT.layer_starts())
    assert shards.padded_size >= LAYOUT.size and shards.padded_size % world == 0
    assert shards.padded_size - LAYOUT.size < len(shards.buckets) * max(1, world * ALIGN)
    assert shards.buckets[0][0] == 0 and shards.buckets[-1][1] == shards.padded_size
    assert all(a[1] == b[0] for a, b in zip(shards.buckets, shards.buckets[1:]))
    assert sum(shards.pieces) == shards.shard_size == shards.padded_size // world
    if world > 1:  # pieces start aligned; the embeddings, each layer and the head keep a bucket each, exactly
        assert all(p % ALIGN == 0 for p in shards.pieces)
        assert [start for start, _ in shards.spans] == [0, *LAYOUT.layer_starts()]
        assert shards.spans[-1][1] == LAYOUT.size
    else:
        assert shards.buckets == shards.spans == [(0, LAYOUT.size)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_positions_pad_and_unpad(world):
    """Each tensor sits whole in one bucket, at its position in the padded buffer; pad and unpad invert."""
    shards = ShardLayout(LAYOUT.size, world, LAYOUT.layer_starts())
    flat = np.arange(1, LAYOUT.size + 1, dtype=np.float32)
    padded = shards.pad(flat)
    assert padded.shape == (shards.padded_size,) and np.count_nonzero(padded) == LAYOUT.size
    assert np.array_equal(shards.unpad(padded), flat)
    for t in LAYOUT.tensors.values():
        k, at = shards.bucket_of(t.offset), shards.position(t.offset)
        assert shards.bucket_of(t.offset + t.size - 1) == k
        assert shards.buckets[k][0] <= at and at + t.size <= shards.buckets[k][1]
        assert np.array_equal(padded[at:at + t.size], flat[t.offset:t.offset + t.size])


def test_home_slots_alternate_between_neighbours():
    """ZeRO-2/3: the embedding and head buckets have their own homes, the layers two slots in turn."""
    assert [home_slot(k, 6) for k in range(6)] == [None, 0, 1, 0, 1, None]
    assert [home_slot(k, 3) for k in range(3)] == [None, 0, None]
    shards = ShardLayout(LAYOUT.size, 2, LAYOUT.layer_starts())
    lengths = [end - start for start, end in shards.buckets]
    own, slots = home_lengths(shards)
    assert own == {0: lengths[0], len(lengths) - 1: lengths[-1]} and slots == [max(lengths[1:-1])] * 2
    assert home_lengths(ShardLayout(LAYOUT.size, 2, LAYOUT.layer_starts()[-1:]))[1] == []  # no layer bucket


def test_the_ranks_pieces_partition_the_buffer():
    shards = ShardLayout(LAYOUT.size, 3, LAYOUT.layer_starts())
    seen = np.zeros(shards.padded_size, np.int32)
    for rank in range(3):
        for start, end, offset in shards.owned(rank):
            seen[start:end] += 1
            assert 0 <= offset and offset + end - start <= shards.shard_size
    assert (seen == 1).all()


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shard_and_unshard_round_trip(world):
    flat = np.random.default_rng(world).standard_normal(LAYOUT.size).astype(np.float32)
    shards = ShardLayout(LAYOUT.size, world, LAYOUT.layer_starts())
    parts = [shards.shard(flat, r) for r in range(world)]
    assert all(p.shape == (shards.shard_size,) for p in parts)
    assert np.array_equal(shards.unshard(parts), flat)
    assert sum(float(np.abs(p).sum()) for p in parts) == pytest.approx(float(np.abs(flat).sum()), rel=1e-5)


@pytest.mark.parametrize("saved, loaded", [(2, 1), (1, 2), (2, 3), (4, 2)])
def test_resharding_across_world_sizes(saved, loaded):
    """A checkpoint holds the full array: shards of one world size, reassembled, cut for another."""
    moments = np.random.default_rng(0).standard_normal(LAYOUT.size).astype(np.float32)
    before = ShardLayout(LAYOUT.size, saved, LAYOUT.layer_starts())
    full = before.unshard([before.shard(moments, r) for r in range(saved)])
    assert np.array_equal(full, moments)
    after = ShardLayout(LAYOUT.size, loaded, LAYOUT.layer_starts())
    for r in range(loaded):  # rank r holds the r-th of the equal pieces of every bucket, zero past its end
        pieces = []
        for (start, end), piece in zip(after.spans, after.pieces):
            bucket = np.zeros(piece * loaded, np.float32)
            bucket[:end - start] = moments[start:end]
            pieces.append(bucket[r * piece:(r + 1) * piece])
        assert np.array_equal(after.shard(full, r), np.concatenate(pieces))


class HostArray:
    """A host stand-in for a DeviceArray's views: [start, start + size) of a numpy buffer."""

    def __init__(self, data: np.ndarray, start: int = 0, size: int | None = None):
        self.data, self.start, self.dtype = data, start, data.dtype
        self.size = data.size - start if size is None else size

    def view(self, offset, shape):
        assert offset + int(np.prod(shape)) <= self.size, "a view past the buffer's end"
        return HostArray(self.data, self.start + offset, int(np.prod(shape)))

    def prefix(self, *shape):
        return self.view(0, shape)

    @property
    def values(self) -> np.ndarray:
        return self.data[self.start:self.start + self.size]

    def download(self) -> np.ndarray:
        return self.values.copy()

    def upload(self, host) -> None:
        self.values[:] = host


class GatheringCommunicator:
    """All-gathers, in call order, from every rank's buffer (host arrays: one list per buffer, in rank order, found
    by rank 0's) at the offset of rank 0's piece."""

    def __init__(self, *buffers):
        self.buffers = {id(ranks[0]): ranks for ranks in buffers}

    def fork(self):
        pass

    join = fork

    def all_gather(self, out, x):
        out.values[:] = np.concatenate([b[x.start:x.start + x.size] for b in self.buffers[id(x.data)]])


@pytest.mark.parametrize("world", [2, 3, 8])
def test_gather_flat_gathers_each_bucket_in_place_into_one_buffer(monkeypatch, world):
    """Zero.gather_flat: the buckets gathered one after the other at their flat offsets, each overwriting the
    padding the one before wrote, give the flat array in a buffer of flat_gather_length values (< size plus a
    bucket's padding), with no padded copy."""
    flat = np.random.default_rng(world).standard_normal(LAYOUT.size).astype(np.float32)
    shards = ShardLayout(LAYOUT.size, world, LAYOUT.layer_starts())
    allocated = []
    monkeypatch.setattr(zero_module, "empty", lambda n, dtype: allocated.append(n) or HostArray(np.full(n, np.nan, dtype)))
    pieces = [shards.shard(flat, r) for r in range(world)]
    zero = type("Shards", (), {"layout": shards, "comm": GatheringCommunicator(pieces)})
    gathered = Zero.gather_flat(zero, HostArray(pieces[0]))
    assert np.array_equal(gathered.values, flat)
    assert allocated == [flat_gather_length(shards)] and LAYOUT.size <= allocated[0] < LAYOUT.size + world * ALIGN


@pytest.mark.parametrize("world", [2, 3])
def test_8bit_moments_shard_whole_blocks_and_gather_back_to_the_padded_buffers_blocks(monkeypatch, world):
    """On several GPUs 8-bit moments are quantized per shard (Zero._set_8bit_moments): its pieces are whole blocks
    (model_shards), so its blocks are those of the padded buffer, and gathering and dequantizing them (Zero.moments)
    gives the flat array quantized in the padded buffer's blocks, bucket by bucket."""
    shards = model_shards(LAYOUT, world, "adamw8bit")
    assert all(piece % QUANT_BLOCK == 0 for piece in shards.pieces)
    monkeypatch.setattr(zero_module, "empty", lambda n, dtype: HostArray(np.zeros(n, dtype)))
    monkeypatch.setattr(zero_module, "runtime", lambda: type("Runtime", (), {"stream": type("S", (), {
        "synchronize": staticmethod(lambda: None)})}))
    rng = np.random.default_rng(world)
    m, v = rng.standard_normal(LAYOUT.size).astype(np.float32), rng.random(LAYOUT.size).astype(np.float32)
    ranks = []
    for rank in range(world):
        z = object.__new__(Zero)  # the 8-bit state alone: a shard's codes and block scales on the host
        z.layout, z.rank, z.optimizer, z.comm = shards, rank, "adamw8bit", "several ranks"
        z.m_codes, z.v_codes = (HostArray(np.zeros(shards.shard_size, np.uint8)) for _ in range(2))
        z.m_scales, z.v_scales = (HostArray(np.zeros(shards.shard_size // QUANT_BLOCK, np.float32)) for _ in range(2))
        z._set_8bit_moments(m, v)
        ranks.append(z)
    ranks[0].comm = GatheringCommunicator(*([getattr(z, name).data for z in ranks]
                                            for name in ("m_codes", "m_scales", "v_codes", "v_scales")))
    for got, flat, levels in zip(ranks[0].moments(), (m, v), (DYNAMIC_SIGNED, DYNAMIC_UNSIGNED)):
        expected = shards.unpad(dequantize_blocks(*quantize_blocks(shards.pad(flat), levels), levels))
        assert np.array_equal(got, expected)
        assert np.allclose(got, flat, rtol=0.1, atol=0.02 * np.abs(flat).max())


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        ShardLayout(100, 0)
    with pytest.raises(ValueError, match="shards"):
        ShardLayout(100, 2).unshard([np.zeros(3)])


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_adamw_step_equals_the_full_step(world):
    """The ZeRO-1 step in numpy: per-rank gradients averaged and cut (reduce-scatter), the norm from
    the shards' sums of squares, AdamW on each shard, shards gathered: the full step's result."""
    rng = np.random.default_rng(1)
    n, opt = LAYOUT.size, AdamWConfig(grad_clip=0.5)
    params = rng.standard_normal(n)
    m, v = 0.1 * rng.standard_normal(n), np.abs(rng.standard_normal(n))
    rank_grads = [rng.standard_normal(n) for _ in range(world)]
    mask = LAYOUT.decay_mask().astype(np.float64)

    grads = np.mean(rank_grads, axis=0)
    full = [params.copy(), m.copy(), v.copy()]
    adamw_update(*full[:1], grads, *full[1:], mask, step=3, lr=1e-2, opt=opt,
                 grad_scale=clip_scale(global_norm(grads), opt.grad_clip))

    shards = ShardLayout(n, world, LAYOUT.layer_starts())
    grad_shards = [shards.shard(grads, r) for r in range(world)]  # the reduce-scatter's result
    norm = np.sqrt(sum(float(np.dot(g, g)) for g in grad_shards))  # the all-reduce of the partial sums
    assert norm == pytest.approx(global_norm(grads), rel=1e-12)
    states = []
    for r in range(world):
        p, mm, vv = (shards.shard(x, r) for x in (params, m, v))
        adamw_update(p, grad_shards[r], mm, vv, shards.shard(mask, r), step=3, lr=1e-2, opt=opt,
                     grad_scale=clip_scale(norm, opt.grad_clip))
        states.append((p, mm, vv))
    for i, expected in enumerate(full):
        assert np.allclose(shards.unshard([s[i] for s in states]), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_master_replica_copies_rebuild_the_norm_weights(world):
    """Every rank copies the parts of the norm weights it owns into a zeroed replica; the sum over
    ranks (the all-reduce) is every norm weight, exactly."""
    params = np.random.default_rng(2).standard_normal(LAYOUT.size).astype(np.float32)
    shards = ShardLayout(LAYOUT.size, world, LAYOUT.layer_starts())
    tensors = [LAYOUT.tensors[name] for name in LAYOUT.norm_names()]
    total = np.zeros(sum(t.size for t in tensors), np.float32)
    for r in range(world):
        offsets, copies = replica_copies(shards, r, tensors)
        replica, shard = np.zeros_like(total), shards.shard(params, r)
        for to, at, count in copies:
            replica[to:to + count] = shard[at:at + count]
        total += replica
    for t in tensors:
        assert np.array_equal(total[offsets[t.name]:offsets[t.name] + t.size], params[t.offset:t.offset + t.size])
