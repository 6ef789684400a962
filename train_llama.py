"""Train a Llama 3.1 model: on the GPU with our CUDA kernels, or on the CPU with the numpy reference.

    python train_llama.py                                  # defaults that train visibly in a minute
    python train_llama.py -e d12 -b 8 -t 1024 -x 2000 -o out/d12
    python train_llama.py -o out/d12 --resume              # continue from the newest complete checkpoint

With no data arguments it trains on the starter pack's tinyshakespeare shards when they exist
(scripts/download_starter_pack.py), else on the built-in corpus (this machine's Python standard
library sources). Progress goes to a tqdm bar and to <output_dir>/main.log in llm.c's format.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from llama.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from llama.config import ConfigError, LlamaConfig, get_preset
from llama.dataloader import DataLoader
from llama.datasets import prepare_builtin_corpus
from llama.generate import decoder_for, generate
from llama.hf import HFError, hf_tokenizer_path, load_hf_folder
from llama.optim import SCHEDULES, AdamWConfig, learning_rate
from llama.params import ParameterLayout, init_parameters
from llama.reference import ReferenceModel
from llama.shards import ShardError
from llama.tokenizer import TokenizerError, load_tokenizer

DEVICE_DEFAULTS = {"cpu": {"model": "small", "batch_size": 4, "seq_len": 64, "lr": 3e-3, "steps": 100},
                   "cuda": {"model": "d12", "batch_size": 8, "seq_len": 1024, "lr": 6e-4, "steps": 200}}
STARTER_PACK = ("data/tinyshakespeare/tiny_shakespeare_train.bin", "data/tinyshakespeare/tiny_shakespeare_val.bin")
BUILTIN_DIR = "data/builtin"
FP32_PEAK_FLOPS = {"H100": 67e12, "H200": 67e12, "A100": 19.5e12}  # non-tensor fp32, datasheets


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, no traceback."""


class TrainingDiverged(Exception):
    """The loss or gradient became NaN or infinite."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("-e", "--model", default=None, help="preset name (d12, small, llama3.2-1b, ...) or config JSON")
    g.add_argument("--init", default=None, help="start from the weights of this checkpoint folder, or of a local "
                   "Hugging Face Llama folder with hf:PATH (config.json, safetensors, tokenizer)")
    g = p.add_argument_group("data")
    g.add_argument("-i", "--train-data", default=None, help="glob of training shards")
    g.add_argument("-j", "--val-data", default=None, help="glob of validation shards")
    g.add_argument("--tokenizer", default=None, help="Llama 3 tokenizer.model or tokenizer.json (default: "
                   "data/tokenizer/tokenizer.model, fetched on first use; byte-level tokens when offline)")
    g = p.add_argument_group("batch and length")
    g.add_argument("-b", "--batch-size", type=int, default=None, help="micro-batch size B")
    g.add_argument("-t", "--seq-len", type=int, default=None, help="sequence length T")
    g.add_argument("-d", "--total-batch-size", type=int, default=None,
                   help="tokens per step; a multiple of B*T (gradient accumulation); default B*T")
    g.add_argument("-x", "--steps", type=int, default=None, help="optimizer steps")
    g.add_argument("--epochs", type=float, default=None, help="train for this many passes over the data instead")
    g = p.add_argument_group("optimization")
    g.add_argument("-l", "--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("-u", "--warmup", type=int, default=10, help="warmup steps")
    g.add_argument("-k", "--schedule", choices=SCHEDULES, default="cosine")
    g.add_argument("-q", "--final-lr-frac", type=float, default=0.1, help="final lr as a fraction of the peak")
    g.add_argument("-c", "--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0: off)")
    g = p.add_argument_group("evaluation and sampling")
    g.add_argument("-v", "--val-every", type=int, default=50, help="validate every N steps (0: never)")
    g.add_argument("-m", "--val-batches", type=int, default=10)
    g.add_argument("-s", "--sample-every", type=int, default=100, help="sample every N steps (0: never)")
    g.add_argument("-g", "--gen-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=50)
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("-o", "--output-dir", default="out")
    g.add_argument("-n", "--checkpoint-every", type=int, default=100, help="checkpoint every N steps (0: end only)")
    g.add_argument("-nk", "--keep-checkpoints", type=int, default=2, help="how many checkpoints to keep (0: all)")
    g.add_argument("-y", "--resume", action="store_true", help="resume from the newest complete checkpoint")
    g.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if usable, else cpu")
    g.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def pick_device(requested: str | None) -> str:
    if requested == "cpu":
        return "cpu"
    try:
        from llama.cuda import runtime
        runtime()
        return "cuda"
    except Exception as e:
        if requested == "cuda":
            raise UserError(f"--device cuda, but no CUDA GPU is usable here ({type(e).__name__}: {e})") from None
        print("note: no usable CUDA GPU (or pycuda is not installed); training on the CPU with the numpy "
              "reference", file=sys.stderr)
        return "cpu"


def resolve_config(name: str) -> LlamaConfig:
    return LlamaConfig.load(name) if name.endswith(".json") else get_preset(name)


def resolve_data(args, tokenizer) -> tuple[str, str | None]:
    if args.train_data:
        return args.train_data, args.val_data
    if all(Path(p).exists() for p in STARTER_PACK):
        print(f"data: the starter pack's tinyshakespeare ({STARTER_PACK[0]})", file=sys.stderr)
        return STARTER_PACK
    train, val = prepare_builtin_corpus(BUILTIN_DIR, tokenizer)
    print(f"data: the built-in corpus (this Python's standard library sources, {train}). For real text, run "
          "python scripts/download_starter_pack.py", file=sys.stderr)
    return str(train), str(val)


def load_source(path: str) -> dict:
    """{'config', 'params', ...} of a checkpoint folder, or of a Hugging Face folder given as hf:PATH."""
    if path.startswith("hf:"):
        config, params = load_hf_folder(path[3:])
        return {"config": config, "params": params}
    return load_checkpoint(path)


def matmul_flops_per_token(config: LlamaConfig, T: int) -> float:
    """Training FLOPs per token, llm.c's convention: 6 per matmul weight + causal attention."""
    layout = ParameterLayout(config)
    weights = sum(t.size for t in layout.tensors.values() if len(t.shape) == 2)
    if not config.tie_embeddings:
        weights -= config.vocab_size * config.dim  # the embedding lookup is not a matmul
    return 6 * weights + 6 * config.n_layers * config.dim * T


def build_model(device: str, config: LlamaConfig, B: int, T: int, params: np.ndarray):
    if device == "cpu":
        return ReferenceModel(config, params=params)
    from llama.gpu_model import GPUModel
    return GPUModel(config, B, T, params=params)


def evaluate(model, loader: DataLoader, batches: int) -> float:
    loader.reset()
    n = min(batches, loader.batches_per_epoch)
    return sum(model.forward(*loader.next_batch()) for _ in range(n)) / n


def train(args) -> int:
    device = pick_device(args.device)
    defaults = DEVICE_DEFAULTS[device]
    B = args.batch_size or defaults["batch_size"]
    T = args.seq_len or defaults["seq_len"]
    total = args.total_batch_size or B * T
    if min(B, T, total) <= 0 or total % (B * T):
        raise UserError(f"--total-batch-size ({total}) must be a positive multiple of B*T ({B}*{T})")
    grad_accum = total // (B * T)
    lr = args.lr if args.lr is not None else defaults["lr"]
    out = Path(args.output_dir)
    hf_folder = args.init[3:] if args.init and args.init.startswith("hf:") else None
    tokenizer = load_tokenizer(args.tokenizer or (hf_folder and hf_tokenizer_path(hf_folder)), fetch=True)

    resume = latest_checkpoint(out) if args.resume else None
    if args.resume and resume is None:
        print(f"note: --resume, but {out} holds no complete checkpoint; starting from scratch", file=sys.stderr)
    source = load_source(str(resume or args.init)) if (resume or args.init) else None
    if source is not None:
        config = source["config"]
        if args.model and resolve_config(args.model).replace(vocab_size=config.vocab_size) != config:
            raise UserError(f"the checkpoint's model config does not match --model {args.model}")
    else:
        config = resolve_config(args.model or defaults["model"]).replace(vocab_size=tokenizer.vocab_size)
    if config.vocab_size != tokenizer.vocab_size:
        raise UserError(f"the model's vocab ({config.vocab_size}) differs from the tokenizer's "
                        f"({tokenizer.vocab_size}, {tokenizer.name}); pass the tokenizer the model was trained with")
    if T > config.max_seq_len:
        raise UserError(f"--seq-len {T} exceeds the model's max_seq_len {config.max_seq_len}")

    train_pattern, val_pattern = resolve_data(args, tokenizer)
    train_loader = DataLoader(train_pattern, B, T, seed=args.seed, vocab_size=config.vocab_size)
    val_loader = DataLoader(val_pattern, B, T, shuffle=False, vocab_size=config.vocab_size) if val_pattern else None
    if args.steps is not None:
        steps = args.steps
    elif args.epochs is not None:
        steps = math.ceil(args.epochs * train_loader.batches_per_epoch / grad_accum)
    else:
        steps = defaults["steps"]

    run = {"batch_size": B, "seq_len": T, "tokens_per_step": total, "seed": args.seed}  # what exact resume needs
    params = source["params"] if source is not None else init_parameters(config, args.seed)
    model = build_model(device, config, B, T, params)
    sample_rng = np.random.default_rng(args.seed)
    start = 0
    if resume is not None:
        state = source["state"]
        for key, now in run.items():
            if state["run"][key] != now:
                raise UserError(f"--resume: the checkpoint was made with {key} {state['run'][key]}, "
                                f"this run asks for {now}")
        model.set_state(source["params"], source["adam_m"], source["adam_v"])
        train_loader.load_state_dict(state["loader"])
        sample_rng.bit_generator.state = state["sample_rng"]
        start = state["step"]
        print(f"resuming from {resume} (step {start})", file=sys.stderr)

    opt = AdamWConfig(weight_decay=args.weight_decay, grad_clip=args.grad_clip)
    flops_per_step = matmul_flops_per_token(config, T) * total
    peak = None
    if device == "cuda":
        from llama.cuda import runtime
        peak = next((v for k, v in FP32_PEAK_FLOPS.items() if k in runtime().name), None)
    model_name = "from checkpoint" if source is not None else args.model or defaults["model"]
    print(f"device {device} | model {model_name}: "
          f"{ParameterLayout(config).size / 1e6:.2f}M params, vocab {config.vocab_size} | B={B} T={T} "
          f"grad_accum={grad_accum} ({total} tokens/step) | {steps} steps, {train_loader.batches_per_epoch} "
          f"batches/epoch", file=sys.stderr)

    def checkpoint(done_steps: int) -> Path:
        params = model.get_params()
        if not np.isfinite(params).all():  # never replace a good checkpoint by a diverged one
            raise TrainingDiverged(f"step {done_steps - 1}: the weights are no longer finite; stopping. "
                                   f"The last good checkpoint is {latest_checkpoint(out) or 'none'}; try a lower --lr")
        state = {"run": run, "loader": train_loader.state_dict(),
                 "sample_rng": sample_rng.bit_generator.state, "args": vars(args)}
        return save_checkpoint(out, done_steps, config, params, *model.get_optimizer_state(), state,
                               keep=args.keep_checkpoints)

    decoder = decoder_for(model, max_len=T) if args.sample_every else None

    def sample(step: int) -> None:
        result = generate(decoder, [tokenizer.bos_id], args.gen_tokens, sample_rng, args.temperature, args.top_k)
        tqdm.write(f"--- sample at step {step} ---\n{tokenizer.decode(result.tokens)}\n---")

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "main.log", "a") as log, tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True) as bar:
        def write_log(line: str) -> None:
            log.write(line + "\n")
            log.flush()

        for step in range(start, steps):
            last = step == steps - 1
            if val_loader is not None and args.val_every and (step % args.val_every == 0 or last):
                val_loss = evaluate(model, val_loader, args.val_batches)
                write_log(f"s:{step} tel:{val_loss:.6f}")
                tqdm.write(f"step {step}: val loss {val_loss:.4f}")
            if args.sample_every and step > start and step % args.sample_every == 0:
                sample(step)
            t0 = time.perf_counter()
            model.zero_grad()
            loss = 0.0
            for _ in range(grad_accum):
                loss += model.forward(*train_loader.next_batch()) / grad_accum
                model.backward(loss_scale=1.0 / grad_accum)
            step_lr = learning_rate(step, steps, lr, args.warmup, args.schedule, args.final_lr_frac)
            norm = model.optimizer_step(step_lr, step + 1, opt) if math.isfinite(loss) else float("nan")
            if not (math.isfinite(loss) and math.isfinite(norm)):
                kept = latest_checkpoint(out)
                raise TrainingDiverged(f"step {step}: loss {loss}, grad norm {norm} is not finite; stopping. "
                                       f"The last good checkpoint is {kept or 'none'}; try a lower --lr")
            dt = time.perf_counter() - t0
            write_log(f"s:{step} trl:{loss:.6f} lr:{step_lr:.6e} norm:{norm:.4f}")
            postfix = {"loss": f"{loss:.4f}", "lr": f"{step_lr:.2e}", "norm": f"{norm:.3f}",
                       "tok/s": f"{total / dt:,.0f}"}
            if peak:
                postfix["mfu"] = f"{flops_per_step / dt / peak:.1%}"
            bar.set_postfix(postfix)
            bar.update(1)
            if (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0) or last:
                checkpoint(step + 1)
    if args.sample_every and steps > start:
        sample(steps)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except (UserError, ConfigError, ShardError, TokenizerError, CheckpointError, HFError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted; rerun with --resume to continue from the last checkpoint in {args.output_dir}",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
