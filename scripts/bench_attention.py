"""Causal GQA attention in bf16: our flash attention, each version of the ladder asked for (dev/cuda/
flash_attention_v<N>.cu, imported from dev/cuda/flash_attention_ladder.py, where the rungs live; v2 is
kernels/flash_attention.cu, v3 to v6 kernels/flash_attention_wgmma.cu with their forwards (v4 with dQ inside the
dK/dV kernel), Hopper only; production on Hopper is v6's row at D = 64 and v3's at 128), against
torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True), measured in the same run.

    python3 scripts/bench_attention.py [--versions 2 3 4] [--repeats 30] [--shapes 16,12,4,1024,64 ...]

TFLOP/s with FLOPs = 2*B*H*T^2*D forward (the causal half of 4*B*H*T^2*D), 2.5x that backward, 3.5x
forward+backward; median of --repeats runs between CUDA events, after warm-up. SDPA gets contiguous
(B, H, T, D) q, k, v made outside the timed region (ours reads the packed (B, T, (H + 2KV) * D)
projection in place). Memory: what each needs beyond its inputs: ours the bytes of out, lse, dqkv and the
backward's scratch (delta, and v4's fp32 dQ); torch the growth of torch.cuda.max_memory_allocated over the
inputs during forward+backward. For the versions that carry one (v1: dQ by fp32 atomics; v4: the dQ
partials added unordered), also times the opt-in nondeterministic backward against the deterministic one:
what determinism costs. Last, the
registers and local memory (spills) of each entry point of each version, as the driver reports them.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the ladder's module, dev/cuda
from dev.cuda.flash_attention_ladder import VERSIONS, Build, FlashAttentionProblem  # noqa: E402
from llama.runtime.cli import require  # noqa: E402
from llama.runtime.cuda import runtime, time_ms  # noqa: E402

SHAPES = [(16, 12, 4, 1024, 64), (8, 32, 8, 2048, 64), (2, 32, 8, 8192, 128), (1, 32, 8, 32768, 64)]
ENTRY_POINTS = {False: ("forward", "backward_dkdv", "backward_dq"),  # by Build.fused_dq
                True: ("forward", "backward_fused", "backward_dq_store")}


def bench_ours(buf, version, repeats):
    build = Build.rung(version)
    forward = time_ms(lambda: buf.forward(build), repeats=repeats, inner=1)
    backward = time_ms(lambda: buf.backward(build), repeats=repeats, inner=1)
    both = time_ms(lambda: (buf.forward(build), buf.backward(build)), repeats=repeats, inner=1)
    atomic = None
    if build.nondeterministic_backward:
        atomic = time_ms(lambda: buf.backward_nondeterministic(build), repeats=repeats, inner=1)
    extra = sum(a.nbytes for a in (buf.out, buf.lse, buf.scratch(build), buf.dqkv))
    return {"fwd_ms": forward, "fwdbwd_ms": both, "bwd_ms": backward, "bwd_atomic_ms": atomic, "memory": extra}


def bench_sdpa(B, H, KV, T, D, repeats):
    import torch
    import torch.nn.functional as F
    qkv = torch.randn(B, T, (H + 2 * KV) * D, device="cuda", dtype=torch.bfloat16)
    heads = qkv.view(B, T, H + 2 * KV, D).transpose(1, 2)
    q, k, v = (x.contiguous().requires_grad_() for x in (heads[:, :H], heads[:, H:H + KV], heads[:, H + KV:]))
    dout = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def forward_backward():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), dout)

    saved = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    fwd = time_ms(forward, repeats=repeats, inner=1)
    bwd = time_ms(lambda: torch.autograd.grad(saved, (q, k, v), dout, retain_graph=True), repeats=repeats, inner=1)
    both = time_ms(forward_backward, repeats=repeats, inner=1)
    del saved
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    forward_backward()
    torch.cuda.synchronize()
    memory = torch.cuda.max_memory_allocated() - before
    del qkv, heads, q, k, v, dout
    torch.cuda.empty_cache()
    return {"fwd_ms": fwd, "bwd_ms": bwd, "fwdbwd_ms": both, "memory": memory}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, nargs="+", default=[2, 3, 4], choices=VERSIONS,
                        help="ladder versions to time")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--shapes", nargs="*", default=None, help="B,H,KV,T,D each")
    args = parser.parse_args()
    require("scripts/bench_attention.py", ("torch",), gpu=True)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    print(f"device: {runtime().name}")
    rows = []
    for B, H, KV, T, D in shapes:
        flops = 2 * B * H * T * T * D
        buf = FlashAttentionProblem(B, T, H, KV, D)
        ours = {v: bench_ours(buf, v, args.repeats) for v in args.versions}
        del buf
        sdpa = bench_sdpa(B, H, KV, T, D, args.repeats)
        for name, r in [(f"v{v}", ours[v]) for v in args.versions] + [("sdpa", sdpa)]:
            row = {"shape": f"{B},{H},{KV},{T},{D}", "name": name, "fwd": flops / r["fwd_ms"] / 1e9,
                   "bwd": 2.5 * flops / r["bwd_ms"] / 1e9, "fb": 3.5 * flops / r["fwdbwd_ms"] / 1e9,
                   "sdpa_fwd": flops / sdpa["fwd_ms"] / 1e9, "sdpa_bwd": 2.5 * flops / sdpa["bwd_ms"] / 1e9,
                   "sdpa_fb": 3.5 * flops / sdpa["fwdbwd_ms"] / 1e9, "bwd_ms": r["bwd_ms"],
                   "bwd_atomic_ms": r.get("bwd_atomic_ms"), "mem": r["memory"] / 2**20}
            rows.append(row)
            print(row, flush=True)
    print("\nTFLOP/s (ratio = ours / SDPA); backward ms, and for v1 and v4 their opt-in nondeterministic backward "
          "and what determinism costs; MiB beyond the inputs")
    print(f"{'B,H,KV,T,D':<20}{'':<6}{'fwd':>7}{'ratio':>7}{'bwd':>7}{'ratio':>7}{'fwd+bwd':>9}{'ratio':>7}"
          f"{'bwd/fwd':>8}{'bwd ms':>9}{'nondet':>8}{'det cost':>9}{'mem':>8}")
    for r in rows:
        atomic = (f"{r['bwd_atomic_ms']:8.3f}{r['bwd_ms'] / r['bwd_atomic_ms'] - 1:+9.0%}"
                  if r["bwd_atomic_ms"] is not None else f"{'':17}")
        print(f"{r['shape']:<20}{r['name']:<6}{r['fwd']:7.0f}{r['fwd'] / r['sdpa_fwd']:7.2f}"
              f"{r['bwd']:7.0f}{r['bwd'] / r['sdpa_bwd']:7.2f}{r['fb']:9.0f}{r['fb'] / r['sdpa_fb']:7.2f}"
              f"{r['bwd'] / r['fwd']:8.2f}{r['bwd_ms']:9.3f}{atomic}{r['mem']:8.0f}")
    print("\nregisters per thread at launch / local memory bytes (spills) of each entry point")
    for version in args.versions:
        source = Build.rung(version).source
        for D in sorted({shape[4] for shape in shapes}):
            cells = []
            for entry in ENTRY_POINTS[Build.rung(version).fused_dq]:
                function = runtime().module(source.module, source.directory).get_function(
                    f"flash_attention_{entry}_d{D}")
                cells.append(f"{entry} {function.num_regs}/{function.local_size_bytes}")
            print(f"v{version} D={D}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
