"""ZeRO's schedule (stages 1-3) on the CPU: the collectives and the compute stream's waits that
llama/parallel/zero.py issues for a model's forward and backward, checked for races.

Zero runs against stand-ins for the GPU (host arrays, two streams with vector clocks, events) and a
communicator of two ranks that only records what its collectives read and write. A model's step is
driven as the GPU models drive it; every kernel that reads a bucket's weights or writes its gradients
is recorded too. Then each pair of accesses to the same memory from the two streams must be ordered by
the events (one happens before the other), and every read of a bucket's weights must come after the
all-gather of that bucket into that memory, with no other gather in between."""

import contextlib
import itertools

import numpy as np
import pytest

import llama.ops
from llama.config import get_preset
from llama.runtime.cuda import BF16
from llama.params import ParameterLayout
from llama.parallel import zero as zero_module
from llama.parallel.zero import Zero

CONFIG = get_preset("tiny").replace(n_layers=4)
LAYOUT = ParameterLayout(CONFIG)
STREAMS = ("compute", "communication")


class Stream:
    """A stream's vector clock, and whether it is part of a graph capture (CUDA's rules: a capturing stream may
    wait only on events recorded in the capture; a stream that waits on such an event joins the capture)."""

    def __init__(self, name):
        self.name, self.clock, self.capturing = name, dict.fromkeys(STREAMS, 0), False

    def wait_for_event(self, event):
        if self.capturing and not event.captured:
            raise AssertionError(f"the capturing {self.name} stream waits on an event recorded outside the capture")
        self.capturing = self.capturing or event.captured
        self.clock = {s: max(self.clock[s], event.clock[s]) for s in STREAMS}


class Event:
    def __init__(self, *flags):
        self.clock, self.captured = dict.fromkeys(STREAMS, 0), False

    def record(self, stream):
        self.clock, self.captured = dict(stream.clock), stream.capturing


class Recorder:
    """The accesses in launch order: (stream, clock, "read" | "write", buffer id, start, end, what)."""

    def __init__(self):
        self.accesses = []
        self.compute, self.communication = Stream("compute"), Stream("communication")
        self.stream = self.compute

    def access(self, stream, kind, array, what):
        stream.clock[stream.name] += 1
        self.accesses.append((stream.name, dict(stream.clock), kind, id(array.base), array.start,
                              array.start + array.size, what))

    @contextlib.contextmanager
    def launching_on(self, stream):
        compute, self.stream = self.stream, stream
        yield
        self.stream = compute


class Array:
    """A host stand-in for DeviceArray: views share their base buffer."""

    def __init__(self, size, dtype=np.float32, base=None, start=0, recorder=None):
        self.size, self.dtype, self.start, self.recorder = int(size), np.dtype(dtype), start, recorder
        self.base = base if base is not None else self
        self.nbytes = self.size * self.dtype.itemsize

    def view(self, offset, shape):
        return Array(int(np.prod(shape)), self.dtype, self.base, self.start + offset, self.recorder)

    def prefix(self, *shape):
        return self.view(0, shape)

    def fill_zero(self):
        self.recorder.access(self.recorder.stream, "write", self, "zero")

    def upload(self, host):
        assert np.asarray(host).size == self.size


class Communicator:
    rank, world_size = 0, 2

    def __init__(self, recorder):
        self.recorder, self.stream = recorder, recorder.communication

    def fork(self):
        event = Event()
        event.record(self.recorder.compute)
        self.stream.wait_for_event(event)

    def join(self):
        event = Event()
        event.record(self.stream)
        self.recorder.compute.wait_for_event(event)

    def all_gather(self, out, x):
        self.recorder.access(self.stream, "read", x, "shard read by a gather")
        self.recorder.access(self.stream, "write", out, f"gather {x.start}")  # named by its shard piece

    def reduce_scatter(self, out, x):
        self.recorder.access(self.stream, "read", x, "reduce")
        self.recorder.access(self.stream, "write", out, "reduce")

    def all_reduce(self, x):
        self.recorder.access(self.stream, "write", x, "all_reduce")

    def group(self):
        return contextlib.nullcontext()


@pytest.fixture
def recorder(monkeypatch):
    recorder = Recorder()
    runtime = type("Runtime", (), {})()
    runtime.drv = type("Driver", (), {"Event": Event, "event_flags": type("Flags", (), {"DISABLE_TIMING": 2})})
    runtime.launching_on = recorder.launching_on
    type(runtime).stream = property(lambda self: recorder.stream)
    monkeypatch.setattr(zero_module, "runtime", lambda: runtime)
    monkeypatch.setattr(zero_module, "empty", lambda n, dtype=np.float32: Array(np.prod(n), dtype, recorder=recorder))
    monkeypatch.setattr(zero_module, "zeros", lambda n, dtype=np.float32: Array(np.prod(n), dtype, recorder=recorder))
    monkeypatch.setattr(zero_module, "to_device", lambda host: Array(host.size, host.dtype, recorder=recorder))
    for name in ("residual_forward", "round_to_bf16", "widen_bf16"):  # out = f(inputs)
        monkeypatch.setattr(llama.ops, name, lambda out, *inputs: (
            [recorder.access(recorder.stream, "read", x, "convert") for x in inputs if isinstance(x, Array)],
            recorder.access(recorder.stream, "write", out, "convert")))
    return recorder


def step(z: Zero, recorder: Recorder, micro: int) -> None:
    """The bf16 model's step as seen by ZeRO: each kernel that reads a bucket's weights or writes its gradients."""
    z.zero_grad()
    for m in range(micro):
        micro_batch(z, recorder, m == 0, m == micro - 1)
    recorder.access(recorder.compute, "read", z.grad_shard, "optimizer")
    recorder.access(recorder.compute, "write", z.weight_shard, "optimizer")  # the new weights, gathered next
    z.stale = True  # as the models mark it after their update


def micro_batch(z: Zero, recorder: Recorder, first: bool, final: bool) -> None:
    """One micro-batch's forward and backward, as the bf16 model captures it for its role (first, final)."""
    starts, last = LAYOUT.layer_starts(), len(z.layout.buckets) - 1

    def read_weights(k):
        start, end = z.layout.spans[k]
        recorder.access(recorder.compute, "read", z.weight(start, (end - start,)), f"weights {k}")

    def write_grads(k):
        start, end = z.layout.spans[k]
        recorder.access(recorder.compute, "write", z.grad(start, (end - start,)), f"grads {k}")

    z.begin(gather=first, first=first)
    z.use_weights(0, prefetch=starts[0])
    read_weights(0)
    for i in range(CONFIG.n_layers):
        with z.layer(starts[i], prefetch=starts[i + 1]):
            read_weights(i + 1)
    z.use_weights(LAYOUT.output().offset)
    read_weights(last)
    write_grads(last)  # the classifier's dW
    z.reduce_from(starts[-1], final)
    for i in reversed(range(CONFIG.n_layers)):
        with z.layer(starts[i], prefetch=starts[i - 1] if i else None, gradients=True):
            read_weights(i + 1)
            write_grads(i + 1)
        z.reduce_from(starts[i], final)
    write_grads(0)
    z.end(final)


def before(a, b) -> bool:
    """Access a happens before access b."""
    return a[1][a[0]] <= b[1][a[0]]


@pytest.mark.parametrize("stage, micro, reduce_dtype", [(s, m, np.float32) for s, m in itertools.product([1, 2, 3], [1, 3])]
                         + [(1, 1, BF16), (2, 3, BF16), (3, 3, BF16)])
def test_the_schedule_has_no_races(recorder, stage, micro, reduce_dtype):
    z = Zero.for_model(LAYOUT, Communicator(recorder), np.zeros(LAYOUT.size, np.float32), np.float32,
                       stage=stage, reduce_dtype=reduce_dtype)
    recorder.accesses.clear()
    for _ in range(2):
        step(z, recorder, micro)
    accesses = recorder.accesses
    overlap = lambda a, b: a[3] == b[3] and a[4] < b[5] and b[4] < a[5]  # noqa: E731
    for a, b in itertools.combinations(accesses, 2):
        if a[0] != b[0] and overlap(a, b) and "write" in (a[2], b[2]):
            assert before(a, b) or before(b, a), f"race: {a[6]} on {a[0]} and {b[6]} on {b[0]}"
    gathers = [a for a in accesses if a[6].startswith("gather ")]
    if stage < 3:  # every bucket once a step, at the step's first micro-batch
        assert len(gathers) == 2 * len(z.layout.buckets)
    for read in (a for a in accesses if a[6].startswith("weights")):
        k = int(read[6].split()[1])
        sources = [g for g in gathers if overlap(g, read) and before(g, read)]
        assert sources, f"{read[6]} read before any gather"
        assert sources[-1][6] == f"gather {z.layout.shard_offsets[k]}", f"{read[6]} reads another bucket's gather"
        assert sources[-1][4] <= read[4] and sources[-1][5] >= read[5], f"{read[6]} reads past its gather"
        updates = [a for a in accesses if a[6] == "optimizer" and a[2] == "write" and before(a, read)]
        assert all(before(u, sources[-1]) for u in updates), f"{read[6]} reads weights older than the last update"
    reductions = [a for a in accesses if a[6] == "reduce" and a[2] == "read"]
    assert len(reductions) == len(z.layout.buckets) * (2 if stage == 1 else 2 * micro)
    optimizer = [a for a in accesses if a[6] == "optimizer"]
    for read in optimizer:  # the shard is complete when the optimizer reads it
        assert all(before(r, read) for r in reductions if r[1]["compute"] <= read[1]["compute"])


@pytest.mark.parametrize("micro", [1, 3])
def test_stage_3_gathers_each_layer_twice_a_micro_batch_and_the_embedding_and_head_once_a_step(recorder, micro):
    z = Zero.for_model(LAYOUT, Communicator(recorder), np.zeros(LAYOUT.size, np.float32), np.float32, stage=3)
    recorder.accesses.clear()
    for _ in range(2):
        step(z, recorder, micro)
    slots = {id(s) for s in z.weight_homes.slots}
    gathers = [a for a in recorder.accesses if a[6].startswith("gather ")]
    assert len(slots) == 2 and len([g for g in gathers if g[3] not in slots]) == 2 * 2  # the embedding and head
    # forward: every layer once; backward: all but the two the forward left in the slots
    assert len([g for g in gathers if g[3] in slots]) == 2 * micro * (2 * CONFIG.n_layers - 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_captured_micro_batch_forks_and_joins_inside_its_capture(recorder, stage):
    """A step of three micro-batches runs eagerly, then each role (first, middle, last) is captured as the bf16
    model captures it: the compute stream waits only on work of the same capture, and the capture ends with
    the communication stream's work joined (CUDA fails the capture otherwise). Stage 1's middle micro-batch
    issues no collective, so it must not wait on the communication stream at all."""
    z = Zero.for_model(LAYOUT, Communicator(recorder), np.zeros(LAYOUT.size, np.float32), np.float32, stage=stage)
    step(z, recorder, 3)
    compute, communication = recorder.compute, recorder.communication
    for first, final in ((True, False), (False, False), (False, True)):
        compute.capturing = True
        micro_batch(z, recorder, first, final)
        if communication.capturing:  # forked into the capture: joined again before its end
            assert compute.clock["communication"] >= communication.clock["communication"], "an unjoined fork"
        compute.capturing = communication.capturing = False


@pytest.mark.parametrize("stage", [2, 3])
def test_the_first_gathers_do_not_wait_for_the_gradient_homes_to_be_zeroed(recorder, stage):
    """begin() forks the step's first all-gathers before it zeroes the embedding's and head's gradient homes on
    the compute stream (the embedding's is the largest bucket)."""
    z = Zero.for_model(LAYOUT, Communicator(recorder), np.zeros(LAYOUT.size, np.float32), np.float32, stage=stage)
    recorder.accesses.clear()
    z.begin(gather=True, first=True)
    gathers = [a for a in recorder.accesses if a[6].startswith("gather ")]
    zeroed = [a for a in recorder.accesses if a[6] == "zero"]
    assert gathers and len(zeroed) == 2
    assert not any(before(m, g) for m in zeroed for g in gathers)


def test_a_region_left_open_is_joined_by_the_next_begin(recorder):
    """The fp32 model's forward with targets leaves its region open for the backward; where none follows (an
    evaluation), the next begin() makes the compute stream wait for the region's collectives first."""
    z = Zero.for_model(LAYOUT, Communicator(recorder), np.zeros(LAYOUT.size, np.float32), np.float32, stage=3)
    z.begin(gather=True)
    z.use_weights(0, prefetch=LAYOUT.layer_starts()[0])  # the first layer's gather is still on its way
    issued = recorder.communication.clock["communication"]
    z.begin(gather=False)
    assert recorder.compute.clock["communication"] >= issued


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_shard_of_the_decay_mask_a_bit_a_weight(recorder, monkeypatch, rank):
    """The byte mask's shard packed (ops.pack_decay_mask): the padding reads as no decay, and each piece of the
    shard starts on a whole byte (pieces of ALIGN values), as the kernels' 8-wide reads take it."""
    monkeypatch.setattr(zero_module, "to_device", lambda host: host)  # what Zero uploads, kept on the host
    monkeypatch.setattr(Communicator, "rank", rank)
    z = Zero.for_model(LAYOUT, Communicator(recorder), np.zeros(LAYOUT.size, np.float32), np.float32)
    shards = z.layout
    assert z.decay_mask.dtype == np.uint8 and z.decay_mask.shape == (-(-shards.shard_size // 8),)
    bits = np.unpackbits(z.decay_mask, bitorder="little")
    np.testing.assert_array_equal(bits[:shards.shard_size], shards.shard(LAYOUT.decay_mask(), rank))
    assert not bits[shards.shard_size:].any()
    assert all(offset % 8 == 0 and piece % 8 == 0 for offset, piece in zip(shards.shard_offsets, shards.pieces))
