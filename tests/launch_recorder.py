"""A recording stand-in for the GPU: the models run on the CPU, every kernel launch, copy, memset, event, graph
capture and replay is written down instead of run, and nothing is computed (downloads read zeros).

Device pointers are given out by a bump allocator and written down as (the buffer's rank in the order the
recording first meets it, offset), so that two builds which allocate the same buffers in another order still read
the same; a TMA descriptor is written down as the rank of its encoding, whose arguments are an event of their own.
A change that is meant to keep behaviour (a refactor) proves it by recording the same events before and after:

    python3 -m tests.launch_recorder OUT.json        # the plans of RECORDED_RUNS, each's events
    python3 -m tests.launch_recorder --compare BEFORE.json AFTER.json

What the stand-in cannot see: what the kernels compute, and launch shapes read from the device at run time (the
flash attention builds' config table reads as 128s).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import itertools
import json
import struct
import sys
import types

import numpy as np

ALIGN, BASE = 512, 0x7F00_0000_0000
TENSOR_MAP_MAGIC = 0x7E45_0000


class Recording:
    """The events of a recording, with the pointers and descriptors it has met, ranked."""

    def __init__(self):
        self.events, self.allocations, self.ranks, self.maps = [], [], {}, {}
        self.next_address = BASE

    def allocate(self, nbytes: int) -> int:
        address = self.next_address
        self.allocations.append((address, address + nbytes))
        self.next_address += -(-max(nbytes, 1) // ALIGN) * ALIGN
        return address

    def pointer(self, value: int):
        """(rank, offset) of a device address, else None."""
        if not BASE <= value < self.next_address:
            return None
        index = next(i for i, (start, end) in enumerate(self.allocations) if start <= value < max(end, start + 1))
        rank = self.ranks.setdefault(index, len(self.ranks))
        return ["buffer", rank, value - self.allocations[index][0]]

    def value(self, x):
        """An argument as it is written down."""
        if isinstance(x, (bytes, bytearray)):
            if len(x) >= 8 and struct.unpack_from("<I", x)[0] == TENSOR_MAP_MAGIC:
                return ["tensor map", struct.unpack_from("<I", x, 4)[0]]
            whole = len(x) - len(x) % 8  # a packed struct: its 8-byte words, pointers among them ranked
            words = [self.pointer(w) or w for w in struct.unpack_from(f"<{whole // 8}Q", x)]
            return ["bytes", words, bytes(x[whole:]).hex()]
        if isinstance(x, (np.generic,)):
            x = x.item()
        if isinstance(x, (bool, str)) or x is None:
            return x
        if isinstance(x, int):
            return self.pointer(x) or x
        if isinstance(x, float):
            return float(np.float32(x)) if np.isfinite(x) else repr(x)
        if isinstance(x, (tuple, list)):
            return [self.value(v) for v in x]
        if isinstance(x, ctypes._SimpleCData):
            return self.value(x.value)
        return repr(x)

    def add(self, kind: str, *args) -> None:
        self.events.append([kind, *[self.value(a) for a in args]])


class FakeAllocation:
    """A device allocation: its address as int(), weakly referable as PyCUDA's are."""

    def __init__(self, address: int):
        self.address = address

    def __int__(self):
        return self.address

    __index__ = __int__


class FakeEvent:
    counter = itertools.count()

    def __init__(self, recording: Recording, flags=0):
        self.recording, self.id = recording, next(FakeEvent.counter)

    def record(self, stream=None):
        self.recording.add("event record", self.id, getattr(stream, "handle", 0))

    def synchronize(self):
        pass

    def time_since(self, other):
        return 1.0


class FakeStream:
    counter = itertools.count(1)

    def __init__(self, recording: Recording, flags=0):
        self.recording, self.handle = recording, next(FakeStream.counter)

    def wait_for_event(self, event):
        self.recording.add("stream wait", self.handle, event.id)

    def synchronize(self):
        pass


class FakeDriverModule:
    """pycuda.driver as the models use it."""

    def __init__(self, recording: Recording):
        self.recording = recording
        self.event_flags = types.SimpleNamespace(DISABLE_TIMING=2)
        self.device_attribute = types.SimpleNamespace(MULTIPROCESSOR_COUNT="sms",
                                                      MAX_SHARED_MEMORY_PER_BLOCK_OPTIN="shared")
        self.function_attribute = types.SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES="max shared")
        self.Context = types.SimpleNamespace(synchronize=lambda: None, get_device=lambda: None)

    def mem_alloc(self, nbytes):
        return FakeAllocation(self.recording.allocate(int(nbytes)))

    def mem_get_info(self):
        return (140 << 30, 141 << 30)

    def pagelocked_empty(self, shape, dtype):
        return np.zeros(shape, dtype)

    def Event(self, flags=0):  # noqa: N802
        return FakeEvent(self.recording, flags)

    def Stream(self, flags=0):  # noqa: N802
        return FakeStream(self.recording, flags)

    def memcpy_htod(self, dest, src):
        self.recording.add("copy to device", int(dest), np.asarray(src).nbytes)

    def memcpy_htod_async(self, dest, src, stream=None):
        self.recording.add("copy to device async", int(dest), np.asarray(src).nbytes, getattr(stream, "handle", 0))

    def memcpy_dtoh(self, dest, src):
        dest[...] = 128 if dest.dtype == np.int32 else 0  # the config tables of the flash builds: 128s
        self.recording.add("copy to host", int(src), dest.nbytes)

    def memcpy_dtoh_async(self, dest, src, stream=None):
        self.recording.add("copy to host async", int(src), np.asarray(dest).nbytes, getattr(stream, "handle", 0))

    def memcpy_dtod_async(self, dest, src, nbytes, stream=None):
        self.recording.add("copy on device", int(dest), int(src), int(nbytes), getattr(stream, "handle", 0))

    def memset_d8_async(self, dest, value, nbytes, stream=None):
        self.recording.add("memset", int(dest), int(value), int(nbytes), getattr(stream, "handle", 0))


class FakeDevice:
    def name(self):
        return "NVIDIA H200 (stand-in)"

    def compute_capability(self):
        return (9, 0)

    def get_attribute(self, attribute):
        return {"sms": 132, "shared": 232448}[attribute]

    def pci_bus_id(self):
        return "0000:00:00.0"


class FakeKernel:
    def __init__(self, recording: Recording, module: str, name: str):
        self.recording, self.module, self.name = recording, module, name

    def __call__(self, grid, block, *args, shared: int = 0, dependent: bool = False, cluster=None):
        self.recording.add("launch", self.name, tuple(grid), block, list(args), int(shared), bool(dependent), cluster,
                           fake_runtime(self.recording).stream.handle)


class FakeModule:
    def __init__(self, recording: Recording):
        self.recording = recording

    def get_global(self, name):
        return FakeAllocation(self.recording.allocate(104)), 104


class FakeRuntime:
    """llama/runtime/cuda.py's Runtime on the stand-in."""

    def __init__(self, recording: Recording):
        self.recording = recording
        self.drv = FakeDriverModule(recording)
        self.device = FakeDevice()
        self.name, self.code, self.dependent_launches = self.device.name(), "sm_90a", True
        self.stream = FakeStream(recording)
        self.stream.handle = 0

    @contextlib.contextmanager
    def launching_on(self, stream):
        compute, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = compute

    def module(self, name, directory=None, entry=None):
        return FakeModule(self.recording)

    def kernel(self, module, name, signature, directory=None):
        return FakeKernel(self.recording, module, name)

    def synchronize(self):
        pass


_RUNTIMES = {}


def fake_runtime(recording: Recording) -> FakeRuntime:
    return _RUNTIMES[id(recording)]


class FakeFunction:
    """A driver entry point of the stand-in's libcuda."""

    def __init__(self, recording: Recording, name: str):
        self.recording, self.name, self.restype, self.argtypes = recording, name, None, None
        self.maps = itertools.count()

    def __call__(self, *args):
        r = self.recording
        if self.name == "cuTensorMapEncodeTiled":
            address, dtype, rank, pointer, dims, strides, box = args[:7]
            number = next(self.maps)
            ctypes.memmove(address, struct.pack("<II", TENSOR_MAP_MAGIC, number), 8)
            r.add("tensor map", number, dtype, pointer, list(dims)[:rank], list(strides)[:rank - 1], list(box)[:rank],
                  *args[8:])
        elif self.name == "cuGraphInstantiateWithFlags":
            handle = args[0]._obj
            handle.value = 1 + sum(e[0] == "graph" for e in r.events)
            r.add("graph", handle.value)
        elif self.name in ("cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphLaunch"):
            r.add(self.name, *[getattr(a, "value", a) for a in args if type(a).__name__ != "CArgObject"])
        return 0


class FakeLibcuda:
    def __init__(self, recording: Recording):
        self.recording, self.functions = recording, {}

    def __getattr__(self, name):
        if name.startswith("_") or name in ("recording", "functions"):
            raise AttributeError(name)
        return self.functions.setdefault(name, FakeFunction(self.recording, name))


def _cuda_module():
    """The CUDA runtime module: llama/runtime/cuda.py (llama/cuda.py in trees before the rooms)."""
    for name in ("llama.cuda", "llama.runtime.cuda"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no llama CUDA runtime module")


def _clear_caches() -> None:
    """The caches that hold what a runtime made: kernels, tensor maps, tile counters, flash configs."""
    cuda = _cuda_module()
    cuda.runtime.cache_clear()
    cuda.driver.cache_clear()
    common = importlib.import_module("llama.ops.common")
    common._KERNELS.clear()
    wgmma = importlib.import_module("llama.ops.gemm_wgmma")
    wgmma._encode.cache_clear()
    wgmma.tensor_map.cache_clear()
    wgmma._TILE_COUNTERS.clear()
    importlib.import_module("llama.ops.flash_attention")._FLASH_CONFIGS.clear()


@contextlib.contextmanager
def recording_gpu():
    """The stand-in installed for the block: yields the Recording that the launches write into."""
    recording = Recording()
    fake_driver = FakeDriverModule(recording)
    pycuda = types.ModuleType("pycuda")
    pycuda.driver = fake_driver
    saved_modules = {name: sys.modules.get(name) for name in ("pycuda", "pycuda.driver", "pycuda.autoprimaryctx")}
    sys.modules.update({"pycuda": pycuda, "pycuda.driver": fake_driver,
                        "pycuda.autoprimaryctx": types.ModuleType("pycuda.autoprimaryctx")})
    cuda = _cuda_module()
    saved = cuda.Runtime, ctypes.CDLL
    _RUNTIMES[id(recording)] = FakeRuntime(recording)
    cuda.Runtime = lambda: _RUNTIMES[id(recording)]
    ctypes.CDLL = lambda name, *a, **k: FakeLibcuda(recording) if "cuda" in name else saved[1](name, *a, **k)
    _clear_caches()
    try:
        yield recording
    finally:
        gc.collect()  # what the block made and dropped goes while the stand-in is there to take it back
        cuda.Runtime, ctypes.CDLL = saved
        _clear_caches()
        del _RUNTIMES[id(recording)]
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# ---- the runs recorded for a refactor's comparison

BOS = 7  # the document mask's BOS in the recorded runs
RECORDED_RUNS = {  # name: the run's RunOptions fields, and micro-batches a step, untied head
    "bf16_partial_accum2": dict(dtype="bf16", micro=2),
    "bf16_none_untied": dict(dtype="bf16", recompute="none", untied=True),
    "bf16_full_adamw8bit": dict(dtype="bf16", recompute="full", optimizer="adamw8bit"),
    "fp8_row": dict(dtype="fp8"),
    "fp8_tensor_full": dict(dtype="fp8", fp8_scaling="tensor", recompute="full"),
    "bf16_in_backward_full": dict(dtype="bf16", recompute="full", in_backward=True),
    "bf16_sft_doc_mask": dict(dtype="bf16", sft=True, micro=2),
    "fp32": dict(dtype="fp32"),
}


def record_run(spec: dict, steps: int = 3, B: int = 2, T: int = 64) -> list:
    """The events of a small two-layer model of this plan: built, `steps` training steps (the first eager and
    captured, the next replayed), a forward with targets, one without and its logits at the last position, and on
    the bf16 paths the decoder's prefill of 5 tokens and 3 decode steps."""
    from llama.config import get_preset
    from llama.model import build_model
    from llama.model.generate import decoder_for
    from llama.model.sampling import Sampling
    from llama.optim import AdamWConfig
    from llama.options import RunOptions
    from llama.params import init_parameters
    from llama.run.plan import make_plan

    config = get_preset("d6").replace(n_layers=2, vocab_size=512, max_seq_len=128, tie_embeddings=not spec.get("untied"))
    micro = spec.get("micro", 1)
    fields = {k: v for k, v in spec.items() if k not in ("micro", "untied")}
    rng = np.random.default_rng(0)
    with recording_gpu() as recording:
        plan = make_plan(config, RunOptions("cuda", bos_id=BOS, **fields))
        model = build_model(config, plan, (B, T), init_parameters(config, 0))
        recording.add("built")
        for step in range(1, steps + 1):
            tokens = rng.integers(0, config.vocab_size, (B * micro, T)).astype(np.int32)
            tokens[:, ::9] = BOS
            targets = rng.integers(0, config.vocab_size, (B * micro, T)).astype(np.int32)
            if plan.sft:
                targets[:, ::3] = -1
            batches = list(zip(np.split(tokens, micro), np.split(targets, micro)))
            counted = float((targets >= 0).sum()) if plan.sft else None
            model.train_step(batches, 1e-3, step, AdamWConfig(), batches[0] if step < steps else None, counted)
            recording.add("step", step)
        model.forward(tokens[:B], targets[:B])
        model.token_losses()
        model.forward(tokens[:B])
        model.read_logits(position=-1)
        recording.add("forwards")
        if plan.dtype != "fp32":
            decoder = decoder_for(model, plan, max_len=T)
            sampling = Sampling(1.0, 40, seed=3)
            decoder.prefill(tokens[:1, :5], sampling)
            decoder.decode(3, sampling)
            recording.add("decoded")
            del decoder
        del model
    return recording.events


def first_difference(a: list, b: list) -> int | None:
    """The index of the first event where two recordings differ (one ending early counts), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"]:
        before, after = (json.loads(open(path).read()) for path in argv[1:3])
        differ = 0
        for name in sorted(set(before) | set(after)):
            a, b = before.get(name, []), after.get(name, [])
            at = first_difference(a, b)
            differ += at is not None
            print(f"{name}: the same {len(a)} events" if at is None else
                  f"{name}: differs at event {at}: {a[at:at + 1]} against {b[at:at + 1]}")
        return 1 if differ else 0
    events = {name: record_run(spec) for name, spec in RECORDED_RUNS.items()}
    with open(argv[0], "w") as f:
        json.dump(events, f)
    print(", ".join(f"{name}: {len(e)} events" for name, e in events.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
