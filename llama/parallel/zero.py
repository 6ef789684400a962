"""ZeRO: data parallelism with the optimizer state (stage 1), the gradients (2) and the weights (3) sharded
over the ranks.

The fp32 master weights and the AdamW moments exist once over all ranks. A step:
1. the gradients are reduce-scattered (averaged over ranks) bucket by bucket, each bucket as soon as
   the backward has finished it, on the communication stream while the backward goes on: stage 1 from
   the full gradient buffer on the last micro-batch; stages 2 and 3 from the bucket's home (a buffer of
   its own for the embedding and the head's buckets, one of two slots for a layer's) on every micro-batch,
   after which the slot serves the layer after next;
2. the global grad norm is the all-reduced sum of the shards' sums of squares;
3. each rank runs AdamW on its shard and writes the new weights of its shard (bf16, or fp32 on the
   exact path);
4. the shards are all-gathered: stages 1 and 2 into the full weights at the start of the next forward, bucket
   by bucket, each layer waiting only for its own bucket (the bf16 model; the fp32 model gathers them all
   after its update, gather_weights); stage 3 into the homes: the embedding's and head's once a step, at the
   start of its first forward (they stay in their own homes until the weights change), each layer's just before
   its forward (the next layer's gather running meanwhile) and again before its backward, but for the two layers
   the forward leaves in the slots.
The bf16 model's captured graphs keep every collective inside the forward and backward that waits for it
(begin ... end), so that CUDA graph capture sees each fork joined.

ShardLayout is the arithmetic (pure numpy, also used to cut and reassemble checkpoints): the flat
parameters are cut into buckets at layer boundaries, each padded on its own to a multiple of
world_size * ALIGN (8-bit moments: QUANT_BLOCK, so that a piece is whole blocks) in a padded buffer, and rank r owns the r-th of the world_size equal pieces of
every bucket. Its shard is the concatenation of its pieces, so one kernel launch updates it. With
one rank there is one bucket, no padding, and the shard buffers are the full ones. Checkpoints hold the
flat arrays, so they resume on any number of GPUs at any stage.
"""

from __future__ import annotations

import bisect
import math
from contextlib import contextmanager

import numpy as np

from .. import ops
from ..runtime.cuda import BF16, DeviceArray, empty, runtime, to_device, zeros
from ..optim import (DYNAMIC_SIGNED, DYNAMIC_UNSIGNED, QUANT_BLOCK, ZERO_CODES, AdamW8bitState, Quantized,
                     dequantize_blocks, fp32_moments, quantize_blocks)
from ..options import OPTIMIZERS, ZERO_STAGES

ALIGN = 16  # elements: pieces start 64-byte aligned in fp32, 32-byte in bf16


def round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


class ShardLayout:
    def __init__(self, size: int, world_size: int, boundaries=(), align: int = ALIGN):
        """size values split over world_size ranks; boundaries: offsets where a bucket starts (each layer's
        first parameter), ascending or not. With several ranks each bucket is padded to a multiple of
        world_size * align on its own, so that a bucket is whole tensors and can live apart from the others,
        and every piece is a multiple of align values."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.size, self.world_size = size, world_size
        unit = 1 if world_size == 1 else world_size * align
        starts = [0] if world_size == 1 else sorted({0} | {b for b in boundaries if 0 < b < size})
        self.spans = list(zip(starts, starts[1:] + [size]))  # each bucket's [start, end) in the flat parameters
        lengths = [round_up(end - start, unit) for start, end in self.spans]
        ends = [int(x) for x in np.cumsum(lengths)]
        self.buckets = list(zip([0] + ends[:-1], ends))  # [start, end) in the padded buffer
        self.padded_size = ends[-1]
        self.pieces = [n // world_size for n in lengths]
        self.shard_offsets = [int(x) for x in np.cumsum([0] + self.pieces[:-1])]  # each bucket's piece in a shard
        self.shard_size = self.padded_size // world_size

    def bucket_of(self, offset: int) -> int:
        """The bucket that holds the flat parameter at offset."""
        return bisect.bisect_right(self.spans, (offset, math.inf)) - 1

    def position(self, offset: int) -> int:
        """Where the flat parameter at offset sits in the padded buffer."""
        k = self.bucket_of(offset)
        return self.buckets[k][0] + offset - self.spans[k][0]

    def pad(self, flat: np.ndarray) -> np.ndarray:
        """The padded buffer of a flat host array of `size` values (zeros between the buckets)."""
        if self.padded_size == self.size:
            return flat
        padded = np.zeros(self.padded_size, flat.dtype)
        for (start, end), (at, _) in zip(self.spans, self.buckets):
            padded[at:at + end - start] = flat[start:end]
        return padded

    def unpad(self, padded: np.ndarray) -> np.ndarray:
        """The flat array of `size` values in a padded buffer."""
        if self.padded_size == self.size:
            return padded
        return np.concatenate([padded[at:at + end - start] for (start, end), (at, _) in zip(self.spans, self.buckets)])

    def piece(self, bucket: int, rank: int) -> tuple[int, int]:
        """[start, end) of rank's piece of a bucket, in the padded buffer."""
        start, n = self.buckets[bucket][0] + rank * self.pieces[bucket], self.pieces[bucket]
        return start, start + n

    def owned(self, rank: int):
        """(padded start, padded end, shard offset) of each of rank's pieces."""
        return [(*self.piece(k, rank), self.shard_offsets[k]) for k in range(len(self.buckets))]

    def owned_flat(self, rank: int):
        """(shard start, flat start, flat end, shard end) of each of rank's pieces: the piece
        [shard start, shard end) of rank's shard holds the flat parameters [flat start, flat end) first (none
        where the piece is all padding), then zeros, as shard() makes it."""
        ranges = []
        for (start, end, offset), (flat_start, flat_end), (bucket_start, _) in zip(self.owned(rank), self.spans,
                                                                                    self.buckets):
            lo, hi = (min(flat_start + at - bucket_start, flat_end) for at in (start, end))
            ranges.append((offset, lo, hi, offset + end - start))
        return ranges

    def shard(self, flat: np.ndarray, rank: int) -> np.ndarray:
        """rank's shard of a flat host array of `size` values (the padding reads as zeros)."""
        padded = self.pad(flat)
        return np.concatenate([padded[start:end] for start, end, _ in self.owned(rank)])

    def unshard(self, shards: list[np.ndarray]) -> np.ndarray:
        """The flat array of `size` values whose shards these are, one per rank in rank order."""
        if len(shards) != self.world_size or any(s.shape != (self.shard_size,) for s in shards):
            raise ValueError(f"unshard needs {self.world_size} shards of {self.shard_size} values")
        padded = np.empty(self.padded_size, shards[0].dtype)
        for rank, shard in enumerate(shards):
            for start, end, offset in self.owned(rank):
                padded[start:end] = shard[offset:offset + end - start]
        return self.unpad(padded)


def model_shards(layout, world_size: int, optimizer: str = "adamw") -> ShardLayout:
    """The shard layout of a model's flat parameters (llama/params.py layout), bucketed at its layers; pieces of
    whole QUANT_BLOCKs for 8-bit moments, whose blocks then never straddle two pieces."""
    align = QUANT_BLOCK if optimizer == "adamw8bit" else ALIGN
    return ShardLayout(layout.size, world_size, layout.layer_starts(), align)


def home_slot(bucket: int, buckets: int) -> int | None:
    """Where a bucket lives under ZeRO-2 (its gradients) and ZeRO-3 (its weights): None for the first and the
    last (the embedding table; the final norm and the head, which the forward's classifier uses), which keep
    a buffer of their own for the step, else one of two slots that the layers' buckets use in turn (layer i,
    bucket i + 1, in slot i % 2: a layer's neighbours never share its slot, so the next one's collective can
    run while it computes)."""
    return None if bucket in (0, buckets - 1) else (bucket - 1) % 2


def home_lengths(layout: ShardLayout) -> tuple[dict[int, int], list[int]]:
    """The values of the bucket homes (home_slot) of a layout of several ranks: {bucket: length} of the first and
    last bucket's own buffers, and the slots' lengths (two, or one with a single layer; the longest layer bucket)."""
    n = len(layout.buckets)
    lengths = [end - start for start, end in layout.buckets]
    return {k: lengths[k] for k in sorted({0, n - 1})}, [max(lengths[1:-1])] * min(2, n - 2) if n > 2 else []


class BucketHomes:
    """The buffers of one sharded quantity's buckets while a step uses them (home_slot, home_lengths)."""

    def __init__(self, layout: ShardLayout, dtype):
        self.layout = layout
        own, slots = home_lengths(layout)
        self.own = {k: empty(n, dtype) for k, n in own.items()}
        self.slots = [empty(n, dtype) for n in slots]

    def home(self, bucket: int) -> DeviceArray:
        """The bucket's whole (padded) buffer."""
        slot = home_slot(bucket, len(self.layout.buckets))
        length = self.layout.buckets[bucket][1] - self.layout.buckets[bucket][0]
        return self.own[bucket] if slot is None else self.slots[slot].prefix(length)

    def view(self, offset: int, shape) -> DeviceArray:
        """The tensor at flat offset, shaped, in its bucket's home."""
        k = self.layout.bucket_of(offset)
        return self.home(k).view(offset - self.layout.spans[k][0], shape)


def fill_shard(shard: DeviceArray, layout: ShardLayout, rank: int, fill_range) -> None:
    """rank's shard (shard_size values) of the flat parameters that fill_range(out, start) writes, the values
    from flat offset start on into out (ops.fill_parameters), its padding zeros: what layout.shard makes."""
    for shard_start, flat_start, flat_end, shard_end in layout.owned_flat(rank):
        values = flat_end - flat_start
        if values:
            fill_range(shard.view(shard_start, (values,)), flat_start)
        if shard_end > shard_start + values:
            shard.view(shard_start + values, (shard_end - shard_start - values,)).fill_zero()


def flat_gather_length(layout: ShardLayout) -> int:
    """The values of Zero.gather_flat's buffer: the flat array and the padding its last gathers write past it."""
    return max(flat_start + end - start for (start, end), (flat_start, _) in zip(layout.buckets, layout.spans))


def intersect(ranges, start: int, end: int):
    """The parts of [start, end) inside each (lo, hi, shard offset) range: (flat start, flat end, shard offset)."""
    for lo, hi, offset in ranges:
        a, b = max(lo, start), min(hi, end)
        if a < b:
            yield int(a), int(b), int(offset + a - lo)


class Zero:
    """The sharded state of one rank at ZeRO stage 1, 2 or 3, and the collectives around the step.

    master, m, v, decay_mask: this rank's shard (fp32; a bit a weight); grad_shard: the averaged gradients of this
    rank's shard after reduce-scatter; weight_shard: where AdamW writes this rank's part of the weights the
    forward reads (bf16 copy, or the fp32 params on the exact path) before they are all-gathered.
    Stage 1: the full gradient buffer `grads` and the full weights `weights`; the last micro-batch's backward
    reduce-scatters each bucket as soon as its gradients are final.
    Stage 2: no full gradient buffer: each bucket's gradients live in its home (BucketHomes, home_slot) and
    every micro-batch's backward reduce-scatters them into the shard (adding from the second micro-batch on),
    after which the slot is free for the layer after next.
    Stage 3: the weights too live in homes: the embedding's and head's buckets are all-gathered once after each
    update (stale), each layer's bucket into its slot before the layer's forward (the next layer's gather runs
    meanwhile), and again before its backward.
    At stages 1 and 2 the bf16 model's new weights are all-gathered at the start of the next forward, bucket by
    bucket, and each layer waits only for its own bucket (prefetch), instead of the whole gather after the update
    (which the fp32 model keeps: gather_weights).
    reduce_dtype BF16: the gradients are reduce-scattered in bf16 (rounded before, widened into the fp32 shard
    after, on the communication stream): half the bytes, at the cost of their rounding.
    With comm None (one GPU; stage 1) the shard buffers are the full ones and nothing is communicated.
    optimizer "adamw8bit": the moments in 8 bits as llama/optim.py's AdamW8bitState holds them,
    m_codes, v_codes (uint8) and m_scales, v_scales (fp32, one per QUANT_BLOCK values), instead of m, v; on
    several GPUs those of this rank's shard, whose pieces are whole blocks (model_shards).
    gradients False (one GPU, the optimizer in the backward): no full gradient buffer; the model keeps
    its gradients a group at a time.
    optimizer None (one GPU, a model that only scores): the weights alone, no gradients, moments or decay mask.
    """

    def __init__(self, layout: ShardLayout, comm, params: np.ndarray | None, decay_mask: np.ndarray, weight_dtype,
                 optimizer: str = "adamw", gradients: bool = True, stage: int = 1, reduce_dtype=np.float32):
        if optimizer is not None and optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if stage not in ZERO_STAGES:
            raise ValueError(f"ZeRO stage {stage}: choose from {', '.join(map(str, ZERO_STAGES))}")
        if optimizer == "adamw8bit" and comm is not None and any(piece % QUANT_BLOCK for piece in layout.pieces):
            raise ValueError(f"8-bit moments on several GPUs need pieces of whole {QUANT_BLOCK}-value blocks "
                             "(model_shards)")
        if not gradients and comm is not None:
            raise ValueError("the gradients live outside ZeRO (the optimizer in the backward) on one GPU only")
        if optimizer is None and gradients:
            raise ValueError("a model that only scores (no optimizer) has no gradients")
        if stage > 1 and comm is None:
            raise ValueError(f"ZeRO-{stage} shards over several GPUs; on one GPU stage 1 holds everything once")
        if np.dtype(reduce_dtype) not in (np.float32, BF16):
            raise ValueError(f"the gradients are reduced in fp32 or bf16, not {np.dtype(reduce_dtype)}")
        self.layout, self.comm, self.optimizer, self.stage = layout, comm, optimizer, stage
        self.rank = comm.rank if comm is not None else 0
        n = layout.padded_size
        self.grads = zeros(n) if gradients and stage == 1 else None
        self.weights = empty(n, weight_dtype) if stage < 3 else None
        self.grad_homes = BucketHomes(layout, np.float32) if stage >= 2 else None
        self.weight_homes = BucketHomes(layout, weight_dtype) if stage == 3 else None
        if comm is None:
            self.master = empty(n) if weight_dtype == BF16 else self.weights
            self.grad_shard = self.grads
            self.weight_shard = self.weights
        else:
            self.master = empty(layout.shard_size)
            self.grad_shard = empty(layout.shard_size)
            self.weight_shard = empty(layout.shard_size, weight_dtype) if weight_dtype == BF16 else self.master
            # a later micro-batch's fp32 reduction, added into the shard after (bf16's widen adds by itself)
            self.piece_scratch = empty(max(layout.pieces)) if stage >= 2 and np.dtype(reduce_dtype) != BF16 else None
            self.rounded = None  # bf16 reduction: a bucket rounded, and its reduced piece
            if np.dtype(reduce_dtype) == BF16:
                self.rounded = (empty(max(end - start for start, end in layout.buckets), BF16),
                                empty(max(layout.pieces), BF16))
            drv = runtime().drv
            event = lambda: drv.Event(drv.event_flags.DISABLE_TIMING)  # noqa: E731
            buckets = range(len(layout.buckets))
            self._reduced, self._gathered = ([event() for _ in buckets] for _ in range(2))
            self._released = [event() for _ in range(2)]  # ZeRO-3: a weight slot's layer is done
        if optimizer == "adamw8bit":
            blocks = -(-layout.shard_size // QUANT_BLOCK)
            self.m_codes, self.v_codes = empty(layout.shard_size, np.uint8), empty(layout.shard_size, np.uint8)
            self.m_scales, self.v_scales = empty(blocks), empty(blocks)
            self.maps = to_device(ops.quantization_maps())
        elif optimizer is not None:
            self.m, self.v = empty(layout.shard_size), empty(layout.shard_size)
        self.set_moments(None, None)
        self.decay_mask = (None if optimizer is None else
                           to_device(ops.pack_decay_mask(layout.shard(decay_mask, self.rank))))
        self.stale = False  # the weights the forward reads are older than the master (gather them first)
        self._step_first = True
        self._start_region()
        if params is not None:  # None: the caller fills them on the device (fill_master, set_weights_on_device)
            self.set_weights(params)

    @classmethod
    def for_model(cls, layout, comm, params: np.ndarray, weight_dtype, optimizer: str = "adamw",
                  gradients: bool = True, stage: int = 1, reduce_dtype=np.float32) -> "Zero":
        """The state of a model's flat parameters (llama/params.py layout), bucketed at its layers."""
        shards = model_shards(layout, comm.world_size if comm is not None else 1, optimizer)
        return cls(shards, comm, params, layout.decay_mask(), weight_dtype, optimizer, gradients, stage, reduce_dtype)

    def set_weights(self, params: np.ndarray) -> None:
        """Upload the full fp32 params: the master shard and the weights the forward reads (on one GPU
        without a host copy of the whole, which an 8B model could not afford twice, the bf16 weights rounded
        from the master on the device, as the host rounds them: to nearest even)."""
        params = np.asarray(params, np.float32)
        padded = self.layout.pad(params)
        if self.comm is None:  # the bf16 weights rounded on the device, not the host
            self.set_weights_on_device(lambda master: master.upload(padded))
            return
        if self.weights is not None:
            self.weights.upload(padded)
        shard = self.layout.shard(params, self.rank)
        if self.master is not self.weights:
            self.master.upload(shard)
        if self.weight_shard is not self.weights and self.weight_shard is not self.master:
            self.weight_shard.upload(shard.astype(self.weight_shard.dtype))
        self.stale = self.weights is None  # stage 3: the embedding's and head's homes are gathered first

    def set_weights_on_device(self, fill) -> None:
        """One GPU: fill(master) writes the full fp32 params into the master on the device, and the weights
        the forward reads follow (no host copy)."""
        if self.comm is not None:
            raise ValueError("the full weights are filled on the device on one GPU only (several: fill_master)")
        fill(self.master)
        self._weights_from_master()

    def fill_master(self, fill_range) -> None:
        """The master weights written on the device by fill_range(out, start), which puts the flat params from
        offset start into out (ops.fill_parameters): all of them on one GPU, this rank's shard on several (its
        padding zeros, fill_shard); the weights the forward reads follow, as set_weights leaves them."""
        fill_shard(self.master, self.layout, self.rank, fill_range)
        self._weights_from_master()

    def _weights_from_master(self) -> None:
        """The weights the forward reads from the master on the device: rounded to bf16 (to nearest even, as the
        host rounds them) where they are a copy, and on several GPUs all-gathered (gather_weights: stages 1-2 into
        the full weights now, stage 3 into each bucket's home as the forward reaches it)."""
        if self.comm is None:
            if self.weights is not self.master:
                ops.round_to_bf16(self.weights, self.master)
            self.stale = False
            return
        if self.weight_shard is not self.master:
            ops.round_to_bf16(self.weight_shard, self.master)
        self.gather_weights()

    def set_moments(self, m, v) -> None:
        """The full moments from a checkpoint (None: zeros): 8-bit ones (Quantized) uploaded as they are for
        8 bits on one GPU and dequantized otherwise, fp32 ones quantized on the host for 8 bits (on several
        GPUs this rank's shard, whose blocks are whole pieces' blocks). A model that only scores takes none."""
        if self.optimizer is None:
            if m is not None or v is not None:
                raise ValueError("a model that only scores (no optimizer) holds no moments")
            return
        if self.optimizer == "adamw8bit" and self.comm is None and isinstance(m, Quantized) and isinstance(v, Quantized):
            for buffer, host in ((self.m_codes, m.codes), (self.m_scales, m.scales), (self.v_codes, v.codes),
                                 (self.v_scales, v.scales)):
                buffer.upload(host)
            return
        m, v = fp32_moments(m, v)
        if self.optimizer == "adamw8bit":
            self._set_8bit_moments(m, v)
            return
        for buffer, host in ((self.m, m), (self.v, v)):
            if host is None:
                buffer.fill_zero()
            else:
                buffer.upload(self.layout.shard(host.astype(np.float32), self.rank))

    def _set_8bit_moments(self, m: np.ndarray | None, v: np.ndarray | None) -> None:
        """The 8-bit moments of the full fp32 ones (None: zeros), quantized on the host."""
        if m is None and v is None:  # every code that of zero, every scale 0
            for codes, zero_code in ((self.m_codes, ZERO_CODES[0]), (self.v_codes, ZERO_CODES[1])):
                runtime().drv.memset_d8_async(codes.ptr, zero_code, codes.nbytes, runtime().stream)
            self.m_scales.fill_zero()
            self.v_scales.fill_zero()
            return
        if self.comm is None:
            state = AdamW8bitState(self.layout.size)
            state.load(m, v)
            quantized = ((state.m_codes, state.m_scales), (state.v_codes, state.v_scales))
        else:
            zeros_or = lambda x: np.zeros(self.layout.size, np.float32) if x is None else x.astype(np.float32)  # noqa: E731
            quantized = [quantize_blocks(self.layout.shard(zeros_or(x), self.rank), levels)
                         for x, levels in ((m, DYNAMIC_SIGNED), (v, DYNAMIC_UNSIGNED))]
        for (codes, scales), (codes_buffer, scales_buffer) in zip(quantized, ((self.m_codes, self.m_scales),
                                                                             (self.v_codes, self.v_scales))):
            codes_buffer.upload(codes)
            scales_buffer.upload(scales)

    # ---- where a tensor's weights and gradients are

    def weight(self, offset: int, shape) -> DeviceArray:
        """The weights (as the forward reads them) of the tensor at flat offset."""
        if self.weights is None:
            return self.weight_homes.view(offset, shape)
        return self.weights.view(self.layout.position(offset), shape)

    def grad(self, offset: int, shape) -> DeviceArray:
        """Where the gradients of the tensor at flat offset accumulate."""
        if self.grads is None:
            return self.grad_homes.view(offset, shape)
        return self.grads.view(self.layout.position(offset), shape)

    def zero_grad(self) -> None:
        """Zero the gradients before a step (at stages 2-3 each home is zeroed as the step reaches it, and the
        step's first reductions write the shard)."""
        if self.grads is not None:
            self.grads.fill_zero()
        self._step_first = True

    # ---- a forward and backward (launches captured in one graph: every collective joins the compute
    # stream before its end, and the compute stream waits only for collectives issued since its start)

    def _start_region(self) -> None:
        self._issued, self._waited = set(), set()  # ("gather" | "reduce", bucket), ("release", slot, bucket)
        self._weight_slots, self._grad_slots = [None, None], [None, None]  # the bucket each slot holds
        self._first = True
        self._forked = False  # the communication stream has waited for the compute stream in this region

    def _fork(self) -> None:
        """The communication stream waits for the compute stream's launches so far (before a collective)."""
        self.comm.fork()
        self._forked = True

    def _join(self) -> None:
        """The compute stream waits for the region's collectives; none if it issued none (a captured graph may
        wait only on work captured with it: a micro-batch between the first and the last at stage 1)."""
        if self._forked:
            self.comm.join()

    def begin(self, gather: bool, first: bool | None = None) -> None:
        """Before a forward: gather: the weights changed since the last forward (stages 1-2: every bucket's
        all-gather starts now, on the communication stream; stage 3: the embedding's and head's, which then
        stay in their homes until the weights change again, also when stale says so; each layer's bucket is
        gathered as the forward reaches it). first: the step's first micro-batch (stages 2-3: its reductions
        write the shard, later ones add to it); None: whether no reduction ran since zero_grad().
        The gathers start before the embedding's and head's gradient homes are zeroed, so as not to wait for
        that memset. A region left open (a forward with targets that no backward followed: the fp32 model's
        evaluation) is joined first."""
        if self.comm is None:
            return
        self._join()
        self._start_region()
        self._first = self._step_first if first is None else first
        if gather or (self.stage == 3 and self.stale):
            self._fork()
            for k in (range(len(self.layout.buckets)) if self.stage < 3 else self.weight_homes.own):
                self._gather(k)
            self.stale = False
        if self.grad_homes is not None:
            for k in self.grad_homes.own:
                self.grad_homes.own[k].fill_zero()

    def _gather(self, k: int) -> None:
        """All-gather bucket k's weights into their place (stage 3: its slot, once the layer there is done)."""
        start, end = self.layout.buckets[k]
        if self.weights is not None:
            out = self.weights.view(start, (end - start,))
        else:
            out, slot = self.weight_homes.home(k), home_slot(k, len(self.layout.buckets))
            if slot is not None:
                before = self._weight_slots[slot]
                if before is not None:
                    if not self._slot_released(slot):
                        raise RuntimeError(f"bucket {k}'s gather would overwrite bucket {before}'s weights in use")
                    self.comm.stream.wait_for_event(self._released[slot])
                    self._issued.discard(("gather", before))
                    self._waited.discard(("gather", before))
                self._weight_slots[slot] = k
        piece, at = self.layout.pieces[k], self.layout.shard_offsets[k]
        self.comm.all_gather(out, self.weight_shard.view(at, (piece,)))
        self._gathered[k].record(self.comm.stream)
        self._issued.add(("gather", k))

    def use_weights(self, offset: int, prefetch: int | None = None) -> None:
        """Before the kernels that read the weights of the bucket holding flat offset: wait for its gather (stage
        3: start it first if not yet on its way); prefetch: the flat offset of the layer the step reaches next,
        whose gather stage 3 starts now (into the slot of the layer before this one, released already)."""
        if self.comm is None:
            return
        k = self.layout.bucket_of(offset)
        slot = home_slot(k, len(self.layout.buckets))
        self._issued.discard(("release", slot, k))  # in use again until released again
        if self.stage == 3 and slot is not None and ("gather", k) not in self._issued:
            self._fork()
            self._gather(k)
        if ("gather", k) in self._issued and ("gather", k) not in self._waited:
            runtime().stream.wait_for_event(self._gathered[k])
            self._waited.add(("gather", k))
        if prefetch is not None and self.stage == 3:
            n = self.layout.bucket_of(prefetch)
            slot = home_slot(n, len(self.layout.buckets))
            if slot is not None and ("gather", n) not in self._issued and (self._weight_slots[slot] is None
                                                                          or self._slot_released(slot)):
                if not self._forked:  # a region whose begin gathered nothing (the embedding and head resident)
                    self._fork()
                self._gather(n)

    def _slot_released(self, slot: int) -> bool:
        return ("release", slot, self._weight_slots[slot]) in self._issued

    def release_weights(self, offset: int) -> None:
        """After the last kernel that reads the weights of the bucket holding flat offset (stage 3: its slot
        may take another layer's once they have run)."""
        if self.stage != 3:
            return
        k = self.layout.bucket_of(offset)
        slot = home_slot(k, len(self.layout.buckets))
        if slot is not None and self._weight_slots[slot] == k:  # it stays there until another bucket's gather
            self._released[slot].record(runtime().stream)
            self._issued.add(("release", slot, k))

    def start_gradients(self, offset: int) -> None:
        """Before the backward writes the gradients of the bucket holding flat offset (stages 2-3: wait until
        the slot's last bucket has been reduce-scattered, then zero it)."""
        if self.grad_homes is None:
            return
        k = self.layout.bucket_of(offset)
        slot = home_slot(k, len(self.layout.buckets))
        if slot is None:
            return
        before = self._grad_slots[slot]
        if before is not None:
            runtime().stream.wait_for_event(self._reduced[before])
        self._grad_slots[slot] = k
        self.grad_homes.home(k).fill_zero()

    @contextmanager
    def layer(self, offset: int, prefetch: int | None, gradients: bool = False):
        """Around the kernels of the layer whose bucket holds flat offset: its weights waited for (and the
        bucket at prefetch, the layer the step reaches next, gathered meanwhile at stage 3), with gradients (a
        backward) its gradient slot made ready, and its weights released after."""
        self.use_weights(offset, prefetch)
        if gradients:
            self.start_gradients(offset)
        yield
        self.release_weights(offset)

    # ---- 1. reduce-scatter, bucket by bucket

    def reduce_from(self, offset: int, last: bool = True) -> None:
        """Gradients at flat offsets >= offset are final for this micro-batch: reduce-scatter every bucket
        inside them not yet on its way, on the communication stream (stage 1: on the step's last micro-batch
        only, when the full buffer holds the step's sum)."""
        if self.comm is None or (self.stage == 1 and not last):
            return
        for k in reversed(range(len(self.layout.buckets))):
            if self.layout.spans[k][0] < offset:
                break
            if ("reduce", k) in self._issued:
                continue
            self._issued.add(("reduce", k))
            self._fork()
            start, end = self.layout.buckets[k]
            piece, at = self.layout.pieces[k], self.layout.shard_offsets[k]
            grads = self.grads.view(start, (end - start,)) if self.grads is not None else self.grad_homes.home(k)
            shard, accumulate = self.grad_shard.view(at, (piece,)), not (self.stage == 1 or self._first)
            if self.rounded is not None:  # in bf16: round, reduce, widen (or add) into the shard
                rounded, reduced = self.rounded[0].prefix(end - start), self.rounded[1].prefix(piece)
                with runtime().launching_on(self.comm.stream):
                    ops.round_to_bf16(rounded, grads)
                self.comm.reduce_scatter(reduced, rounded)
                with runtime().launching_on(self.comm.stream):
                    ops.widen_bf16(shard, reduced, accumulate)
            elif not accumulate:
                self.comm.reduce_scatter(shard, grads)
            else:  # a later micro-batch: reduce beside the shard, then add
                scratch = self.piece_scratch.prefix(piece)
                self.comm.reduce_scatter(scratch, grads)
                with runtime().launching_on(self.comm.stream):
                    ops.residual_forward(shard, shard, scratch)
            self._reduced[k].record(self.comm.stream)

    def end(self, last: bool | None) -> None:
        """After a forward (last None) or a forward and backward: reduce-scatter the buckets still waiting
        (stages 2-3, and stage 1 on the step's last micro-batch: last True; all of them if no reduce_from came
        first), and make the compute stream wait for every collective issued since begin()."""
        if self.comm is None:
            return
        if last is not None:
            self.reduce_from(0, last)
            self._step_first = self._step_first and self.stage == 1
        self._join()
        self._start_region()

    def finish_reduce(self) -> None:
        """Stage 1 after an eager backward: reduce-scatter every bucket of the full gradients and wait for the
        shard (stages 2-3 reduced them in the micro-batches' end())."""
        if self.stage == 1:
            self.end(last=True)

    def reduce_all(self) -> None:
        """Reduce-scatter every bucket into the shard now and wait for it (the collectives alone: the benchmark)."""
        self._start_region()
        self.end(last=True)

    # ---- 2. the global grad norm

    def sum_over_ranks(self, x: DeviceArray) -> None:
        """x (a few fp32 values computed on this rank's shard) = their sum over ranks, in place."""
        if self.comm is None:
            return
        self.comm.fork()
        self.comm.all_reduce(x)
        self.comm.join()

    # ---- 4. all-gather

    def gather_weights(self) -> None:
        """Every rank's new weight_shard into the full weight buffer (stages 1-2) at once, in one NCCL group (the
        fp32 path's eager step, and the weights drawn on the device; stage 3 gathers as the forward goes, the
        embedding and head at its next begin)."""
        if self.comm is None:
            return
        if self.weights is None:
            self.stale = True
            return
        self.comm.fork()
        with self.comm.group():
            for k, (start, end) in enumerate(self.layout.buckets):
                piece, at = self.layout.pieces[k], self.layout.shard_offsets[k]
                self.comm.all_gather(self.weights.view(start, (end - start,)), self.weight_shard.view(at, (piece,)))
        self.comm.join()
        self.stale = False

    # ---- checkpoints: the full state on rank 0

    def gather_flat(self, shard: DeviceArray) -> DeviceArray:
        """The full flat array (`size` values) of a shard buffer, on every rank (a new buffer on several GPUs,
        all ranks call it): each bucket gathered in place at its flat offset, one after the other on the
        communication stream, so that the next bucket overwrites the padding the one before wrote past its
        end (one buffer of flat_gather_length values, not a padded and a flat copy)."""
        if self.comm is None:
            return shard.prefix(self.layout.size)
        flat = empty(flat_gather_length(self.layout), shard.dtype)
        self.comm.fork()
        for k, ((start, end), (flat_start, _)) in enumerate(zip(self.layout.buckets, self.layout.spans)):
            piece, at = self.layout.pieces[k], self.layout.shard_offsets[k]
            self.comm.all_gather(flat.view(flat_start, (end - start,)), shard.view(at, (piece,)))
        self.comm.join()
        return flat.prefix(self.layout.size)

    def gather(self, shard: DeviceArray) -> np.ndarray | None:
        """The full flat array (`size` values) of a shard buffer on rank 0, None on the other ranks (which take
        part in the all-gathers): bucket by bucket, so that no rank holds a second full copy on its GPU."""
        if self.comm is None:
            return shard.download()[:self.layout.size]
        out = np.empty(self.layout.size, shard.dtype) if self.rank == 0 else None
        for (start, end), values in zip(self.layout.spans, self._gathered_buckets(shard)):
            if out is not None:
                out[start:end] = values[:end - start]
        return out

    def _gathered_buckets(self, shard: DeviceArray, per: int = 1):
        """Each bucket's padded values of a shard buffer in turn, all-gathered: a host array on rank 0, None on
        the others. per: parameters a value stands for (QUANT_BLOCK for the 8-bit moments' block scales)."""
        bucket = empty(max(end - start for start, end in self.layout.buckets) // per, shard.dtype)
        try:
            for k, (start, end) in enumerate(self.layout.buckets):
                piece, at = self.layout.pieces[k] // per, self.layout.shard_offsets[k] // per
                self.comm.fork()
                self.comm.all_gather(bucket.prefix((end - start) // per), shard.view(at, (piece,)))
                self.comm.join()
                yield bucket.prefix((end - start) // per).download() if self.rank == 0 else None
        finally:  # also when the caller stops early: the all-gathers have run before `bucket` is freed
            runtime().stream.synchronize()

    def _gather_dequantized(self, codes: DeviceArray, scales: DeviceArray, levels: np.ndarray) -> np.ndarray | None:
        """The full fp32 values of an 8-bit moment's sharded codes and block scales on rank 0 (None on the others),
        bucket by bucket (a piece is whole blocks)."""
        out = np.empty(self.layout.size, np.float32) if self.rank == 0 else None
        buckets = zip(self.layout.spans, self._gathered_buckets(codes), self._gathered_buckets(scales, QUANT_BLOCK))
        for (start, end), bucket_codes, bucket_scales in buckets:
            if out is not None:
                out[start:end] = dequantize_blocks(bucket_codes, bucket_scales, levels)[:end - start]
        return out

    def moments(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The full fp32 moments (m, v) on rank 0 (dequantized for 8 bits), None on the other ranks."""
        if self.optimizer == "adamw8bit" and self.comm is not None:
            return (self._gather_dequantized(self.m_codes, self.m_scales, DYNAMIC_SIGNED),
                    self._gather_dequantized(self.v_codes, self.v_scales, DYNAMIC_UNSIGNED))
        if self.optimizer == "adamw8bit":
            state = AdamW8bitState(self.layout.size)
            for host, buffer in ((state.m_codes, self.m_codes), (state.v_codes, self.v_codes),
                                 (state.m_scales, self.m_scales), (state.v_scales, self.v_scales)):
                host[:] = buffer.download()
            return state.moments()
        return self.gather(self.m), self.gather(self.v)


def replica_copies(shards: ShardLayout, rank: int, tensors: list) -> tuple[dict, list]:
    """Where each tensor sits in a packed replica ({name: offset}), and the copies (replica offset,
    shard offset, count) that bring rank's owned parts of them from its shard into the replica."""
    offsets, copies, at = {}, [], 0
    owned = shards.owned(rank)
    for t in tensors:
        offsets[t.name], start = at, shards.position(t.offset)
        copies += [(at + a - start, shard_at, b - a) for a, b, shard_at in intersect(owned, start, start + t.size)]
        at += t.size
    return offsets, copies


class MasterReplica:
    """Full fp32 copies of a few small tensors whose master weights are sharded (the RMSNorm weights,
    which the bf16 model reads in fp32): after each update, every rank copies the parts it owns into
    a zeroed buffer and an all-reduce (sum) completes it, exactly (x + 0 = x)."""

    def __init__(self, zero: Zero, layout, names: list[str], params: np.ndarray | None):
        """params: the full host params, or None: the master shards' values (collected and all-reduced, as
        after an update)."""
        self.zero, self.layout, self.names = zero, layout, names
        self.offsets, self.copies = replica_copies(zero.layout, zero.rank, [layout.tensors[n] for n in names])
        self.values = empty(sum(layout.tensors[n].size for n in names))
        if params is None:
            self.collect()
            zero.sum_over_ranks(self.values)
        else:
            self.set(params)

    def view(self, name: str) -> DeviceArray:
        return self.values.view(self.offsets[name], self.layout.tensors[name].shape)

    def set(self, params: np.ndarray) -> None:
        self.values.upload(np.concatenate([params[self.layout.tensors[n].offset:][:self.layout.tensors[n].size]
                                           for n in self.names]))

    def collect(self) -> None:
        """This rank's parts of the new master values into the zeroed buffer (on the compute stream), which
        Zero.sum_over_ranks completes."""
        rt = runtime()
        self.values.fill_zero()
        for to, at, n in self.copies:
            rt.drv.memcpy_dtod_async(self.values.ptr + 4 * to, self.zero.master.ptr + 4 * at, 4 * n, rt.stream)
