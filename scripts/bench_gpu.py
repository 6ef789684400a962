"""GPU timings, each against a PyTorch reference measured in the same run:
  1. our fp32 matmul vs torch.matmul (fp32, TF32 off) on the model's projection shapes;
  2. one training step (forward, backward, AdamW) of a preset vs the same model as
     transformers.LlamaForCausalLM in fp32 (TF32 off, SDPA attention, fused AdamW).

    python3 scripts/bench_gpu.py [--preset d12] [--B 8] [--T 1024] [--steps 5] [--json out.json]
"""

import argparse
import json
import statistics

import numpy as np

from llama import ops
from llama.runtime.cli import require
from llama.config import get_preset
from llama.runtime.cuda import empty, runtime, time_ms, to_device
from llama.model.gpu_fp32 import GPUModelFP32
from llama.options import RunOptions
from llama.run.plan import make_plan
from llama.optim import AdamWConfig
from llama.params import count_parameters


def bench_matmuls(config, M: int) -> list[dict]:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    c, d = config, config.head_dim
    shapes = {"qkv": ((c.n_heads + 2 * c.n_kv_heads) * d, c.dim), "attn out": (c.dim, c.n_heads * d),
              "gate+up": (2 * c.ffn_hidden_dim, c.dim), "down": (c.dim, c.ffn_hidden_dim),
              "head": (c.vocab_size, c.dim)}
    rows = []
    for name, (N, K) in shapes.items():
        rng = np.random.default_rng(0)
        x, w = to_device(rng.standard_normal((M, K), dtype=np.float32)), to_device(rng.standard_normal((N, K), dtype=np.float32))
        out = empty((M, N))
        ours = time_ms(lambda: ops.matmul_forward(out, x, w), warmup=1, repeats=10, inner=1)
        tx, tw = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
        theirs = time_ms(lambda: torch.matmul(tx, tw.T), warmup=1, repeats=10, inner=1)
        flops = 2 * M * N * K
        rows.append({"shape": f"{name} ({M},{N},{K})", "ours_ms": ours, "torch_ms": theirs,
                     "ours_tflops": flops / ours / 1e9, "torch_tflops": flops / theirs / 1e9})
        del x, w, out, tx, tw
    return rows


def bench_our_step(config, B: int, T: int, steps: int) -> dict:
    model = GPUModelFP32(config, make_plan(config, RunOptions("cuda", "fp32")), (B, T), seed=0)
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))
    opt = AdamWConfig()
    drv = runtime().drv
    parts, losses = [], []

    def step():
        events = [drv.Event() for _ in range(4)]
        events[0].record()
        model.zero_grad()
        model.forward(tokens, targets, return_loss=False)
        events[1].record()
        model.backward()
        events[2].record()
        model.optimizer_step(1e-4, len(parts) + 1, opt, return_norm=False)
        events[3].record()
        losses.append(float(np.mean(model.buffers["losses"].download())))  # the step's one sync
        parts.append([events[i].time_till(events[i + 1]) for i in range(3)])

    ms = time_ms(step, warmup=2, repeats=steps, inner=1)  # the warm-up compiles
    parts = parts[2:]
    del model
    return {"ms": ms, "forward_ms": statistics.median(p[0] for p in parts),
            "backward_ms": statistics.median(p[1] for p in parts), "adamw_ms": statistics.median(p[2] for p in parts),
            "last_loss": losses[-1]}


def bench_torch_step(config, B: int, T: int, steps: int) -> dict:
    import torch
    import transformers
    from llama.io.hf import transformers_config
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = transformers.LlamaForCausalLM(transformers_config(config, "sdpa")).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, config.vocab_size, (B, T), device="cuda")
    targets = torch.randint(0, config.vocab_size, (B, T), device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, config.vocab_size), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss.item()

    ms = time_ms(step, warmup=2, repeats=steps, inner=1)
    del model, optimizer
    torch.cuda.empty_cache()
    return {"ms": ms}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="d12")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-torch-step", action="store_true")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    require("scripts/bench_gpu.py", ("torch",), gpu=True)
    config = get_preset(args.preset).replace(vocab_size=args.vocab)
    rt = runtime()
    tokens = args.B * args.T
    report = {"device": rt.name, "preset": args.preset, "B": args.B, "T": args.T,
              "params": count_parameters(config), "matmul": bench_matmuls(config, tokens),
              "ours": bench_our_step(config, args.B, args.T, args.steps)}
    if not args.skip_torch_step:
        report["torch"] = bench_torch_step(config, args.B, args.T, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)

    print(f"\n{rt.name}: {args.preset}, {report['params'] / 1e6:.1f}M params, B={args.B} T={args.T}")
    print(f"{'matmul (M,N,K)':<34}{'ours TFLOP/s':>14}{'torch fp32':>12}{'ratio':>8}")
    for row in report["matmul"]:
        print(f"{row['shape']:<34}{row['ours_tflops']:>14.1f}{row['torch_tflops']:>12.1f}"
              f"{row['ours_tflops'] / row['torch_tflops']:>8.2f}")
    ours = report["ours"]
    print(f"our step: {ours['ms']:.1f} ms ({tokens / ours['ms'] * 1000:,.0f} tok/s); forward {ours['forward_ms']:.1f}, "
          f"backward {ours['backward_ms']:.1f}, adamw {ours['adamw_ms']:.1f} ms")
    if "torch" in report:
        t = report["torch"]["ms"]
        print(f"torch fp32 step: {t:.1f} ms ({tokens / t * 1000:,.0f} tok/s); ours / torch time = {ours['ms'] / t:.2f}")


if __name__ == "__main__":
    main()
