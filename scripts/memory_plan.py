"""What a training run would allocate, buffer by buffer, and whether it fits, before it starts: the same
accounting the trainer's memory check uses (llama/run/memory.py), for any preset, batch, length, GPU count
and memory recipe, on any machine (no GPU needed).

    python3 scripts/memory_plan.py llama3.2-1b -b 8 -t 2048
    python3 scripts/memory_plan.py llama3.1-8b -b 1 -t 2048 --gpus 8
    python3 scripts/memory_plan.py small -b 16 -t 256 --device cpu --recompute full --optimizer adamw8bit
    python3 scripts/memory_plan.py small -b 16 -t 256 --device cpu --optimizer-in-backward
    python3 scripts/memory_plan.py llama3.1-8b -b 2 -t 2048 --recompute full --lora 16 --qlora

On the GPU (bf16) the buffers are those of llama/model/gpu_bf16.py with Hopper's flash attention build;
the CUDA context, kernels and graphs come on top (about 1 GiB), so the total is a lower bound. It is
compared with --memory, else with the free memory of this machine's GPU where one is usable, else with
an H100 80GB and an H200. On the CPU the buffers are the numpy reference's, against --memory or the host
memory available here. A run that does not fit gets the least change that would (what the trainer says).
"""

import argparse
import sys

from llama.runtime.cli import ArgumentParser, HelpFormatter, positive_float, positive_int
from llama.config import ConfigError, get_preset
from llama.run.memory import training_buffers, what_would_fit
from llama.runtime.machine import gpu_free, host_available, size_text
from llama.options import DEVICES, DTYPES, OPTIMIZERS, RECOMPUTE, ZERO_STAGES, RunOptions
from llama.run.plan import ATTENTION_HOPPER, Plan, PlanError, check_zero, choose_device, choose_lora, choose_recipe

GIB = 2**30
# total memory of the GPUs we train on, as nvidia-smi reports it
KNOWN_GPUS = {"H100 80GB": 81559 * 2**20, "H200": 143771 * 2**20}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", help="a preset name (d12, llama3.2-1b, llama3.1-8b, ...)")
    p.add_argument("-b", "--batch-size", type=positive_int, required=True, help="sequences per micro-batch")
    p.add_argument("-t", "--seq-len", type=positive_int, required=True, help="tokens per sequence")
    p.add_argument("--device", choices=DEVICES, default="cuda", help="the GPU models or the CPU reference")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="the GPU model (with --device cuda)")
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs of a ZeRO run (with --device cuda)")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=1, help="the ZeRO stage on several GPUs")
    p.add_argument("--recompute", choices=RECOMPUTE, default=None, help="default: the path's (partial in bf16)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="default: adamw")
    p.add_argument("--optimizer-in-backward", action="store_true", help="gradients a group at a time")
    p.add_argument("--lora", type=positive_int, default=None, metavar="RANK",
                   help="LoRA adapters of this rank on every linear layer, the base frozen")
    p.add_argument("--lora-targets", default=None, metavar="LIST", help="with --lora: of q,k,v,o,gate,up,down")
    p.add_argument("--qlora", action="store_true", help="with --lora: the frozen base in NF4")
    p.add_argument("--memory", type=positive_float, default=None,
                   help="GiB to fit in (default: what is free here, or an H100 80GB and an H200 without a GPU)")
    return p.parse_args(argv)


def plan_of(args) -> Plan:
    """The plan of the run asked for, without looking at this machine (the trainer's make_plan does)."""
    path = "cpu" if args.device == "cpu" else args.dtype
    recipe = choose_recipe(path, args.recompute, args.optimizer, args.optimizer_in_backward, args.gpus)
    check_zero(args.zero, args.gpus, args.dtype)
    options = RunOptions(args.device, in_backward=recipe["in_backward"], zero=args.zero, lora=args.lora,
                         lora_targets=args.lora_targets, qlora=args.qlora)
    dtype = "fp32" if args.device == "cpu" else args.dtype
    lora = choose_lora(options, args.device, dtype)
    if args.device == "cpu":
        return Plan("cpu", dtype, "CPU", **recipe, **lora)
    return Plan("cuda", dtype, "GPU", attention=ATTENTION_HOPPER[0], **recipe, zero=args.zero, **lora)


def budgets(args, plan: Plan) -> dict[str, int | None]:
    """{what: bytes} to compare with."""
    if args.memory:
        return {f"{args.memory:g} GiB": int(args.memory * GIB)}
    if plan.device == "cpu":
        return {"this host": host_available()}
    if choose_device(None) == "cuda":
        return {"this GPU (free now)": gpu_free()}
    return dict(KNOWN_GPUS)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" and args.gpus > 1:
        print("error: --gpus needs --device cuda", file=sys.stderr)
        return 2
    try:
        config = get_preset(args.model)
        plan = plan_of(args)
    except (ConfigError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    B, T = args.batch_size, args.seq_len
    if T > config.max_seq_len:
        print(f"error: -t {T} exceeds the model's max_seq_len {config.max_seq_len}", file=sys.stderr)
        return 2
    buffers = training_buffers(plan, config, B, T, args.gpus)
    where = "the numpy reference" if plan.device == "cpu" else \
        f"{plan.dtype} on {args.gpus} GPU{'s' if args.gpus > 1 else ''}, per GPU" + (f", ZeRO-{plan.zero}" if args.gpus > 1 else "")
    print(f"{args.model}, B={B} T={T}: {where} | recompute {plan.recompute} | {plan.optimizer}"
          + (" in the backward" if plan.in_backward else "")
          + (f" | lora r{plan.lora.rank} on {plan.adapted_linears()} linears, base {'nf4' if plan.qlora else 'frozen'}"
             if plan.lora else ""))
    width = max(map(len, buffers))
    for name, nbytes in buffers.items():
        print(f"  {name:<{width}}  {size_text(nbytes):>12}")
    needed = sum(buffers.values())
    print(f"  {'total' + (' (at least)' if plan.device == 'cuda' else ''):<{width}}  {size_text(needed):>12}")
    fits_all = True
    for what, available in budgets(args, plan).items():
        if available is None:
            print(f"{what}: available memory unknown")
            continue
        fits = needed <= available
        fits_all &= fits
        advice = "" if fits else f"; {what_would_fit(plan, config, B, T, args.gpus, available)}"
        print(f"{what} ({size_text(available)}): {'fits' if fits else 'does not fit'}{advice}")
    return 0 if fits_all else 1


if __name__ == "__main__":
    sys.exit(main())
