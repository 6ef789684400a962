"""Runner of the flash attention ladder (dev/cuda/flash_attention_v<N>.cu), as llm.c's dev/cuda:
compile versions, check each against the float64 reference on random inputs, time them side by side.

    python dev/cuda/flash_attention.py --versions 1 2 [--B 8 --H 32 --KV 8 --T 2048 --D 64] [--repeats 20]

Checks forward (out, lse) and backward (dq, dk, dv; for v1 also its atomic-dQ variant) at a small shape
first (--check-T), then times forward, backward (and v1's atomic-dQ backward) with CUDA events (torch's
when torch is importable) at the given shape. FLOPs: forward 2*B*H*T^2*D (causal), backward 2.5x that.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llama import ops  # noqa: E402
from llama.model import reference as ref  # noqa: E402
from llama.cuda import BF16, empty, runtime, to_device  # noqa: E402
from llama.cuda import time_ms as cuda_time_ms  # noqa: E402

DEV_DIR = Path(__file__).resolve().parent


ATOMIC_DQ_VERSION = 1  # the ladder version that carries the dev-only atomic-dQ backward


def source(version: int) -> ops.FlashSource:
    return ops.FlashSource(module=f"flash_attention_v{version}", directory=DEV_DIR)


def backward_atomic_dq(src: ops.FlashSource, dqkv, delta, dq_accum, dout, out, lse, qkv, n_heads: int,
                       n_kv_heads: int, cos=None, sin=None) -> None:
    """The NONDETERMINISTIC backward (dev only): dQ added by fp32 atomics inside the dK/dV kernel, into
    dq_accum (B, T, H, D) float32, then converted. Same arguments and result as ops.flash_attention_backward."""
    B, T, H, KV, D = ops._flash_shapes(qkv, n_heads, n_kv_heads)
    ops._check("dq_accum", dq_accum, (B, T, H, D))
    dq_accum.fill_zero()
    cos_ptr, sin_ptr = (0, 0) if cos is None else (cos.ptr, sin.ptr)
    ops._kernel(src.module, "flash_attention_backward_delta", "PPPiiii", src.directory)(
        ops._blocks(B * T * H, ops.ROWS_PER_BLOCK), ops.BLOCK, delta.ptr, dout.ptr, out.ptr, B * T * H, T, H, D)
    rt = runtime()
    pointer, _ = rt.module(src.module, src.directory).get_global("flash_attention_atomic_dq_shared")
    shared = np.empty(2, dtype=np.int32)
    rt.drv.memcpy_dtoh(shared, pointer)
    dkdv = ops._flash_config(src, D, "dkdv")
    ops._kernel(src.module, f"flash_attention_backward_dkdv_atomic_dq_d{D}", "PPPPPPPPiii", src.directory)(
        (KV, B, -(-T // dkdv.rows)), dkdv.threads, dqkv.ptr, dout.ptr, qkv.ptr, lse.ptr, delta.ptr, cos_ptr, sin_ptr,
        dq_accum.ptr, T, H, KV, shared=int(shared[{64: 0, 128: 1}[D]]))
    ops._kernel(src.module, "flash_attention_backward_dq_convert", "PPPPiiiii", src.directory)(
        ops._blocks(B * T * H * D // 2), ops.BLOCK, dqkv.ptr, dq_accum.ptr, cos_ptr, sin_ptr, B, T, H, KV, D)


class Buffers:
    """Device buffers of one shape, with random bf16 qkv and dout."""

    def __init__(self, B: int, T: int, H: int, KV: int, D: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.shape = (B, T, H, KV, D)
        self.qkv_host = rng.standard_normal((B, T, (H + 2 * KV) * D)).astype(BF16)
        self.dout_host = rng.standard_normal((B, T, H * D)).astype(BF16)
        self.qkv, self.dout = to_device(self.qkv_host), to_device(self.dout_host)
        self.out, self.dqkv = empty((B, T, H * D), BF16), empty(self.qkv.shape, BF16)
        self.lse, self.delta = empty((B, H, T)), empty((B, H, T))
        self.dq_accum = empty((B, T, H, D))

    def forward(self, src):
        ops.flash_attention_forward(self.out, self.lse, self.qkv, *self.shape[2:4], source=src)

    def backward(self, src):
        ops.flash_attention_backward(self.dqkv, self.delta, self.dout, self.out, self.lse, self.qkv,
                                     *self.shape[2:4], source=src)

    def backward_atomic(self, src):
        backward_atomic_dq(src, self.dqkv, self.delta, self.dq_accum, self.dout, self.out, self.lse, self.qkv,
                           *self.shape[2:4])


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - expected) / np.linalg.norm(expected))


def check(version: int, B: int, T: int, H: int, KV: int, D: int) -> dict[str, float]:
    """||out - ref|| / ||ref|| of every output against the float64 reference of the same bf16 inputs."""
    src, buf = source(version), Buffers(B, T, H, KV, D, seed=1)
    qkv, dout = buf.qkv_host.astype(np.float64), buf.dout_host.astype(np.float64)
    ref_out, ref_lse = ref.flash_attention_forward(qkv, H, KV)
    expected = ref.flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV)
    buf.forward(src)
    errors = {"out": relative_error(buf.out.download(), ref_out), "lse": relative_error(buf.lse.download(), ref_lse)}
    parts = {"dq": slice(0, H * D), "dk": slice(H * D, (H + KV) * D), "dv": slice((H + KV) * D, None)}
    runs = [("", buf.backward)] + [("atomic ", buf.backward_atomic)] * (version == ATOMIC_DQ_VERSION)
    for name, run in runs:
        run(src)
        dqkv = buf.dqkv.download()
        for part, cols in parts.items():
            errors[name + part] = relative_error(dqkv[..., cols], expected[..., cols])
    return errors


def time_ms(fn, repeats: int = 20) -> float:
    """Median milliseconds of one fn() between CUDA events (llama.cuda.time_ms, one call per sample)."""
    return cuda_time_ms(fn, repeats=repeats, inner=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, nargs="+", default=[1, 2])
    for name, default in (("B", 8), ("H", 32), ("KV", 8), ("T", 2048), ("D", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--check-T", type=int, default=1000,
                        help="T of the correctness check (B=2, H/KV query heads sharing one kv head)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    B, H, KV, T, D = args.B, args.H, args.KV, args.T, args.D
    if H % KV:
        sys.exit(f"{H} query heads cannot share {KV} kv heads")
    print(f"flash attention ladder on {runtime().name}")
    for version in args.versions:
        errors = check(version, 2, args.check_T, H // KV, 1, D)
        print(f"v{version} check B=2 T={args.check_T} H={H // KV} KV=1 D={D}: " +
              ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        if max(errors.values()) > 1e-2:
            sys.exit(f"FAILED: v{version} relative error above 1e-2")

    buf, flops = Buffers(B, T, H, KV, D), 2 * B * H * T * T * D
    print(f"B={B} H={H} KV={KV} T={T} D={D}: ms (TFLOP/s)")
    print(f"{'version':<9}{'forward':>17}{'backward':>17}{'forward+backward':>19}")
    for version in args.versions:
        src = source(version)
        forward = time_ms(lambda: buf.forward(src), args.repeats)
        backward = time_ms(lambda: buf.backward(src), args.repeats)
        print(f"v{version:<8}{forward:9.3f} ({flops / forward / 1e9:4.0f}){backward:9.3f} "
              f"({2.5 * flops / backward / 1e9:4.0f}){forward + backward:11.3f} "
              f"({3.5 * flops / (forward + backward) / 1e9:4.0f})")
        if version == ATOMIC_DQ_VERSION:
            atomic = time_ms(lambda: buf.backward_atomic(src), args.repeats)
            print(f"  v{version} backward with atomic dQ (nondeterministic): {atomic:.3f} ms "
                  f"({2.5 * flops / atomic / 1e9:.0f}); determinism costs {backward / atomic - 1:+.0%}")


if __name__ == "__main__":
    main()
