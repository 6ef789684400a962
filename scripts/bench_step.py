"""One training step, ours against PyTorch, in one process on the GPU.

Ours: the GPU model's train_step (llama.model.gpu_bf16.GPUModelBF16, or GPUModelFP32 with --dtype fp32:
forward, backward, clip, AdamW, CUDA graphs; the loss and norm are read once per step). PyTorch: the same
architecture in scripts/torch_llama.py (RMSNorm, RoPE, SDPA with GQA, SwiGLU, the head tied where the
preset ties it), bf16 autocast over fp32 weights (fp32: none), fused AdamW, global-norm clipping,
torch.compile. It prints the GPU's name and clocks, then for each config ms/step, tok/s and peak device
memory (torch: max_memory_allocated; ours: what our allocations hold), the ratios, and a per-kernel
breakdown of one eager step of ours (CUDA events around every launcher call).

    python3 scripts/bench_step.py [--configs d12 llama3.2-1b] [--dtype bf16] [--steps 12] [--json out.json]
"""

import argparse
import json
import subprocess
from collections import defaultdict

import numpy as np

from llama import ops
from llama.config import get_preset
from llama.cuda import allocated_bytes, runtime, time_ms
from llama.optim import AdamWConfig

CONFIGS = {"d12": (16, 1024), "llama3.2-1b": (8, 2048)}  # preset: (B, T)
VOCAB = 128256


def bench_ours(c, B, T, steps, dtype):
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.model.gpu_fp32 import GPUModelFP32
    before = allocated_bytes()
    model = (GPUModelBF16 if dtype == "bf16" else GPUModelFP32)(c, B, T)
    rng = np.random.default_rng(0)
    batches = [[(rng.integers(0, c.vocab_size, (B, T)), rng.integers(0, c.vocab_size, (B, T)))] for _ in range(4)]
    opt, done = AdamWConfig(), [0]

    def step():
        done[0] += 1
        model.train_step(batches[done[0] % 4], 1e-4, done[0], opt)

    for _ in range(3):  # the first step compiles and captures
        step()
    ms = time_ms(step, warmup=0, repeats=steps, inner=1)
    peak = allocated_bytes() - before
    breakdown = kernel_breakdown(model, batches[0], opt)
    del model
    return ms, peak, breakdown


def kernel_breakdown(model, batches, opt) -> dict:
    """Milliseconds per launcher (GEMMs per layout) over one eager step, from CUDA events."""
    drv, stream = runtime().drv, runtime().stream
    names = ["gemm", "flash_attention_forward", "flash_attention_backward", "rmsnorm_residual_forward_bf16",
             "rmsnorm_forward_bf16", "rmsnorm_backward_bf16", "swiglu_forward_bf16", "swiglu_backward_bf16",
             "embedding_forward_bf16", "embedding_backward_bf16", "fused_classifier_bf16", "loss_accumulate_bf16",
             "global_norm_squared_bf16", "adamw_update_bf16",  # the fp32 model's launchers:
             "matmul_forward", "matmul_backward", "attention_forward", "attention_backward", "rope_forward",
             "rope_backward", "residual_forward", "rmsnorm_forward", "rmsnorm_backward", "swiglu_forward",
             "swiglu_backward", "embedding_forward", "embedding_backward", "sort_tokens", "fused_classifier",
             "global_norm_squared", "adamw_update"]
    originals, events = {name: getattr(ops, name) for name in names}, []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            label = name
            if name == "gemm":
                label = "gemm " + ("dW (tn)" if kwargs.get("trans_a") else "fwd (nt)" if kwargs.get("trans_b") else "dX (nn)")
            start, end = drv.Event(), drv.Event()
            start.record(stream)
            fn(*args, **kwargs)
            end.record(stream)
            events.append((label, start, end))
        return wrapper

    for name in names:
        setattr(ops, name, timed(name, originals[name]))
    try:
        from llama.model.gpu_bf16 import GPUModelBF16
        if isinstance(model, GPUModelBF16):  # its step replays CUDA graphs: run its launches eagerly
            model.zero_grad()
            model.loss_total.fill_zero()
            for i, (tokens, targets) in enumerate(batches):
                model._upload(tokens, targets)
                model.shape = tokens.shape
                model._micro_step(len(batches), i == len(batches) - 1)
            model._set_scalars(1e-4, 1, opt)
            model._optimizer(opt)
        else:  # the fp32 model's step is eager
            model.train_step(batches, 1e-4, 1, opt)
        runtime().synchronize()
    finally:
        for name in names:
            setattr(ops, name, originals[name])
    totals = defaultdict(float)
    for label, start, end in events:
        totals[label] += end.time_since(start)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def gpu_line() -> str:
    """The GPU's name, its SM clock now and at most, and its memory clock (nvidia-smi where there is one)."""
    line = f"device: {runtime().name}"
    try:
        fields = "clocks.sm,clocks.max.sm,clocks.mem"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i",
                              str(runtime().device.pci_bus_id())], capture_output=True, text=True, timeout=10)
        sm, sm_max, mem = out.stdout.strip().splitlines()[0].split(", ")
        return f"{line}; SM clock {sm} MHz (max {sm_max}), memory clock {mem} MHz"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        attribute = runtime().drv.device_attribute
        return (f"{line}; SM clock max {runtime().device.get_attribute(attribute.CLOCK_RATE) // 1000} MHz, "
                f"memory clock {runtime().device.get_attribute(attribute.MEMORY_CLOCK_RATE) // 1000} MHz")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the models' precision")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    from torch_llama import bench_torch  # after the arguments: --help works without torch
    runtime()  # our context first (the primary one, which torch shares)
    print(gpu_line())
    results = {}
    for name in args.configs:
        B, T = CONFIGS[name]
        c = get_preset(name).replace(vocab_size=VOCAB)
        ours_ms, ours_peak, breakdown = bench_ours(c, B, T, args.steps, args.dtype)
        torch_ms, torch_peak = bench_torch(c, B, T, args.steps, args.dtype)
        results[name] = {"B": B, "T": T, "ours_ms": ours_ms, "torch_ms": torch_ms, "ours_bytes": ours_peak,
                         "torch_bytes": torch_peak, "breakdown_ms": breakdown}
        print(f"\n{name} (B{B} x T{T}): per-kernel breakdown of one eager step of ours, ms")
        for label, ms in breakdown.items():
            print(f"  {label:<28}{ms:8.2f}")
    print(f"\n{gpu_line()}\nours = {args.dtype} kernels + CUDA graphs; torch = "
          f"{'bf16 autocast' if args.dtype == 'bf16' else 'fp32'} + torch.compile + fused AdamW")
    print(f"{'config':<14}{'ours ms':>9}{'torch ms':>10}{'ours tok/s':>12}{'torch tok/s':>13}{'speed':>7}"
          f"{'ours GB':>9}{'torch GB':>10}{'memory':>8}")
    for name, r in results.items():
        tokens = r["B"] * r["T"]
        print(f"{name:<14}{r['ours_ms']:>9.1f}{r['torch_ms']:>10.1f}{tokens / r['ours_ms'] * 1e3:>12,.0f}"
              f"{tokens / r['torch_ms'] * 1e3:>13,.0f}{r['torch_ms'] / r['ours_ms']:>7.2f}"
              f"{r['ours_bytes'] / 1e9:>9.1f}{r['torch_bytes'] / 1e9:>10.1f}{r['ours_bytes'] / r['torch_bytes']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
