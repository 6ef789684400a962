"""The flash attention ladder's own launchers and benchmark problem (the rungs dev/cuda/flash_attention_v<N>.cu,
v2 to v4 being the production builds): v1's nondeterministic atomic-dQ backward, and FlashAttentionProblem,
one problem's device buffers, which the ladder's runner, the tests and scripts/bench_attention.py run each build
on. The production launchers are llama/ops/flash_attention.py's."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from llama.runtime.cuda import BF16, DeviceArray, empty, runtime, to_device
from llama.ops.common import BLOCK, ROWS_PER_BLOCK, blocks, check, kernel
from llama.ops.flash_attention import (FlashSource, flash_attention_backward, flash_attention_forward,
                                       flash_attention_scratch_size, flash_config, flash_shapes)

LADDER = Path(__file__).resolve().parent  # the rungs' sources (FlashSource.ladder's directory)
ATOMIC_DQ_MODULE = "flash_attention_v1"  # the rung whose atomic-dQ kernels flash_attention_backward_atomic_dq runs


def flash_attention_backward_atomic_dq(dqkv: DeviceArray, delta: DeviceArray, dq_accum: DeviceArray, dout: DeviceArray,
                                       out: DeviceArray, lse: DeviceArray, qkv: DeviceArray, n_heads: int,
                                       n_kv_heads: int, cos: DeviceArray | None = None,
                                       sin: DeviceArray | None = None, *, source: FlashSource) -> None:
    """NONDETERMINISTIC, opt-in, for measuring what determinism costs: flash_attention_backward with dQ
    added by fp32 atomics inside the dK/dV kernel into dq_accum (B, T, H, D) float32, then converted.
    Only builds that carry these kernels take it (ATOMIC_DQ_MODULE, dev/cuda/flash_attention_v1.cu)."""
    B, T, H, KV, D = flash_shapes(qkv, n_heads, n_kv_heads)
    check("dq_accum", dq_accum, (B, T, H, D))
    dq_accum.fill_zero()
    cos_ptr, sin_ptr = (0, 0) if cos is None else (cos.ptr, sin.ptr)
    kernel(source.module, "flash_attention_backward_delta", "PPPiiii", source.directory)(
        blocks(B * T * H, ROWS_PER_BLOCK), BLOCK, delta.ptr, dout.ptr, out.ptr, B * T * H, T, H, D)
    rt = runtime()
    pointer, _ = rt.module(source.module, source.directory).get_global("flash_attention_atomic_dq_shared")
    shared = np.empty(2, dtype=np.int32)
    rt.drv.memcpy_dtoh(shared, pointer)
    dkdv = flash_config(source, D, "dkdv")
    kernel(source.module, f"flash_attention_backward_dkdv_atomic_dq_d{D}", "PPPPPPPPiii", source.directory)(
        (KV, B, math.ceil(T / dkdv.rows)), dkdv.threads, dqkv.ptr, dout.ptr, qkv.ptr, lse.ptr, delta.ptr, cos_ptr,
        sin_ptr, dq_accum.ptr, T, H, KV, shared=int(shared[{64: 0, 128: 1}[D]]))
    kernel(source.module, "flash_attention_backward_dq_convert", "PPPPiiiii", source.directory)(
        blocks(B * T * H * D // 2), BLOCK, dqkv.ptr, dq_accum.ptr, cos_ptr, sin_ptr, B, T, H, KV, D)


def has_nondeterministic_backward(source: FlashSource) -> bool:
    """Whether a build carries an opt-in nondeterministic backward to measure determinism against: the fused-dQ
    builds, and the ladder's v1 (its atomic-dQ kernels)."""
    return source.fused_dq or source.module == ATOMIC_DQ_MODULE


class FlashAttentionProblem:
    """One attention problem on the device, with random bf16 qkv and dout and every output buffer: what
    the ladder's runner (dev/cuda/flash_attention.py), the tests and scripts/bench_attention.py run each build on."""

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

    def scratch(self, source: FlashSource) -> DeviceArray:
        """The backward's scratch for this build (delta; and the fp32 dQ tiles where it fuses dQ)."""
        if source.fused_dq not in self._scratch:
            B, T, H, _, D = self.shape
            self._scratch[source.fused_dq] = empty((flash_attention_scratch_size(B, T, H, D, source),))
        return self._scratch[source.fused_dq]

    def forward(self, source: FlashSource) -> None:
        flash_attention_forward(self.out, self.lse, self.qkv, *self.shape[2:4], source=source)

    def backward(self, source: FlashSource, deterministic: bool = True) -> None:
        flash_attention_backward(self.dqkv, self.scratch(source), self.dout, self.out, self.lse, self.qkv,
                                 *self.shape[2:4], source=source, deterministic=deterministic)

    def backward_nondeterministic(self, source: FlashSource) -> None:
        """The build's opt-in nondeterministic backward (has_nondeterministic_backward): v1's atomic dQ, or a
        fused-dQ build's unordered adds."""
        if source.fused_dq:
            self.backward(source, deterministic=False)
            return
        flash_attention_backward_atomic_dq(self.dqkv, self.scratch(source), self.dq_accum, self.dout, self.out,
                                           self.lse, self.qkv, *self.shape[2:4], source=source)
