"""The flash attention ladder: its rungs' numbering (dev/cuda/flash_attention_v<N>.cu; v2 is kernels/flash_attention.cu
included, v3 to v6 kernels/flash_attention_wgmma.cu with their forward's hooks), the launchers of what the rungs add
beyond production's (v1's nondeterministic atomic-dQ backward, v4's fused-dQ backward), Build, a build as the runner,
the tests and the benchmarks launch it, and FlashAttentionProblem, one problem's device buffers to run builds on.
The production builds' launchers are llama/ops/flash_attention.py's; a Build launches through them wherever a rung
has nothing of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llama.ops.common import BLOCK, blocks, check, kernel, kernel_constant
from llama.ops.flash_attention import (FlashSource, backward_arguments, flash_attention_backward,
                                       flash_attention_forward, flash_attention_scratch_size, flash_config)
from llama.runtime.cuda import BF16, DeviceArray, empty, runtime, to_device

LADDER = Path(__file__).resolve().parent  # the rungs' sources
VERSIONS = (1, 2, 3, 4, 5, 6)
FIRST_DOCUMENT_MASK_VERSION = 2  # rungs from this one on (as every production build) take doc_start, doc_end
FIRST_TMA_VERSION = 3  # rungs from this one on are wgmma kernels fed by TMA (sm_90a only)
ATOMIC_DQ_VERSION = 1  # carries a nondeterministic backward adding dQ by fp32 atomics
FUSED_DQ_VERSION = 4  # forms dQ inside the dK/dV kernel (v5, v6 run v3's backward)
DQ_TILE_ROWS = kernel_constant("flash_attention_wgmma", "DKDV_Q_ROWS")  # the fused backward's fp32 dQ tiles' rows


@dataclass(frozen=True)
class Build:
    """A flash attention build as the ladder launches it: rung `version` of the ladder (Build.rung), or a production
    build (version None: FlashSource as the plan names it). forward, backward and scratch_size have the production
    launchers' arguments but the source; backward runs v4's fused dQ where the rung has it."""
    source: FlashSource
    version: int | None = None

    @classmethod
    def rung(cls, version: int) -> "Build":
        if version not in VERSIONS:
            raise ValueError(f"flash attention ladder: no v{version} ({', '.join(map(str, VERSIONS))})")
        return cls(FlashSource(f"flash_attention_v{version}", LADDER, tma=version >= FIRST_TMA_VERSION,
                               document_mask=version >= FIRST_DOCUMENT_MASK_VERSION), version)

    @property
    def name(self) -> str:
        return f"v{self.version}" if self.version is not None else self.source.module

    @property
    def fused_dq(self) -> bool:
        return self.version == FUSED_DQ_VERSION

    @property
    def nondeterministic_backward(self) -> bool:
        """Whether it carries an opt-in nondeterministic backward to measure determinism against: v1's atomic dQ,
        v4's unordered dQ adds."""
        return self.version in (ATOMIC_DQ_VERSION, FUSED_DQ_VERSION)

    def scratch_size(self, B: int, T: int, H: int, D: int) -> int:
        """float32 elements of the backward's scratch: delta; for the fused dQ from a 256-byte boundary the fp32 dQ
        tiles (B, H, ceil(T / 64), 64 * D), one int32 count per tile and the CTAs' work counter."""
        delta = flash_attention_scratch_size(B, T, H, D, self.source)
        if not self.fused_dq:
            return delta
        return _dq_offset(delta) + B * H * math.ceil(T / DQ_TILE_ROWS) * (DQ_TILE_ROWS * D + 1) + 1

    def forward(self, out: DeviceArray, lse: DeviceArray, qkv: DeviceArray, n_heads: int, n_kv_heads: int,
                **mask) -> None:
        flash_attention_forward(out, lse, qkv, n_heads, n_kv_heads, source=self.source, **mask)

    def backward(self, dqkv: DeviceArray, scratch: DeviceArray, dout: DeviceArray, out: DeviceArray, lse: DeviceArray,
                 qkv: DeviceArray, n_heads: int, n_kv_heads: int, cos: DeviceArray | None = None,
                 sin: DeviceArray | None = None, deterministic: bool = True, **mask) -> None:
        """The build's backward; deterministic=False (v4 only, opt-in, for measuring what the order costs) adds the
        dQ partials in whatever order the CTAs reach them."""
        if self.fused_dq:
            fused_dq_backward(self, dqkv, scratch, dout, out, lse, qkv, n_heads, n_kv_heads, cos, sin, deterministic,
                              **mask)
            return
        if not deterministic:
            raise ValueError(f"deterministic=False: {self.name} has no unordered backward (v{FUSED_DQ_VERSION} only)")
        flash_attention_backward(dqkv, scratch, dout, out, lse, qkv, n_heads, n_kv_heads, cos, sin,
                                 source=self.source, **mask)


def _dq_offset(delta: int) -> int:
    return -(-delta // 64) * 64


def fused_dq_backward(build: Build, dqkv: DeviceArray, scratch: DeviceArray, dout: DeviceArray, out: DeviceArray,
                      lse: DeviceArray, qkv: DeviceArray, n_heads: int, n_kv_heads: int, cos: DeviceArray | None,
                      sin: DeviceArray | None, deterministic: bool, doc_start: DeviceArray | None = None,
                      doc_end: DeviceArray | None = None) -> None:
    """v4's backward: the delta kernel, the dK/dV kernel that also adds each step's dQ partial into the fp32 tiles of
    the scratch (in a fixed order of kv tiles, or unordered), then the kernel that turns them into bf16 dQ."""
    source = build.source
    a = backward_arguments(dqkv, scratch, dout, out, lse, qkv, n_heads, n_kv_heads, cos, sin, source, doc_start,
                           doc_end, scratch_size=lambda B, T, H, D, _: build.scratch_size(B, T, H, D))
    B, T, H, KV, D = a.shape
    signature, args = a.leading()
    dq = scratch.view(_dq_offset(B * H * T), (scratch.size - _dq_offset(B * H * T),))
    dq.fill_zero()  # the tiles, then their counts
    counts = dq.ptr + B * H * math.ceil(T / DQ_TILE_ROWS) * DQ_TILE_ROWS * D * 4
    threads, rows, shared = _fused_config(source)[{64: 0, 128: 1}[D]]
    name = "fused" if deterministic else "fused_unordered"
    kernel(source.module, f"flash_attention_backward_{name}_d{D}", signature + "PP" + a.mask_signature,
           source.directory)((KV, B, math.ceil(T / rows)), threads, *args, dq.ptr, counts, *a.mask, shared=shared)
    cos_ptr, sin_ptr = a.pointers[5:7]
    kernel(source.module, f"flash_attention_backward_dq_store_d{D}", "PPPPiii", source.directory)(
        (H, B, math.ceil(T / DQ_TILE_ROWS)), 128, dqkv.ptr, dq.ptr, cos_ptr, sin_ptr, T, H, KV)


_FUSED_CONFIGS = {}


def _fused_config(source: FlashSource) -> list[tuple[int, int, int]]:
    """v4's flash_attention_fused_config: (threads, kv rows, shared bytes) of the fused kernel at D = 64, 128."""
    if source not in _FUSED_CONFIGS:
        rt = runtime()
        pointer, _ = rt.module(source.module, source.directory).get_global("flash_attention_fused_config")
        table = np.empty((2, 3), dtype=np.int32)
        rt.drv.memcpy_dtoh(table, pointer)
        _FUSED_CONFIGS[source] = [tuple(int(x) for x in row) for row in table]
    return _FUSED_CONFIGS[source]


def atomic_dq_backward(build: Build, dqkv: DeviceArray, scratch: DeviceArray, dq_accum: DeviceArray,
                       dout: DeviceArray, out: DeviceArray, lse: DeviceArray, qkv: DeviceArray, n_heads: int,
                       n_kv_heads: int, cos: DeviceArray | None = None, sin: DeviceArray | None = None) -> None:
    """NONDETERMINISTIC, opt-in, for measuring what determinism costs: v1's backward with dQ added by fp32 atomics
    inside the dK/dV kernel into dq_accum (B, T, H, D) float32, then converted (dev/cuda/flash_attention_v1.cu)."""
    if build.version != ATOMIC_DQ_VERSION:
        raise ValueError(f"{build.name} has no atomic-dQ backward (v{ATOMIC_DQ_VERSION} only)")
    source = build.source
    a = backward_arguments(dqkv, scratch, dout, out, lse, qkv, n_heads, n_kv_heads, cos, sin, source, None, None)
    B, T, H, KV, D = a.shape
    check("dq_accum", dq_accum, (B, T, H, D))
    dq_accum.fill_zero()
    rt = runtime()
    pointer, _ = rt.module(source.module, source.directory).get_global("flash_attention_atomic_dq_shared")
    shared = np.empty(2, dtype=np.int32)
    rt.drv.memcpy_dtoh(shared, pointer)
    dkdv = flash_config(source, D, "dkdv")
    kernel(source.module, f"flash_attention_backward_dkdv_atomic_dq_d{D}", "PPPPPPPPiii", source.directory)(
        (KV, B, math.ceil(T / dkdv.rows)), dkdv.threads, *a.pointers, dq_accum.ptr, *a.sizes,
        shared=int(shared[{64: 0, 128: 1}[D]]))
    cos_ptr, sin_ptr = a.pointers[5:7]
    kernel(source.module, "flash_attention_backward_dq_convert", "PPPPiiiii", source.directory)(
        blocks(B * T * H * D // 2), BLOCK, dqkv.ptr, dq_accum.ptr, cos_ptr, sin_ptr, B, T, H, KV, D)


class FlashAttentionProblem:
    """One attention problem on the device, with random bf16 qkv and dout and every output buffer: what the ladder's
    runner (dev/cuda/flash_attention.py), scripts/bench_attention.py and scripts/bench_doc_mask.py run builds on."""

    def __init__(self, B: int, T: int, H: int, KV: int, D: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.shape = (B, T, H, KV, D)
        self.qkv_host = rng.standard_normal((B, T, (H + 2 * KV) * D)).astype(BF16)
        self.dout_host = rng.standard_normal((B, T, H * D)).astype(BF16)
        self.qkv, self.dout = to_device(self.qkv_host), to_device(self.dout_host)
        self.out, self.dqkv = empty((B, T, H * D), BF16), empty(self.qkv.shape, BF16)
        self.lse = empty((B, H, T))
        self.dq_accum = empty((B, T, H, D))
        self._scratch = {}

    def scratch(self, build: Build) -> DeviceArray:
        """The backward's scratch for this build."""
        B, T, H, _, D = self.shape
        size = build.scratch_size(B, T, H, D)
        if size not in self._scratch:
            self._scratch[size] = empty((size,))
        return self._scratch[size]

    def forward(self, build: Build) -> None:
        build.forward(self.out, self.lse, self.qkv, *self.shape[2:4])

    def backward(self, build: Build, deterministic: bool = True) -> None:
        build.backward(self.dqkv, self.scratch(build), self.dout, self.out, self.lse, self.qkv, *self.shape[2:4],
                       deterministic=deterministic)

    def backward_nondeterministic(self, build: Build) -> None:
        """The build's opt-in nondeterministic backward (Build.nondeterministic_backward): v1's atomic dQ, or v4's
        unordered dQ adds."""
        if build.fused_dq:
            self.backward(build, deterministic=False)
            return
        atomic_dq_backward(build, self.dqkv, self.scratch(build), self.dq_accum, self.dout, self.out, self.lse,
                           self.qkv, *self.shape[2:4])
