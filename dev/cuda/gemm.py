"""Run any version of the bf16 GEMM ladder on one problem: check it against the float64 product of
the same bf16-rounded inputs, then time it next to torch.matmul (cuBLAS) in the same process.

    python3 dev/cuda/gemm.py --versions mma wgmma --layout nt --M 16384 --N 768 --K 768

Versions are the launchers ops.gemm takes (llama/plan.py picks the production one).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from llama import ops  # noqa: E402
from llama.cuda import BF16, empty, time_ms, to_device  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", nargs="+", default=["mma", "wgmma"])
    parser.add_argument("--layout", choices=("nt", "nn", "tn"), default="nt")
    parser.add_argument("--M", type=int, default=4096)
    parser.add_argument("--N", type=int, default=4096)
    parser.add_argument("--K", type=int, default=4096)
    args = parser.parse_args()
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
    for version in args.versions:
        c.upload(np.full((M, N), np.nan, np.float32))
        run = lambda: ops.gemm(c, a_dev, b_dev, trans_a=layout == "tn", trans_b=layout == "nt", version=version)  # noqa: E731
        run()
        err = np.linalg.norm(c.download() - ref) / np.linalg.norm(ref)
        print(f"  {version:<8} error {err:.2e}  {flops / time_ms(run) / 1e9:7.1f} TFLOP/s")
    try:
        import torch
    except ImportError:
        return 0
    ta, tb = torch.randn(a.shape, device="cuda", dtype=torch.bfloat16), torch.randn(b.shape, device="cuda", dtype=torch.bfloat16)
    cublas = lambda: torch.matmul(ta.t() if layout == "tn" else ta, tb.t() if layout == "nt" else tb)  # noqa: E731
    print(f"  {'cuBLAS':<8} {'':14} {flops / time_ms(cublas) / 1e9:7.1f} TFLOP/s (torch.matmul, bf16 output)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
