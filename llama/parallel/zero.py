"""ZeRO-1: data parallelism with the optimizer state sharded over the ranks.

Every rank holds the full weights the forward reads and the full fp32 gradient buffer; the fp32
master weights and the AdamW moments exist once over all ranks. A step:
1. the gradients are reduce-scattered (averaged over ranks) bucket by bucket, each bucket as soon as
   the backward has finished it, on the communication stream while the backward goes on;
2. the global grad norm is the all-reduced sum of the shards' sums of squares;
3. each rank runs AdamW on its shard and writes the new weights of its shard (bf16, or fp32 on the
   exact path);
4. the shards are all-gathered into the full weight buffer.

ShardLayout is the arithmetic (pure numpy, also used to cut and reassemble checkpoints): the flat
parameter buffer, padded to a multiple of world_size * ALIGN, is cut into buckets at layer
boundaries (rounded up to that multiple), and rank r owns the r-th of the world_size equal pieces of
every bucket. Its shard is the concatenation of its pieces, so one kernel launch updates it. With
one rank there is one bucket, no padding, and the shard buffers are the full ones.
"""

from __future__ import annotations

import numpy as np

from ..cuda import BF16, DeviceArray, empty, runtime, to_device, zeros
from ..optim import OPTIMIZERS, QUANT_BLOCK, ZERO_CODES, AdamW8bitState

ALIGN = 16  # elements: pieces start 64-byte aligned in fp32, 32-byte in bf16


def round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


class ShardLayout:
    def __init__(self, size: int, world_size: int, boundaries=()):
        """size values split over world_size ranks; boundaries: offsets where a bucket may start
        (each layer's first parameter), ascending or not."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.size, self.world_size = size, world_size
        unit = 1 if world_size == 1 else world_size * ALIGN
        self.padded_size = round_up(size, unit)
        starts = [0] if world_size == 1 else sorted({0} | {round_up(b, unit) for b in boundaries
                                                          if 0 < round_up(b, unit) < self.padded_size})
        self.buckets = list(zip(starts, starts[1:] + [self.padded_size]))  # [start, end) in the flat buffer
        self.pieces = [(end - start) // world_size for start, end in self.buckets]
        self.shard_offsets = [int(x) for x in np.cumsum([0] + self.pieces[:-1])]  # each bucket's piece in a shard
        self.shard_size = self.padded_size // world_size

    def piece(self, bucket: int, rank: int) -> tuple[int, int]:
        """[start, end) of rank's piece of a bucket, in the flat buffer."""
        start, n = self.buckets[bucket][0] + rank * self.pieces[bucket], self.pieces[bucket]
        return start, start + n

    def owned(self, rank: int):
        """(flat start, flat end, shard offset) of each of rank's pieces."""
        return [(*self.piece(k, rank), self.shard_offsets[k]) for k in range(len(self.buckets))]

    def shard(self, flat: np.ndarray, rank: int) -> np.ndarray:
        """rank's shard of a flat host array of `size` values (the padding reads as zeros)."""
        padded = np.zeros(self.padded_size, flat.dtype)
        padded[:self.size] = flat
        return np.concatenate([padded[start:end] for start, end, _ in self.owned(rank)])

    def unshard(self, shards: list[np.ndarray]) -> np.ndarray:
        """The flat array of `size` values whose shards these are, one per rank in rank order."""
        if len(shards) != self.world_size or any(s.shape != (self.shard_size,) for s in shards):
            raise ValueError(f"unshard needs {self.world_size} shards of {self.shard_size} values")
        flat = np.empty(self.padded_size, shards[0].dtype)
        for rank, shard in enumerate(shards):
            for start, end, offset in self.owned(rank):
                flat[start:end] = shard[offset:offset + end - start]
        return flat[:self.size]


def intersect(ranges, start: int, end: int):
    """The parts of [start, end) inside each (lo, hi, shard offset) range: (flat start, flat end, shard offset)."""
    for lo, hi, offset in ranges:
        a, b = max(lo, start), min(hi, end)
        if a < b:
            yield int(a), int(b), int(offset + a - lo)


class Zero1:
    """The sharded optimizer state of one rank and the collectives around the update.

    master, m, v, decay_mask: this rank's shard (fp32, uint8). grads: the full fp32 gradient buffer
    (padded); grad_shard: the averaged gradients of this rank's shard after reduce-scatter. weights:
    the full buffer the forward reads (bf16 copy, or the fp32 params on the exact path);
    weight_shard: where AdamW writes this rank's part of it before the all-gather. With comm None
    (one GPU) the shard buffers are the full ones and nothing is communicated.
    optimizer "adamw8bit" (one GPU): the moments in 8 bits as llama/optim.py's AdamW8bitState holds them,
    m_codes, v_codes (uint8) and m_scales, v_scales (fp32, one per QUANT_BLOCK values), instead of m, v.
    gradients False (one GPU, the optimizer in the backward): no full gradient buffer; the model keeps
    its gradients a group at a time.
    """

    def __init__(self, layout: ShardLayout, comm, params: np.ndarray, decay_mask: np.ndarray, weight_dtype,
                 optimizer: str = "adamw", gradients: bool = True):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if optimizer == "adamw8bit" and comm is not None:
            raise ValueError("8-bit moments run on one GPU: ZeRO-1's shards would cut their blocks")
        if not gradients and comm is not None:
            raise ValueError("the gradients live outside ZeRO-1 (the optimizer in the backward) on one GPU only")
        self.layout, self.comm, self.optimizer = layout, comm, optimizer
        self.rank = comm.rank if comm is not None else 0
        n = layout.padded_size
        self.grads = zeros(n) if gradients else None
        self.weights = empty(n, weight_dtype)
        if comm is None:
            self.master = empty(n) if weight_dtype == BF16 else self.weights
            self.grad_shard = self.grads
            self.weight_shard = self.weights
        else:
            self.master = empty(layout.shard_size)
            self.grad_shard = empty(layout.shard_size)
            self.weight_shard = empty(layout.shard_size, weight_dtype) if weight_dtype == BF16 else self.master
            drv = runtime().drv
            self._ready = [drv.Event(drv.event_flags.DISABLE_TIMING) for _ in layout.buckets]
        if optimizer == "adamw8bit":
            blocks = -(-layout.shard_size // QUANT_BLOCK)
            self.m_codes, self.v_codes = empty(layout.shard_size, np.uint8), empty(layout.shard_size, np.uint8)
            self.m_scales, self.v_scales = empty(blocks), empty(blocks)
            from ..ops import quantization_maps
            self.maps = to_device(quantization_maps())
        else:
            self.m, self.v = empty(layout.shard_size), empty(layout.shard_size)
        self.set_moments(None, None)
        self.decay_mask = to_device(layout.shard(decay_mask, self.rank))
        self.launched = set()
        self.set_weights(params)

    @classmethod
    def for_model(cls, layout, comm, params: np.ndarray, weight_dtype, optimizer: str = "adamw",
                  gradients: bool = True) -> "Zero1":
        """The state of a model's flat parameters (llama/params.py layout), bucketed at its layers."""
        shards = ShardLayout(layout.size, comm.world_size if comm is not None else 1, layout.layer_starts())
        return cls(shards, comm, params, layout.decay_mask(), weight_dtype, optimizer, gradients)

    def set_weights(self, params: np.ndarray) -> None:
        """Upload the full fp32 params: the master shard and the full weight buffer (on one GPU without
        a host copy of the whole, which an 8B model could not afford twice)."""
        params = np.asarray(params, np.float32)
        if self.layout.padded_size == self.layout.size:
            padded = params
        else:
            padded = np.zeros(self.layout.padded_size, np.float32)
            padded[:self.layout.size] = params
        self.weights.upload(padded)
        shard = padded if self.comm is None else self.layout.shard(params, self.rank)
        if self.master is not self.weights:
            self.master.upload(shard)
        if self.weight_shard is not self.weights and self.weight_shard is not self.master:
            self.weight_shard.upload(shard.astype(self.weight_shard.dtype))

    def set_moments(self, m: np.ndarray | None, v: np.ndarray | None) -> None:
        """The full fp32 moments from a checkpoint (None: zeros), quantized on the host for 8 bits."""
        if self.optimizer == "adamw8bit":
            if m is None and v is None:  # every code that of zero, every scale 0
                for codes, zero_code in ((self.m_codes, ZERO_CODES[0]), (self.v_codes, ZERO_CODES[1])):
                    runtime().drv.memset_d8_async(codes.ptr, zero_code, codes.nbytes, runtime().stream)
                self.m_scales.fill_zero()
                self.v_scales.fill_zero()
                return
            state = AdamW8bitState(self.layout.size)
            state.load(m, v)
            for buffer, host in ((self.m_codes, state.m_codes), (self.v_codes, state.v_codes),
                                 (self.m_scales, state.m_scales), (self.v_scales, state.v_scales)):
                buffer.upload(host)
            return
        for buffer, host in ((self.m, m), (self.v, v)):
            if host is None:
                buffer.fill_zero()
            else:
                buffer.upload(self.layout.shard(host.astype(np.float32), self.rank))

    # ---- 1. reduce-scatter, bucket by bucket

    def reduce_from(self, offset: int) -> None:
        """Gradients at flat offsets >= offset are final: reduce-scatter every bucket inside them not
        yet on its way, on the communication stream."""
        if self.comm is None:
            return
        for k in reversed(range(len(self.layout.buckets))):
            start, end = self.layout.buckets[k]
            if start < offset:
                break
            if k in self.launched:
                continue
            self.launched.add(k)
            self._ready[k].record(runtime().stream)
            self.comm.stream.wait_for_event(self._ready[k])
            piece, at = self.layout.pieces[k], self.layout.shard_offsets[k]
            self.comm.reduce_scatter(self.grad_shard.view(at, (piece,)), self.grads.view(start, (end - start,)))

    def finish_reduce(self) -> None:
        """Reduce-scatter the buckets still waiting (all of them if no reduce_from came first) and make
        the compute stream wait for the averaged shard."""
        if self.comm is None:
            return
        self.reduce_from(0)
        self.comm.join()
        self.launched.clear()

    # ---- 2. the global grad norm

    def sum_over_ranks(self, x: DeviceArray) -> None:
        """x (a few fp32 values computed on this rank's shard) = their sum over ranks, in place."""
        if self.comm is None:
            return
        self.comm.fork()
        self.comm.all_reduce(x)
        self.comm.join()

    # ---- 4. all-gather

    def gather_weights(self, extra=()) -> None:
        """Every rank's new weight_shard into the full weight buffer, bucket by bucket, in one NCCL
        group; extra: (array, True) pairs all-reduced (summed) in the same group."""
        if self.comm is None:
            return
        self.comm.fork()
        with self.comm.group():
            for k, (start, end) in enumerate(self.layout.buckets):
                piece, at = self.layout.pieces[k], self.layout.shard_offsets[k]
                self.comm.all_gather(self.weights.view(start, (end - start,)), self.weight_shard.view(at, (piece,)))
            for array in extra:
                self.comm.all_reduce(array)
        self.comm.join()

    # ---- checkpoints: the full state on rank 0

    def gather_device(self, shard: DeviceArray) -> DeviceArray:
        """The full flat array (padded) of a shard buffer, on every rank (a new buffer on several GPUs)."""
        if self.comm is None:
            return shard
        full = empty(self.layout.padded_size, shard.dtype)
        self.comm.fork()
        with self.comm.group():
            for k, (start, end) in enumerate(self.layout.buckets):
                piece, at = self.layout.pieces[k], self.layout.shard_offsets[k]
                self.comm.all_gather(full.view(start, (end - start,)), shard.view(at, (piece,)))
        self.comm.join()
        return full

    def gather(self, shard: DeviceArray) -> np.ndarray | None:
        """The full flat array (`size` values) of a shard buffer on rank 0, None on the other ranks
        (which take part in the all-gather)."""
        full = self.gather_device(shard)
        if self.rank != 0:
            runtime().stream.synchronize()  # the all-gather has run before `full` is freed
            return None
        return full.download()[:self.layout.size]

    def moments(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The full fp32 moments (m, v) on rank 0 (dequantized for 8 bits), None on the other ranks."""
        if self.optimizer == "adamw8bit":
            state = AdamW8bitState(self.layout.size)
            for host, buffer in ((state.m_codes, self.m_codes), (state.v_codes, self.v_codes),
                                 (state.m_scales, self.m_scales), (state.v_scales, self.v_scales)):
                host[:] = buffer.download()
            return state.moments()
        return self.gather(self.m), self.gather(self.v)

    def memory(self) -> dict:
        """Bytes per buffer on this GPU, for the benchmark."""
        moments = ({"m": self.m, "v": self.v} if self.optimizer == "adamw" else
                   {"m_codes": self.m_codes, "v_codes": self.v_codes, "m_scales": self.m_scales, "v_scales": self.v_scales})
        buffers = {"weights": self.weights, "master": self.master} | moments
        if self.grads is not None:
            buffers["grads"] = self.grads
        if self.comm is not None:
            buffers |= {"grad_shard": self.grad_shard, "weight_shard": self.weight_shard}
        seen, out = set(), {}
        for name, b in buffers.items():
            if id(b) not in seen:
                seen.add(id(b))
                out[name] = b.nbytes
        return out


def replica_copies(shards: ShardLayout, rank: int, tensors: list) -> tuple[dict, list]:
    """Where each tensor sits in a packed replica ({name: offset}), and the copies (replica offset,
    shard offset, count) that bring rank's owned parts of them from its shard into the replica."""
    offsets, copies, at = {}, [], 0
    owned = shards.owned(rank)
    for t in tensors:
        offsets[t.name] = at
        copies += [(at + a - t.offset, shard_at, b - a) for a, b, shard_at in intersect(owned, t.offset, t.offset + t.size)]
        at += t.size
    return offsets, copies


class MasterReplica:
    """Full fp32 copies of a few small tensors whose master weights are sharded (the RMSNorm weights,
    which the bf16 model reads in fp32): after each update, every rank copies the parts it owns into
    a zeroed buffer and an all-reduce (sum) completes it, exactly (x + 0 = x)."""

    def __init__(self, zero: Zero1, layout, names: list[str], params: np.ndarray):
        self.zero, self.layout, self.names = zero, layout, names
        self.offsets, self.copies = replica_copies(zero.layout, zero.rank, [layout.tensors[n] for n in names])
        self.values = empty(sum(layout.tensors[n].size for n in names))
        self.set(params)

    def view(self, name: str) -> DeviceArray:
        return self.values.view(self.offsets[name], self.layout.tensors[name].shape)

    def set(self, params: np.ndarray) -> None:
        self.values.upload(np.concatenate([params[self.layout.tensors[n].offset:][:self.layout.tensors[n].size]
                                           for n in self.names]))

    def collect(self) -> None:
        """This rank's parts of the new master values into the zeroed buffer (on the compute stream);
        the all-reduce that completes it runs in Zero1.gather_weights."""
        rt = runtime()
        self.values.fill_zero()
        for to, at, n in self.copies:
            rt.drv.memcpy_dtod_async(self.values.ptr + 4 * to, self.zero.master.ptr + 4 * at, 4 * n, rt.stream)
