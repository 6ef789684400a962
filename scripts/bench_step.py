"""One training step, ours against PyTorch, in one process on the GPU.

Ours: the GPU model's train_step (llama.model.gpu_bf16.GPUModelBF16, with FP8 linear layers under --dtype
fp8, or GPUModelFP32 with --dtype fp32: forward, backward, clip, AdamW, CUDA graphs; the loss and norm are
read once per step). PyTorch: the same architecture in scripts/torch_llama.py (RMSNorm, RoPE, SDPA with GQA,
SwiGLU, the head tied where the preset ties it), bf16 autocast over fp32 weights (fp32: none), fused AdamW,
global-norm clipping, torch.compile; with --dtype fp8 torch runs bf16, and again with torchao's float8
training (row-wise scales, the blocks' linear layers; torchao carried to the device as a wheel). It prints
the GPU's name and clocks, then for each config ms/step, tok/s and peak device memory (torch:
max_memory_allocated; ours: what our allocations hold), the ratios, and a per-kernel breakdown of one eager
step of ours (CUDA events around every launcher call, llama/runtime/timeline.py; --trace DIR writes that step as a
Chrome trace that chrome://tracing and Perfetto open).

    python3 scripts/bench_step.py [--configs d12 llama3.2-1b] [--dtype bf16] [--steps 12] [--json out.json]

Memory recipes, both sides alike: --recompute full (ours: each layer keeps its input; torch:
activation checkpointing of every block), --optimizer adamw8bit (ours: kernels/adamw.cu; torch: torchao's
AdamW8bit, carried to the device as a wheel). --runs PRESET:B:T sets the models and batches:

    python3 scripts/bench_step.py --runs llama3.1-8b:4:4096 --recompute full --optimizer adamw8bit
    python3 scripts/bench_step.py --runs llama3.2-1b:1:131072 --recompute full --no-torch --no-breakdown
"""

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np

from llama import ops
from llama.runtime.cli import require
from llama.config import get_preset
from llama.runtime.cuda import allocated_bytes, runtime, time_ms
from llama.run.memory import training_buffers
from llama.runtime.machine import gpu_free, size_text
from llama.optim import AdamWConfig
from llama.options import RunOptions
from llama.run.plan import make_plan
from llama.runtime.timeline import Timeline
from llama.run.trainer import matmul_flops_per_token

CONFIGS = {"d12": (16, 1024), "llama3.2-1b": (8, 2048)}  # preset: (B, T)
VOCAB = 128256


def bench_ours(c, B, T, steps, dtype, plan, breakdown=True, warmup=3):
    """Our ms per step, peak bytes, and the timeline of one eager step (None without breakdown)."""
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.model.gpu_fp32 import GPUModelFP32
    before = allocated_bytes()
    model = (GPUModelFP32 if dtype == "fp32" else GPUModelBF16)(c, plan, (B, T))
    rng = np.random.default_rng(0)
    batches = [[(rng.integers(0, c.vocab_size, (B, T)), rng.integers(0, c.vocab_size, (B, T)))] for _ in range(4)]
    opt, done = AdamWConfig(), [0]

    def step():  # as the trainer runs it: the next step's first micro-batch staged while this one runs
        done[0] += 1
        model.train_step(batches[done[0] % 4], 1e-4, done[0], opt, upcoming=batches[(done[0] + 1) % 4][0])

    for _ in range(warmup):  # the first step compiles and captures
        step()
    ms = time_ms(step, warmup=0, repeats=steps, inner=1)
    peak = allocated_bytes() - before
    timeline = kernel_breakdown(model, batches[0], opt) if breakdown else None
    del model
    return ms, peak, timeline


LAUNCHERS = ["gemm", "gemm_fp8", "cast_fp8", "flash_attention_forward", "flash_attention_backward",
             "rmsnorm_residual_forward_bf16", "rmsnorm_forward_bf16", "rmsnorm_backward_bf16", "swiglu_forward_bf16",
             "swiglu_backward_bf16", "embedding_forward_bf16", "embedding_backward_bf16", "fused_classifier_bf16",
             "loss_accumulate_bf16", "global_norm_squared_bf16", "adamw_update_bf16", "adamw8bit_update_bf16",
             # the adapters' and the NF4 base's (--lora, --qlora; scripts/bench_lora.py --breakdown):
             "lora_add_bf16", "lora_block_diagonal_bf16", "lora_take_blocks_f32", "nf4_dequantize_bf16",
             # the fp32 model's launchers:
             "matmul_forward", "matmul_backward", "attention_forward", "attention_backward", "rope_forward",
             "rope_backward", "residual_forward", "rmsnorm_forward", "rmsnorm_backward", "swiglu_forward",
             "swiglu_backward", "embedding_forward", "embedding_backward", "sort_tokens", "fused_classifier",
             "global_norm_squared", "adamw_update"]


def launch_label(name: str, args: tuple, kwargs: dict) -> str:
    """A launcher call's name in the breakdown: the GEMMs by what they compute, the collectives by size."""
    if name == "gemm":
        return "gemm " + ("dW (tn)" if kwargs.get("trans_a") else "fwd (nt)" if kwargs.get("trans_b") else "dX (nn)")
    if name == "gemm_fp8":
        return "gemm_fp8 " + ("dW" if kwargs.get("accumulate") else "fwd and dX")
    if name in ("reduce_scatter", "all_gather"):  # a Communicator's (out, x): by the whole buffer's size
        return f"{name} {max(args[0].nbytes, args[1].nbytes) / 1e6:,.0f} MB"
    return name


def kernel_breakdown(model, batches, opt) -> Timeline:
    """The timeline of one eager step (CUDA events around every launcher call): its totals are the
    milliseconds per launcher (GEMMs per layout), its chrome_trace() the step's spans."""
    timeline = Timeline(launch_label)
    with timeline.recording(ops, LAUNCHERS, comm=getattr(model, "comm", None)):
        from llama.model.gpu_bf16 import GPUModelBF16
        if isinstance(model, GPUModelBF16):  # its step replays CUDA graphs: run its launches eagerly
            model.eager_step(batches, 1e-4, 1, opt)
        else:  # the fp32 model's step is eager
            model.train_step(batches, 1e-4, 1, opt)
        runtime().synchronize()
    return timeline


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


HEADER = (f"{'run':<26}{'ours ms':>9}{'torch ms':>10}{'ours tok/s':>12}{'torch tok/s':>13}{'speed':>7}{'MFU':>6}"
          f"{'ours GB':>9}{'torch GB':>10}{'memory':>8}")


def table_row(key: str, r: dict) -> str:
    """One run's line of the table: - where a side did not run (or did not fit)."""
    def cell(x, width, form):
        return f"{x:>{width}{form}}" if x is not None else f"{'-':>{width}}"

    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    tokens = r["B"] * r["T"]
    ours_tps, torch_tps = (tokens / ms * 1e3 if ms else None for ms in (r["ours_ms"], r["torch_ms"]))
    mfu = r["flops_per_step"] / (r["ours_ms"] * 1e-3) / r["peak_flops"] if r["ours_ms"] and r["peak_flops"] else None
    return (f"{key:<26}{cell(r['ours_ms'], 9, '.1f')}{cell(r['torch_ms'], 10, '.1f')}{cell(ours_tps, 12, ',.0f')}"
            f"{cell(torch_tps, 13, ',.0f')}{cell(ratio(r['torch_ms'], r['ours_ms']), 7, '.2f')}{cell(mfu, 6, '.2f')}"
            f"{cell(r['ours_bytes'] and r['ours_bytes'] / 1e9, 9, '.1f')}"
            f"{cell(r['torch_bytes'] and r['torch_bytes'] / 1e9, 10, '.1f')}"
            f"{cell(ratio(r['ours_bytes'], r['torch_bytes']), 8, '.2f')}")


def run_spec(text: str) -> tuple[str, int, int]:
    """PRESET:B:T -> (preset, B, T)."""
    try:
        name, B, T = text.split(":")
        get_preset(name)
        return name, int(B), int(T)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected PRESET:B:T, e.g. llama3.2-1b:1:8192") from None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--runs", nargs="+", type=run_spec, help="PRESET:B:T instead of --configs")
    parser.add_argument("--dtype", choices=("bf16", "fp8", "fp32"), default="bf16",
                        help="the models' precision (fp8: ours FP8 linear layers; torch bf16, and torchao float8)")
    parser.add_argument("--recompute", choices=("none", "partial", "full"), default=None,
                        help="ours: the plan's recompute (default partial); full also checkpoints torch's blocks")
    parser.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default="adamw",
                        help="adamw8bit: 8-bit moments on both sides (torchao's AdamW8bit for torch)")
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="ours: each group of weights updated in the backward (torch: after it)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="our untimed steps (the first captures the graphs)")
    parser.add_argument("--no-torch", action="store_true", help="time ours only")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-kernel breakdown")
    parser.add_argument("--trace", metavar="DIR",
                        help="also write the breakdown's eager step as a Chrome trace per run into DIR")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    require("scripts/bench_step.py", () if args.no_torch else ("torch",), gpu=True)
    runs = args.runs or [(name, *CONFIGS[name]) for name in args.configs]
    if not args.no_torch:
        from torch_llama import bench_torch  # after the arguments: --help works without torch
    runtime()  # our context first (the primary one, which torch shares)
    print(gpu_line())
    results = {}
    for name, B, T in runs:
        c = get_preset(name).replace(vocab_size=VOCAB)
        key = f"{name} B{B} T{T}"
        plan = make_plan(c, RunOptions("cuda", args.dtype, args.recompute, args.optimizer, args.optimizer_in_backward))
        need, free = sum(training_buffers(plan, c, B, T).values()), gpu_free()
        print(f"\n{key}: {plan.summary()}; needs at least {size_text(need)}, {size_text(free)} free", flush=True)
        r = results[key] = {"B": B, "T": T, "recipe": plan.summary().split(" | ", 3)[-1], "ours_ms": None,
                            "torch_ms": None, "ours_bytes": None, "torch_bytes": None, "breakdown_ms": {},
                            "flops_per_step": matmul_flops_per_token(c, T) * B * T, "peak_flops": plan.peak_flops}
        if need <= free:
            r["ours_ms"], r["ours_bytes"], timeline = bench_ours(c, B, T, args.steps, args.dtype, plan,
                                                                 not args.no_breakdown, args.warmup)
            r["breakdown_ms"] = timeline.totals() if timeline else {}
            if timeline and args.trace:
                Path(args.trace).mkdir(parents=True, exist_ok=True)
                path = Path(args.trace) / f"{name}_B{B}_T{T}_{args.dtype}.json"
                path.write_text(json.dumps(timeline.chrome_trace()))
                print(f"{key}: the eager step's timeline in {path} (chrome://tracing, Perfetto)")
            print(f"{HEADER}\n{table_row(key, r)}", flush=True)  # ours at once: torch may not finish
        if not args.no_torch:
            import torch
            try:
                r["torch_ms"], r["torch_bytes"] = bench_torch(c, B, T, args.steps, "fp32" if args.dtype == "fp32"
                                                              else "bf16", checkpoint=plan.recompute == "full",
                                                              optimizer=args.optimizer)
                if args.dtype == "fp8":
                    r["torch_float8_ms"], r["torch_float8_bytes"] = bench_torch(
                        c, B, T, args.steps, "bf16", checkpoint=plan.recompute == "full", optimizer=args.optimizer,
                        float8=True)
            except torch.OutOfMemoryError:
                print(f"{key}: torch ran out of memory", flush=True)
                torch.cuda.empty_cache()
        print(f"{HEADER}\n{table_row(key, r)}", flush=True)  # each run's row at once, the table at the end
        if r.get("torch_float8_ms") and r["ours_ms"]:
            print(f"{key}: torchao float8 (row-wise) + torch.compile {r['torch_float8_ms']:.1f} ms, "
                  f"{r['torch_float8_bytes'] / 1e9:.1f} GB; ours is {r['torch_float8_ms'] / r['ours_ms']:.2f}x its speed")
        if r["breakdown_ms"]:
            print(f"{key}: per-kernel breakdown of one eager step of ours, ms")
            for label, ms in r["breakdown_ms"].items():
                print(f"  {label:<28}{ms:8.2f}")
    print(f"\n{gpu_line()}\nours = {args.dtype} kernels + CUDA graphs; torch = "
          f"{'fp32' if args.dtype == 'fp32' else 'bf16 autocast'} + torch.compile + "
          f"{'torchao AdamW8bit' if args.optimizer == 'adamw8bit' else 'fused AdamW'}"
          + (" + activation checkpointing" if args.recompute == "full" else "") + "; - where it did not fit")
    print(HEADER)
    for key, r in results.items():
        print(table_row(key, r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
