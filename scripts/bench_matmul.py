"""GEMM benchmark: our kernels against torch.matmul (cuBLAS) in bf16, or with --dtype fp8 against
torch._scaled_mm (cuBLASLt) with row-wise scales, measured in the same run.

For each projection of d12 (dim 768) and llama3.2-1b (dim 2048) at 16,384 tokens, in the three
layouts a training step runs (forward y = x @ W^T, dX = dY @ W, dW += dY^T @ x), plus 8192^3,
it prints TFLOP/s of every GEMM version the device runs, cuBLAS's, their ratios, the worst ratio and the
geometric mean of the ratios per version. Timing: CUDA
events, median of many batches after warm-up, on random data, rotating input buffers so that L2
does not flatter small shapes; with --graph, each side's launches are captured in a CUDA graph (ours through
llama.runtime.cuda.Graph, cuBLAS's through torch.cuda.graph) and the replays timed, so that host launch overhead is out
of both numbers (device time only). Our dW accumulates into fp32 (as training does); the others store bf16.
FP8: every GEMM runs with both operands K-major (dX and dW on the transposed copies the casts write), e4m3
with one fp32 scale per row of each operand; _scaled_mm's outputs are bf16 (what it takes with row-wise
scales), our dW still accumulates into fp32. The versions are the whole ladder's, production's and the rungs the
plan does not pick (imported from dev/cuda/gemm_ladder.py, where they live), so that every rung is timed next to
cuBLAS and to the production choice in one run.

    python3 scripts/bench_matmul.py [--json out.json] [--versions mma wgmma wgmma3 wgmma4 wgmma5 wgmma6 wgmma7 wgmma8]
    python3 scripts/bench_matmul.py --dtype fp8 [--versions wgmma5 wgmma6 auto]
    python3 scripts/bench_matmul.py --graph --versions auto [--presets d12 llama3.2-1b llama3.1-8b]
"""

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the ladder's rungs, dev/cuda
from dev.cuda.gemm_ladder import FP8_VERSIONS, VERSIONS  # noqa: E402
from llama import ops  # noqa: E402
from llama.runtime.cli import require  # noqa: E402
from llama.config import get_preset  # noqa: E402
from llama.runtime.cuda import BF16, FP8, DeviceArray, Graph, runtime, time_ms  # noqa: E402
from llama.run.plan import gemm_chooser  # noqa: E402

TOKENS = 16384
L2_FLUSH_BYTES = 256 << 20  # rotate input sets until they span this much
GRAPH_LAUNCHES = 16  # launches captured in one graph with --graph (the input sets rotate inside it)


def projections(preset: str) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one layer's matmuls and the head."""
    c = get_preset(preset)
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    return [("qkv", qkv, c.dim), ("attn-out", c.dim, c.n_heads * c.head_dim), ("gate+up", 2 * c.ffn_hidden_dim, c.dim),
            ("down", c.dim, c.ffn_hidden_dim), ("head", c.vocab_size, c.dim)]


def problems(presets=("d12", "llama3.2-1b")):
    """(label, layout, M, N, K) of every benchmarked GEMM."""
    rows = [("8192^3", "nt", 8192, 8192, 8192)]
    for preset in presets:
        dim = get_preset(preset).dim
        for name, out_f, in_f in projections(preset):
            rows.append((f"d{dim} {name} fwd", "nt", TOKENS, out_f, in_f))
            rows.append((f"d{dim} {name} dX", "nn", TOKENS, in_f, out_f))
            rows.append((f"d{dim} {name} dW", "tn", out_f, in_f, TOKENS))
    return rows


def device_ms(fn, graph: bool, torch_launches: bool = False) -> float:
    """Device milliseconds of one fn() call: time_ms on eager calls, or with graph=True the replay of a CUDA
    graph of GRAPH_LAUNCHES calls, captured by torch (torch_launches: cuBLAS) or by llama.runtime.cuda.Graph (ours)."""
    if not graph:
        return time_ms(fn)
    import torch

    for _ in range(GRAPH_LAUNCHES):  # what the launches allocate on first use (TMA maps per input set) exists
        fn()                         # before the capture
    torch.cuda.synchronize()
    if torch_launches:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(GRAPH_LAUNCHES):
                fn()
    else:
        captured = Graph(lambda: [fn() for _ in range(GRAPH_LAUNCHES)])
    return time_ms(captured.replay, inner=1) / GRAPH_LAUNCHES


def as_device(t) -> DeviceArray:
    """Our view of a torch tensor's memory (bf16, FP8 e4m3 or fp32), kept alive by the tensor."""
    dtype = {"torch.bfloat16": BF16, "torch.float8_e4m3fn": FP8}.get(str(t.dtype), np.dtype(np.float32))
    return DeviceArray(t.data_ptr(), tuple(t.shape), dtype, t)


def bench_fp8(layout, M, N, K, versions, graph=False):
    """bench's FP8 twin: the problem as the FP8 step runs it, (M, K) x (N, K) K-major, against _scaled_mm."""
    import torch

    per_set = M * K + N * K
    sets = max(1, min(8, math.ceil(L2_FLUSH_BYTES / per_set)))

    def operand(rows):  # values and per-row scales
        return torch.randn((rows, K), device="cuda").to(torch.float8_e4m3fn), torch.rand(rows, device="cuda") + 0.5
    inputs = [(operand(M), operand(N)) for _ in range(sets)]
    flops = 2 * M * N * K
    counter = iter(range(1 << 62))

    def cublas():
        (a, sa), (b, sb) = inputs[next(counter) % sets]
        torch._scaled_mm(a, b.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)

    result = {"cublas": flops / device_ms(cublas, graph, torch_launches=True) / 1e9}
    c_dev = as_device(torch.zeros((M, N), device="cuda", dtype=torch.float32 if layout == "tn" else torch.bfloat16))
    dev_inputs = [tuple(as_device(t) for t in (a, sa, b, sb)) for (a, sa), (b, sb) in inputs]
    for version in versions:
        def ours():
            a, sa, b, sb = dev_inputs[next(counter) % sets]
            ops.gemm_fp8(c_dev, a, sa, b, sb, accumulate=layout == "tn",
                         version=gemm_chooser(fp8=True) if version == "auto" else version, versions=FP8_VERSIONS)
        result[version] = flops / device_ms(ours, graph) / 1e9
    del inputs, dev_inputs
    torch.cuda.empty_cache()
    return result


def bench(layout, M, N, K, versions, graph=False):
    import torch  # here, so that --help works without torch

    a_shape = (K, M) if layout == "tn" else (M, K)
    b_shape = (N, K) if layout == "nt" else (K, N)
    per_set = 2 * (math.prod(a_shape) + math.prod(b_shape))
    sets = max(1, min(8, math.ceil(L2_FLUSH_BYTES / per_set)))
    inputs = [(torch.randn(a_shape, device="cuda", dtype=torch.bfloat16),
               torch.randn(b_shape, device="cuda", dtype=torch.bfloat16)) for _ in range(sets)]
    flops = 2 * M * N * K
    trans_a, trans_b = layout == "tn", layout == "nt"
    c_ours = torch.zeros((M, N), device="cuda", dtype=torch.float32 if layout == "tn" else torch.bfloat16)
    c_dev = as_device(c_ours)
    dev_inputs = [(as_device(a), as_device(b)) for a, b in inputs]
    counter = iter(range(1 << 62))

    def cublas():
        a, b = inputs[next(counter) % sets]
        torch.matmul(a.t() if trans_a else a, b.t() if trans_b else b)

    result = {"cublas": flops / device_ms(cublas, graph, torch_launches=True) / 1e9}
    for version in versions:
        def ours():
            a, b = dev_inputs[next(counter) % sets]
            ops.gemm(c_dev, a, b, trans_a=trans_a, trans_b=trans_b, accumulate=layout == "tn",
                     version=gemm_chooser() if version == "auto" else version, versions=VERSIONS)
        result[version] = flops / device_ms(ours, graph) / 1e9
    del inputs, dev_inputs
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the table here")
    parser.add_argument("--versions", nargs="+", default=None,
                        help="GEMM versions to time; 'auto' is the production choice of llama/run/plan.py "
                             "(default: all)")
    parser.add_argument("--only", default=None, help="only problems whose label contains this")
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                        help="operands: bf16 (against torch.matmul) or FP8 e4m3 with row-wise scales (sm_90, "
                             "against torch._scaled_mm)")
    parser.add_argument("--graph", action="store_true",
                        help="time each side's launches inside a captured CUDA graph (device time only)")
    parser.add_argument("--presets", nargs="+", default=["d12", "llama3.2-1b"],
                        help="models whose projections are benchmarked (llama3.1-8b adds d4096)")
    args = parser.parse_args()
    require("scripts/bench_matmul.py", ("torch",), gpu=True)
    hopper = runtime().device.compute_capability() == (9, 0)
    if args.dtype == "fp8" and not hopper:
        raise SystemExit("--dtype fp8: our FP8 GEMMs need sm_90a")
    all_versions = [*FP8_VERSIONS, "auto"] if args.dtype == "fp8" else [*VERSIONS, "auto"] if hopper else ["mma"]
    versions = args.versions or all_versions
    reference = "torch._scaled_mm" if args.dtype == "fp8" else "cuBLAS"
    print(f"device: {runtime().name}; TFLOP/s, {args.dtype} operands, fp32 accumulation; "
          f"ratio = ours / {reference}; {'inside CUDA graphs' if args.graph else 'eager launches'}")
    rows = []
    for label, layout, M, N, K in problems(args.presets):
        if args.only and args.only not in label:
            continue
        if args.dtype == "fp8":  # every GEMM as (M, K) x (N, K): dX's M, N, K are the forward's tokens, in, out
            r = bench_fp8(layout, M, N, K, versions, args.graph)
        else:
            r = bench(layout, M, N, K, versions, args.graph)
        rows.append({"problem": label, "layout": layout, "M": M, "N": N, "K": K, **r})
        print(f"  measured {label}: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()), flush=True)
    header = f"{'problem':<22}{'M x N x K':>22}{reference[-8:]:>9}" + "".join(f"{v:>9}{'ratio':>7}" for v in versions)
    print(header)
    for row in rows:
        line = f"{row['problem']:<22}{row['M']:>8}x{row['N']:>6}x{row['K']:>6}{row['cublas']:>9.0f}"
        line += "".join(f"{row[v]:>9.0f}{row[v] / row['cublas']:>7.2f}" for v in versions)
        print(line)
    worst = {v: min(row[v] / row["cublas"] for row in rows) for v in versions}
    print("worst ratio: " + ", ".join(f"{v} {w:.2f}" for v, w in worst.items()))
    mean = {v: math.exp(np.mean([math.log(row[v] / row["cublas"]) for row in rows])) for v in versions}
    print("geometric mean of the ratios: " + ", ".join(f"{v} {m:.2f}" for v, m in mean.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
