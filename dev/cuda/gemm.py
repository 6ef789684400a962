"""Run any version of the bf16 GEMM ladder on one problem: check it against the float64 product of
the same bf16-rounded inputs, then time it next to torch.matmul (cuBLAS) in the same process. With
--dtype fp8 the FP8 rung (versions 5 and 6 on e4m3 operands with row-wise scales, layout nt): checked
against the float64 product of the dequantized casts, timed next to torch._scaled_mm (cuBLASLt).

    python3 dev/cuda/gemm.py --versions mma wgmma --layout nt --M 16384 --N 768 --K 768
    python3 dev/cuda/gemm.py --versions wgmma5 wgmma8 wgmma6 wgmma7 --layout tn --M 768 --N 768 --K 16384
    python3 dev/cuda/gemm.py --dtype fp8 --versions wgmma5 wgmma6 --M 8192 --N 8192 --K 8192

Versions are every rung of the ladder (dev/cuda/gemm_ladder.py's VERSIONS: production's, which llama/run/plan.py
picks from, and the rungs kept here).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dev.cuda.gemm_ladder import FP8_VERSIONS, VERSIONS  # noqa: E402
from llama import ops  # noqa: E402
from llama.runtime.cuda import BF16, empty, time_ms, to_device  # noqa: E402
from llama.twins.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", nargs="+", default=["mma", "wgmma"], choices=list(VERSIONS))
    parser.add_argument("--layout", choices=("nt", "nn", "tn"), default="nt")
    parser.add_argument("--M", type=int, default=4096)
    parser.add_argument("--N", type=int, default=4096)
    parser.add_argument("--K", type=int, default=4096)
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    args = parser.parse_args()
    if args.dtype == "fp8":
        return fp8(args)
    M, N, K, layout = args.M, args.N, args.K, args.layout
    rng = np.random.default_rng()
    a = rng.standard_normal((K, M) if layout == "tn" else (M, K)).astype(BF16)
    b = rng.standard_normal((N, K) if layout == "nt" else (K, N)).astype(BF16)
    opa = a.astype(np.float64).T if layout == "tn" else a.astype(np.float64)
    opb = b.astype(np.float64).T if layout == "nt" else b.astype(np.float64)
    ref = opa @ opb
    a_dev, b_dev, c = to_device(a), to_device(b), empty((M, N))
    flops = 2 * M * N * K
    print(f"{layout} M={M} N={N} K={K}: fp32 output, ||out - ref|| / ||ref|| and TFLOP/s")
    check_and_time(args.versions, c, ref, flops, lambda version: ops.gemm(
        c, a_dev, b_dev, trans_a=layout == "tn", trans_b=layout == "nt", version=version, versions=VERSIONS))
    try:
        import torch
    except ImportError:
        return 0
    ta, tb = torch.randn(a.shape, device="cuda", dtype=torch.bfloat16), torch.randn(b.shape, device="cuda", dtype=torch.bfloat16)
    cublas = lambda: torch.matmul(ta.t() if layout == "tn" else ta, tb.t() if layout == "nt" else tb)  # noqa: E731
    print(f"  {'cuBLAS':<8} {'':14} {flops / time_ms(cublas) / 1e9:7.1f} TFLOP/s (torch.matmul, bf16 output)")
    return 0


def check_and_time(versions, c, ref, flops, launch) -> None:
    """Each version's error against ref (c poisoned first) and its TFLOP/s; launch(version) runs it into c."""
    for version in versions:
        c.upload(np.full(c.shape, np.nan, np.float32))
        launch(version)
        err = np.linalg.norm(c.download() - ref) / np.linalg.norm(ref)
        print(f"  {version:<8} error {err:.2e}  {flops / time_ms(lambda: launch(version)) / 1e9:7.1f} TFLOP/s")


def fp8(args) -> int:
    """The FP8 rung: (M, K) x (N, K) e4m3 operands with a scale per row, fp32 output."""
    M, N, K = args.M, args.N, args.K
    rng = np.random.default_rng()
    (a, sa), (b, sb) = (quantize_fp8(rng.standard_normal((rows, K)).astype(np.float32)) for rows in (M, N))
    ref = dequantize_fp8(a, sa).astype(np.float64) @ dequantize_fp8(b, sb).astype(np.float64).T
    a_dev, sa_dev, b_dev, sb_dev, c = to_device(a), to_device(sa), to_device(b), to_device(sb), empty((M, N))
    flops = 2 * M * N * K
    print(f"fp8 nt M={M} N={N} K={K}: fp32 output, ||out - ref|| / ||ref|| and TFLOP/s")
    check_and_time(args.versions, c, ref, flops, lambda version: ops.gemm_fp8(c, a_dev, sa_dev, b_dev, sb_dev,
                                                                              version=version, versions=FP8_VERSIONS))
    try:
        import torch
    except ImportError:
        return 0
    ta, tb = (torch.randn((rows, K), device="cuda").to(torch.float8_e4m3fn) for rows in (M, N))
    ts_a, ts_b = torch.ones((M, 1), device="cuda"), torch.ones((1, N), device="cuda")
    cublas = lambda: torch._scaled_mm(ta, tb.t(), scale_a=ts_a, scale_b=ts_b, out_dtype=torch.bfloat16)  # noqa: E731
    print(f"  {'cuBLASLt':<8} {'':14} {flops / time_ms(cublas) / 1e9:7.1f} TFLOP/s (torch._scaled_mm, row-wise "
          "scales, bf16 output)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
