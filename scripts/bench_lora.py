"""The anchors of LoRA and QLoRA fine-tuning (the issue's targets): transformers + peft on a bf16 base, and
transformers + peft + bitsandbytes on an NF4 base (double quantization, bf16 compute), on the GPU machine.

Speed and memory (torch, transformers, peft and, for qlora, bitsandbytes installed; a folder of random 8B
weights is enough, speed and memory do not depend on the values):

    python3 scripts/bench_lora.py --hf-folder /tmp/hf8b --make-hf-folder       # write the 8B folder first (16 GB)
    python3 scripts/bench_lora.py --hf-folder /tmp/hf8b -b 2 -t 2048 --configs lora qlora --json anchors.json
    python3 scripts/bench_lora.py --hf-folder /tmp/hf8b -b 1 -t 32768 --configs qlora --compile

  Each config loads the base (lora: bf16; qlora: BitsAndBytesConfig nf4, double quantization, bf16 compute),
  puts PEFT's LoRA (rank, alpha, dropout 0) on the seven linear layers of every block, turns on gradient
  checkpointing (non-reentrant) and SDPA attention, and trains the adapters with AdamW (torch's fused) under
  bf16 autocast on random tokens: --warmup steps, then --steps timed ones. It prints tokens/s and the peak of
  torch.cuda.max_memory_allocated and max_memory_reserved, one line a config (and --json). --compile also
  wraps the model in torch.compile; a config that fails is reported as such, the others still run.

Ours, the same steps on our GPU model (random weights from a seed; no torch), and with --breakdown the milliseconds of
each launcher in one eager step (the GEMMs by layout, the adapters' kernels, the NF4 dequantization):

    python3 scripts/bench_lora.py --configs ours-qlora ours-lora -b 2 -t 2048 --rank 16 --alpha 32 --breakdown

Loss parity (a small random Llama, 200 steps, the same start and batches as our trainer):

    python3 scripts/bench_lora.py --make-parity-inputs /tmp/parity --model d6 --vocab 8192 -b 4 -t 256 --steps 200
    python3 scripts/bench_lora.py --loss-parity /tmp/parity --configs lora qlora --json /tmp/parity/anchor.json

  --make-parity-inputs needs only our package (no torch): DIR/base, our HF export (fp32) of the preset's
  seeded random weights; DIR/adapter, a PEFT folder of fresh adapters (llama/io/peft.py's init_adapters:
  PEFT's initialization, B = 0) of --rank/--alpha on all seven linears; DIR/batches.npy, int32
  (steps, B, T + 1) tokens of repeated random motifs (learnable: each sequence repeats a motif of 2-32 tokens),
  inputs [..., :-1] and targets [..., 1:]. --loss-parity trains from them with constant --lr, AdamW(betas
  0.9, 0.95, eps 1e-8, --weight-decay, default 0) and global-norm clipping at 1, no dropout, and writes each
  config's per-step losses (and the mean of the last 50) to --json. Our side: train_llama.py with
  --init hf:DIR/base, the adapter's initialization and the same batches and settings; compare the means.
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # llama and scripts.bench_startup, run from anywhere
CONFIGS = ("lora", "qlora", "ours-lora", "ours-qlora")  # the anchors, and ours (llama/model/lora_linears.py)
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAST = 50  # the steps whose mean loss the targets compare


def load_base(folder: Path, config: str):
    """transformers' LlamaForCausalLM of the folder on the GPU: bf16, or NF4 with double quantization."""
    import torch
    import transformers

    kwargs = dict(dtype=torch.bfloat16, attn_implementation="sdpa", device_map={"": 0})
    if config == "qlora":
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    try:
        return transformers.LlamaForCausalLM.from_pretrained(folder, **kwargs)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        kwargs["torch_dtype"] = kwargs.pop("dtype")
        return transformers.LlamaForCausalLM.from_pretrained(folder, **kwargs)


def adapted_model(args, config: str, adapter: Path | None):
    """The base with PEFT's LoRA (from the adapter folder, trainable, or fresh), gradient checkpointing on."""
    import peft

    model = load_base(args.hf_folder, config)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
    else:
        lora = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGET_MODULES,
                               bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
    return model


def train_step(model, optimizer, inputs, targets) -> float:
    """One step: bf16 autocast forward, mean cross-entropy in fp32, backward, clip at 1, AdamW; the loss."""
    import torch

    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def optimizer_of(model, lr: float, weight_decay: float):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, fused=True)


def bench_config(args, config: str) -> dict:
    """tokens/s and peak memory of --steps timed steps after --warmup."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = adapted_model(args, config, None)
    vocab = model.config.vocab_size
    if args.compile:
        model = torch.compile(model)
    optimizer = optimizer_of(model, 1e-4, 0.0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, vocab, (args.warmup + args.steps, args.batch, args.seq_len + 1), device="cuda",
                           generator=generator)
    for step in range(args.warmup):
        train_step(model, optimizer, tokens[step, :, :-1], tokens[step, :, 1:])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        loss = train_step(model, optimizer, tokens[step, :, :-1], tokens[step, :, 1:])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = {"config": config, "compile": args.compile, "batch": args.batch, "seq_len": args.seq_len,
           "rank": args.rank, "alpha": args.alpha, "trainable": trainable, "steps": args.steps,
           "tokens_per_s": args.batch * args.seq_len * args.steps / seconds, "step_ms": 1000 * seconds / args.steps,
           "max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
           "max_reserved_gb": torch.cuda.max_memory_reserved() / 1e9, "last_loss": float(loss)}
    del model, optimizer
    return row


def bench_ours(args, config: str) -> dict:
    """Our side of bench_config: --preset's model with the same rank, alpha and targets, its base drawn from a seed
    on the GPU (speed and memory do not depend on the values), every layer recomputed (as gradient checkpointing),
    --warmup steps (the first captures the step's graphs) then --steps timed ones. Memory: our buffers
    (allocated_bytes: everything the model and the launchers allocated) and the device memory the process took
    since before the model (the graphs and the driver's own too, not the CUDA context)."""
    import numpy as np

    from llama.config import get_preset
    from llama.model import build_model
    from llama.optim import AdamWConfig
    from llama.options import RunOptions
    from llama.run.memory import training_buffers
    from llama.run.plan import make_plan
    from llama.runtime.cuda import allocated_bytes, runtime
    from llama.runtime.kernel_build import build, kernels_for

    c = get_preset(args.preset)
    plan = make_plan(c, RunOptions("cuda", "bf16", recompute="full", lora=args.rank, lora_alpha=args.alpha,
                                   qlora=config == "ours-qlora"))
    build(kernels_for(plan, runtime().code, head_dim=c.head_dim))
    free_before = runtime().drv.mem_get_info()[0]
    model = build_model(c, plan, (args.batch, args.seq_len), None, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, c.vocab_size, (args.warmup + args.steps, args.batch, args.seq_len + 1)).astype(np.int32)
    opt = AdamWConfig(weight_decay=0.0)
    for step in range(args.warmup):
        model.train_step([(tokens[step, :, :-1], tokens[step, :, 1:])], 1e-4, step + 1, opt)
    runtime().synchronize()
    start = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        loss, _ = model.train_step([(tokens[step, :, :-1], tokens[step, :, 1:])], 1e-4, step + 1, opt)
    runtime().synchronize()
    seconds = time.perf_counter() - start
    used = free_before - runtime().drv.mem_get_info()[0]
    breakdown = {}
    if args.breakdown:  # one eager step, CUDA events around every launcher call (scripts/bench_step.py's)
        from scripts.bench_step import kernel_breakdown
        breakdown = kernel_breakdown(model, [(tokens[0, :, :-1], tokens[0, :, 1:])], opt).totals()
    row = {"config": config, "compile": False, "batch": args.batch, "seq_len": args.seq_len, "rank": args.rank,
           "alpha": args.alpha, "trainable": model.trained.size, "steps": args.steps,
           "tokens_per_s": args.batch * args.seq_len * args.steps / seconds, "step_ms": 1000 * seconds / args.steps,
           "max_allocated_gb": allocated_bytes() / 1e9, "max_reserved_gb": used / 1e9,
           "accounted_gb": sum(training_buffers(plan, c, args.batch, args.seq_len).values()) / 1e9,
           "last_loss": float(loss), "plan": plan.summary(), "breakdown_ms": breakdown}
    del model
    return row


def loss_parity(args, config: str) -> dict:
    """The per-step losses of training from DIR/adapter on DIR/batches.npy."""
    import numpy as np
    import torch

    folder = args.loss_parity
    batches = torch.from_numpy(np.load(folder / "batches.npy").astype(np.int64)).cuda()
    args.hf_folder = folder / "base"
    torch.manual_seed(0)
    model = adapted_model(args, config, folder / "adapter")
    optimizer = optimizer_of(model, args.lr, args.weight_decay)
    losses = []
    for step in range(batches.shape[0]):
        losses.append(float(train_step(model, optimizer, batches[step, :, :-1], batches[step, :, 1:])))
        if step % 20 == 0 or step == batches.shape[0] - 1:
            print(f"{config} step {step + 1}/{batches.shape[0]} | loss {losses[-1]:.4f}", flush=True)
    del model, optimizer
    torch.cuda.empty_cache()
    return {"config": config, "lr": args.lr, "weight_decay": args.weight_decay, "losses": losses,
            f"mean_last_{LAST}": sum(losses[-LAST:]) / len(losses[-LAST:])}


def motif_batches(steps: int, batch: int, seq_len: int, vocab: int, seed: int):
    """int32 (steps, batch, seq_len + 1): each sequence a random motif of 2-32 tokens repeated."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = np.empty((steps, batch, seq_len + 1), np.int32)
    for index in np.ndindex(steps, batch):
        motif = rng.integers(0, vocab, rng.integers(2, 33))
        out[index] = np.resize(motif, seq_len + 1)
    return out


def make_parity_inputs(args) -> None:
    """DIR/base (our fp32 HF export of the seeded preset), DIR/adapter (fresh PEFT adapters), DIR/batches.npy."""
    import numpy as np

    from llama.config import get_preset
    from llama.io.hf import save_hf_folder
    from llama.io.peft import init_adapters, save_peft_adapter
    from llama.params import LoraSpec
    from llama.params import init_parameters

    config = get_preset(args.model)
    if args.vocab:
        config = config.replace(vocab_size=args.vocab)
    folder = args.make_parity_inputs
    folder.mkdir(parents=True, exist_ok=True)
    save_hf_folder(folder / "base", config, init_parameters(config, seed=args.seed), "fp32")
    spec = LoraSpec(rank=args.rank, alpha=args.alpha)
    save_peft_adapter(folder / "adapter", config, spec, init_adapters(config, spec, seed=args.seed),
                      base_model=str(folder / "base"))
    np.save(folder / "batches.npy", motif_batches(args.steps, args.batch, args.seq_len, config.vocab_size, args.seed))
    print(f"wrote {folder}/base ({args.model}, vocab {config.vocab_size}), {folder}/adapter (rank {args.rank}, "
          f"alpha {args.alpha}) and {folder}/batches.npy ({args.steps} x {args.batch} x {args.seq_len + 1})")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-folder", type=Path, help="the base model's HF folder (speed and memory)")
    p.add_argument("--make-hf-folder", action="store_true", help="write --hf-folder first: random llama3.1-8b")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("-b", "--batch", type=int, default=2)
    p.add_argument("-t", "--seq-len", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps (with --make-parity-inputs: batches)")
    p.add_argument("--compile", action="store_true", help="also torch.compile the model")
    p.add_argument("--breakdown", action="store_true",
                   help="ours-*: also the milliseconds of each launcher in one eager step")
    p.add_argument("--json", type=Path, help="write the rows (or the losses) here")
    p.add_argument("--loss-parity", type=Path, metavar="DIR", help="train from --make-parity-inputs' DIR")
    p.add_argument("--lr", type=float, default=1e-3, help="--loss-parity's constant learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--make-parity-inputs", type=Path, metavar="DIR", help="write the loss parity's inputs")
    p.add_argument("--model", default="d6", help="--make-parity-inputs' preset")
    p.add_argument("--vocab", type=int, help="--make-parity-inputs' vocabulary (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="llama3.1-8b", help="ours-*: the model (the anchors read --hf-folder's)")
    args = p.parse_args(argv)
    if min(args.batch, args.seq_len, args.rank, args.steps) < 1 or args.warmup < 0:
        p.error("-b, -t, --rank and --steps must be at least 1, --warmup at least 0")
    ours = all(config.startswith("ours") for config in args.configs)
    if args.loss_parity is None and args.make_parity_inputs is None and args.hf_folder is None and not ours:
        p.error("give --hf-folder (speed and memory), --loss-parity DIR or --make-parity-inputs DIR")
    if args.make_hf_folder and args.hf_folder is None:
        p.error("--make-hf-folder needs --hf-folder")
    if args.loss_parity is not None and not (args.loss_parity / "batches.npy").is_file():
        p.error(f"{args.loss_parity} holds no batches.npy: write it with --make-parity-inputs first")
    if args.hf_folder is not None and not args.make_hf_folder and not (args.hf_folder / "config.json").is_file():
        p.error(f"{args.hf_folder} is not an HF model folder (no config.json); --make-hf-folder writes one")
    return args


def print_breakdown(config: str, breakdown: dict | None, step_ms: float) -> None:
    """The launchers' milliseconds in one eager step, largest first, and what they leave of a timed (replayed) step."""
    if not breakdown:
        return
    print(f"{config}: one eager step, ms per launcher (of {sum(breakdown.values()):.1f} ms timed around launches; "
          f"a replayed step {step_ms:.1f} ms)")
    for label, ms in sorted(breakdown.items(), key=lambda item: -item[1]):
        print(f"  {label:<32} {ms:9.2f}")


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.make_parity_inputs is not None:
            make_parity_inputs(args)
            return 0
        if args.make_hf_folder:
            from scripts.bench_startup import make_hf_folder
            make_hf_folder(args.hf_folder)
        rows = []
        for config in args.configs:
            try:
                row = (loss_parity(args, config) if args.loss_parity else
                       bench_ours(args, config) if config.startswith("ours") else bench_config(args, config))
            except Exception as e:  # noqa: BLE001  (one config failing, e.g. under torch.compile, is a result)
                row = {"config": config, "compile": args.compile, "failed": f"{type(e).__name__}: {e}"[:500]}
            rows.append(row)
            if "failed" in row:
                print(f"{config}: failed: {row['failed']}", flush=True)
            elif "losses" in row:
                print(f"{config}: mean loss of the last {LAST} steps {row[f'mean_last_{LAST}']:.4f}", flush=True)
            else:
                print(f"{config}{' compiled' if args.compile else ''} | B {args.batch} x T {args.seq_len} | "
                      f"{row['tokens_per_s']:.0f} tokens/s | {row['step_ms']:.1f} ms/step | max allocated "
                      f"{row['max_allocated_gb']:.2f} GB | max reserved {row['max_reserved_gb']:.2f} GB", flush=True)
                print_breakdown(config, row.get("breakdown_ms"), row["step_ms"])
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
        return 1 if all("failed" in row for row in rows) else 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
