"""Runner of the flash attention ladder (dev/cuda/flash_attention_v<N>.cu), as llm.c's dev/cuda:
compile versions, check each against the float64 reference on random inputs, time them side by side.

    python dev/cuda/flash_attention.py --versions 1 2 3 4 5 6 [--B 8 --H 32 --KV 8 --T 2048 --D 64] [--repeats 20]
    ncu --kernel-name regex:"backward_dkdv|backward_dq_d" --launch-skip 2 --launch-count 2 \
        python dev/cuda/flash_attention.py --versions 6 --T 32768 --B 1 --profile

Checks forward (out, lse) and backward (dq, dk, dv; for v1 and v4 also their opt-in nondeterministic variant:
atomic dQ, unordered dQ adds) at a small shape first (--check-T), then times forward, backward (and the
nondeterministic backward) with CUDA events
(llama.runtime.cuda.time_ms) at the given shape. FLOPs: forward 2*B*H*T^2*D (causal), backward 2.5x that.
--profile instead runs each version's forward and backward twice at the shape, unchecked and untimed, for a
profiler: the second backward's kernels are the ones to look at (the first pays for loading the module).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dev.cuda.flash_attention_ladder import VERSIONS, Build, FlashAttentionProblem  # noqa: E402
from llama.runtime.cuda import runtime, time_ms  # noqa: E402
from llama.twins.flash_attention import flash_attention_backward, flash_attention_forward  # noqa: E402


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - expected) / np.linalg.norm(expected))


def check(version: int, B: int, T: int, H: int, KV: int, D: int) -> dict[str, float]:
    """||out - ref|| / ||ref|| of every output against the float64 reference of the same bf16 inputs."""
    build, buf = Build.rung(version), FlashAttentionProblem(B, T, H, KV, D, seed=1)
    qkv, dout = buf.qkv_host.astype(np.float64), buf.dout_host.astype(np.float64)
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV)
    expected = flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV)
    buf.forward(build)
    errors = {"out": relative_error(buf.out.download(), ref_out), "lse": relative_error(buf.lse.download(), ref_lse)}
    parts = {"dq": slice(0, H * D), "dk": slice(H * D, (H + KV) * D), "dv": slice((H + KV) * D, None)}
    runs = [("", buf.backward)] + [("nondet ", buf.backward_nondeterministic)] * build.nondeterministic_backward
    for name, run in runs:
        run(build)
        dqkv = buf.dqkv.download()
        for part, cols in parts.items():
            errors[name + part] = relative_error(dqkv[..., cols], expected[..., cols])
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, nargs="+", default=list(VERSIONS), choices=VERSIONS)
    for name, default in (("B", 8), ("H", 32), ("KV", 8), ("T", 2048), ("D", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--check-T", type=int, default=1000,
                        help="T of the correctness check (B=2, H/KV query heads sharing one kv head)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true",
                        help="forward and backward twice per version, unchecked and untimed (for ncu)")
    args = parser.parse_args()
    B, H, KV, T, D = args.B, args.H, args.KV, args.T, args.D
    if H % KV:
        sys.exit(f"{H} query heads cannot share {KV} kv heads")
    if args.profile:
        buf = FlashAttentionProblem(B, T, H, KV, D)
        for version in args.versions:
            for _ in range(2):
                buf.forward(Build.rung(version))
                buf.backward(Build.rung(version))
        runtime().stream.synchronize()
        return
    print(f"flash attention ladder on {runtime().name}")
    for version in args.versions:
        errors = check(version, 2, args.check_T, H // KV, 1, D)
        print(f"v{version} check B=2 T={args.check_T} H={H // KV} KV=1 D={D}: " +
              ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        if max(errors.values()) > 1e-2:
            sys.exit(f"FAILED: v{version} relative error above 1e-2")

    buf, flops = FlashAttentionProblem(B, T, H, KV, D), 2 * B * H * T * T * D
    print(f"B={B} H={H} KV={KV} T={T} D={D}: ms (TFLOP/s)")
    print(f"{'version':<9}{'forward':>17}{'backward':>17}{'forward+backward':>19}")
    for version in args.versions:
        build = Build.rung(version)
        forward = time_ms(lambda: buf.forward(build), repeats=args.repeats, inner=1)
        backward = time_ms(lambda: buf.backward(build), repeats=args.repeats, inner=1)
        print(f"v{version:<8}{forward:9.3f} ({flops / forward / 1e9:4.0f}){backward:9.3f} "
              f"({2.5 * flops / backward / 1e9:4.0f}){forward + backward:11.3f} "
              f"({3.5 * flops / (forward + backward) / 1e9:4.0f})")
        if build.nondeterministic_backward:
            nondet = time_ms(lambda: buf.backward_nondeterministic(build), repeats=args.repeats, inner=1)
            print(f"  v{version} nondeterministic backward: {nondet:.3f} ms "
                  f"({2.5 * flops / nondet / 1e9:.0f}); determinism costs {backward / nondet - 1:+.0%}")


if __name__ == "__main__":
    main()
