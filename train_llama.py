"""Train a Llama 3.1 model: on the GPU with our CUDA kernels, or on the CPU with the numpy reference.

    python train_llama.py                                  # defaults that train visibly in a minute
    python train_llama.py -e d12 -b 8 -t 1024 -x 2000 -o out/d12
    python train_llama.py -o out/d12 --resume              # continue from the newest complete checkpoint
    python -m llama.launch --nproc-per-node 8 train_llama.py -e llama3.2-1b -b 8 -t 2048 -o out/1b

On several GPUs (llama.launch, torchrun, srun or mpirun: one process per GPU) the run is data
parallel with ZeRO-1 over NCCL (llama/parallel/zero.py); -d counts the tokens of a step over all GPUs, and
rank 0 alone prints, logs and writes checkpoints, which resume on any number of GPUs.

With no data arguments it trains on the starter pack's tinyshakespeare shards when they exist
(scripts/download_starter_pack.py), else on the built-in corpus (this machine's Python standard
library sources). Progress goes to a tqdm bar on a terminal, else to one llm.c line per step on stdout,
and always to <output_dir>/main.log in llm.c's format. Ctrl-C or SIGTERM: the step finishes, a checkpoint
is written, and the exit code is 130 or 143 (a second Ctrl-C stops at once, without saving).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from llama.io.checkpoint import RECENT, CheckpointError, load_checkpoint, newest_usable, refusal, save_checkpoint
from llama.cli import (HelpFormatter, flag, fraction, nonnegative_float, nonnegative_int, positive_float, positive_int,
                       step_count)
from llama.config import ConfigError, LlamaConfig, get_preset
from llama.data.dataloader import DataLoader
from llama.data.datasets import prepare_builtin_corpus
from llama.parallel.distributed import DistributedEnv, DistributedError
from llama.generate import decoder_for, generate
from llama.io.hf import HFError, hf_tokenizer_path, load_hf_folder
from llama.optim import SCHEDULES, AdamWConfig, learning_rate
from llama.params import ParameterLayout, init_parameters
from llama.plan import Plan, PlanError, choose_device, make_plan
from llama.model.reference import ReferenceModel
from llama.io.run_dir import FollowerRunDir, RunDir, RunDirError
from llama.data.shards import ShardError
from llama.signals import GracefulStop, StopNow
from llama.data.tokenizer import TokenizerError, load_tokenizer

DEVICE_DEFAULTS = {"cpu": {"model": "small", "batch_size": 4, "seq_len": 64, "lr": 3e-3, "steps": 100},
                   "cuda": {"model": "d12", "batch_size": 8, "seq_len": 1024, "lr": 6e-4, "steps": 200}}
STARTER_PACK = ("data/tinyshakespeare/tiny_shakespeare_train.bin", "data/tinyshakespeare/tiny_shakespeare_val.bin")
BUILTIN_DIR = "data/builtin"


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, no traceback."""


class TrainingDiverged(Exception):
    """The loss or gradient became NaN or infinite, or the weights failed the checkpoint check."""


def device_default(key: str) -> str:
    return f"default: {DEVICE_DEFAULTS['cpu'][key]} on the CPU, {DEVICE_DEFAULTS['cuda'][key]} on a GPU"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("-e", "--model", default=None,
                   help=f"preset name (d12, small, llama3.2-1b, ...) or config JSON ({device_default('model')})")
    g.add_argument("--init", default=None, help="start from the weights of this checkpoint folder, or of a local "
                   "Hugging Face Llama folder with hf:PATH (config.json, safetensors, tokenizer) (default: random)")
    g = p.add_argument_group("data")
    g.add_argument("-i", "--train-data", default=None, help="glob of training shards (default: the starter pack's "
                   "tinyshakespeare if downloaded, else the built-in corpus)")
    g.add_argument("-j", "--val-data", default=None, help="glob of validation shards, with -i (default: none)")
    g.add_argument("--tokenizer", default=None, help="Llama 3 tokenizer.model or tokenizer.json (default: "
                   "data/tokenizer/tokenizer.model, fetched on first use; byte-level tokens when offline)")
    g = p.add_argument_group("batch and length")
    g.add_argument("-b", "--batch-size", type=positive_int, default=None,
                   help=f"micro-batch size B ({device_default('batch_size')})")
    g.add_argument("-t", "--seq-len", type=positive_int, default=None,
                   help=f"sequence length T ({device_default('seq_len')})")
    g.add_argument("-d", "--total-batch-size", type=positive_int, default=None,
                   help="tokens per step over all GPUs; a multiple of B*T*GPUs (gradient accumulation); "
                        "default B*T*GPUs")
    length = g.add_mutually_exclusive_group()
    length.add_argument("-x", "--steps", type=step_count, default=None,
                        help=f"optimizer steps; -1 for one epoch ({device_default('steps')})")
    length.add_argument("--epochs", type=positive_float, default=None,
                        help="train for this many passes over the data instead (default: --steps)")
    g = p.add_argument_group("optimization")
    g.add_argument("-l", "--lr", type=positive_float, default=None, help=f"peak learning rate ({device_default('lr')})")
    g.add_argument("-u", "--warmup", type=nonnegative_int, default=10, help="warmup steps")
    g.add_argument("-k", "--schedule", choices=SCHEDULES, default="cosine", help="learning-rate schedule")
    g.add_argument("-q", "--final-lr-frac", type=fraction, default=0.1, help="final lr as a fraction of the peak")
    g.add_argument("-c", "--weight-decay", type=nonnegative_float, default=0.1, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=nonnegative_float, default=1.0, help="max global grad norm (0: off)")
    g = p.add_argument_group("evaluation and sampling")
    g.add_argument("-v", "--val-every", type=nonnegative_int, default=50, help="validate every N steps (0: never)")
    g.add_argument("-m", "--val-batches", type=positive_int, default=10, help="batches per validation")
    g.add_argument("-s", "--sample-every", type=nonnegative_int, default=100, help="sample every N steps (0: never)")
    g.add_argument("-g", "--gen-tokens", type=positive_int, default=64, help="tokens per sample")
    g.add_argument("--temperature", type=nonnegative_float, default=1.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-k", type=nonnegative_int, default=50, help="sample among the k likeliest tokens (0: all)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("-o", "--output-dir", default="out", help="the run's folder: checkpoints, main.log and its lock")
    g.add_argument("-n", "--checkpoint-every", type=nonnegative_int, default=100,
                   help="checkpoint every N steps (0: end only)")
    g.add_argument("-nk", "--keep-checkpoints", type=nonnegative_int, default=2,
                   help="how many checkpoints to keep (0: all)")
    g.add_argument("-y", "--resume", type=flag, nargs="?", const=True, default=False,
                   help="continue the run in --output-dir from its newest usable checkpoint (llm.c's -y 1 works)")
    g.add_argument("--overwrite", action="store_true",
                   help="start over in a folder that holds another run, moving that run into old_run_<n>/")
    g.add_argument("--print-every", type=positive_int, default=1,
                   help="when stdout is not a terminal, print a progress line every N steps")
    g.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if usable, else cpu")
    g.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="GPU precision: bf16 mixed precision or exact fp32 (default: bf16 where its kernels take "
                        "the model)")
    g.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the initialization, data and sampling")
    g.add_argument("--dist-timeout", type=positive_float, default=600.0,
                   help="several GPUs: seconds a rank waits for the others (rendezvous, one step) before it "
                        "stops with an error")
    args = p.parse_args(argv)
    if args.val_data and not args.train_data:
        p.error("-j/--val-data needs -i/--train-data (the default data brings its own validation split)")
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --output-dir, --overwrite replaces it: pass one of them")
    return args


def resolve_config(name: str) -> LlamaConfig:
    return LlamaConfig.load(name) if name.endswith(".json") else get_preset(name)


def resolve_data(args, tokenizer) -> tuple[str, str | None]:
    if args.train_data:
        return args.train_data, args.val_data
    if all(Path(p).exists() for p in STARTER_PACK):
        print(f"data: the starter pack's tinyshakespeare ({STARTER_PACK[0]})", file=sys.stderr)
        return STARTER_PACK
    try:
        train, val = prepare_builtin_corpus(BUILTIN_DIR, tokenizer)
    except OSError as e:
        raise UserError(f"cannot build the built-in corpus in {BUILTIN_DIR}: {e.strerror or e}") from None
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


def build_model(plan: Plan, config: LlamaConfig, B: int, T: int, params: np.ndarray, comm=None):
    if plan.device == "cpu":
        return ReferenceModel(config, params=params)
    if plan.dtype == "bf16":
        from llama.model.gpu_bf16 import GPUModelBF16
        return GPUModelBF16(config, B, T, params=params, comm=comm, plan=plan)
    from llama.model.gpu_fp32 import GPUModelFP32
    return GPUModelFP32(config, B, T, params=params, comm=comm)


def mean_over_ranks(comm, *values: float) -> list[float]:
    """The mean over ranks of a few host numbers (the values themselves on one process)."""
    if comm is None:
        return list(values)
    return list(comm.host_sum(values) / comm.world_size)


def evaluate(model, loader: DataLoader, batches: int, comm=None) -> float:
    loader.reset()
    n = min(batches, loader.batches_per_epoch)
    return mean_over_ranks(comm, sum(model.forward(*loader.next_batch()) for _ in range(n)) / n)[0]


def find_resume_checkpoint(out: Path) -> dict | None:
    """The newest usable checkpoint in out, after one line for each newer one that is not usable."""
    found, skipped = newest_usable(out)
    for reason in skipped:
        print(f"warning: skipping an unusable checkpoint: {reason}", file=sys.stderr)
    if found is None and skipped:
        raise UserError(f"--resume: none of the {len(skipped)} checkpoints in {out} is usable; "
                        "start over with --overwrite")
    if found is None:
        print(f"note: --resume, but {out} holds no complete checkpoint; starting from scratch", file=sys.stderr)
    return found


def step_line(step: int, steps: int, loss: float, lr: float, norm: float, dt: float, tokens: int,
              mfu: float | None) -> str:
    """llm.c's progress line, for logs that are not a terminal."""
    line = (f"step {step + 1:4d}/{steps} | loss {loss:.6f} | lr {lr:.2e} | norm {norm:.4f} | {dt * 1e3:.1f} ms | "
            f"{tokens / dt:,.0f} tok/s")
    return line + (f" | MFU {mfu:.1%}" if mfu is not None else "")


def train(args, run_dir: RunDir, comm=None) -> int:
    """The training run; comm is the NCCL communicator of a multi-GPU run (None on one process)."""
    device = choose_device(args.device)
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    if world > 1 and device != "cuda":
        raise UserError(f"{world} processes were started, but several processes need CUDA GPUs")
    defaults = DEVICE_DEFAULTS[device]
    B = args.batch_size or defaults["batch_size"]
    T = args.seq_len or defaults["seq_len"]
    total = args.total_batch_size or B * T * world
    if total % (B * T * world):
        raise UserError(f"--total-batch-size ({total}) must be a positive multiple of B*T*GPUs ({B}*{T}*{world})")
    grad_accum = total // (B * T * world)
    lr = args.lr if args.lr is not None else defaults["lr"]
    out = run_dir.path
    hf_folder = args.init[3:] if args.init and args.init.startswith("hf:") else None
    tokenizer = load_tokenizer(args.tokenizer or (hf_folder and hf_tokenizer_path(hf_folder)), fetch=True)

    resume = find_resume_checkpoint(out) if args.resume else None
    source = resume or (load_source(args.init) if args.init else None)
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

    plan = make_plan(config, args.device, args.dtype)
    print(plan.summary(), file=sys.stderr)

    train_pattern, val_pattern = resolve_data(args, tokenizer)
    # a loader batch is this rank's rows of one step (B * grad_accum rows of every B * grad_accum * world),
    # so the data order is the same on any number of GPUs for the same tokens per step
    train_loader = DataLoader(train_pattern, B * grad_accum, T, rank, world, seed=args.seed, vocab_size=config.vocab_size)
    val_loader = (DataLoader(val_pattern, B, T, rank, world, shuffle=False, vocab_size=config.vocab_size)
                  if val_pattern else None)
    if args.steps is not None and args.steps != -1:
        steps = args.steps
    elif args.epochs is not None or args.steps == -1:  # -x -1 is one epoch, as in llm.c
        steps = math.ceil((args.epochs or 1) * train_loader.batches_per_epoch)
    else:
        steps = defaults["steps"]

    run = {"batch_size": B, "seq_len": T, "tokens_per_step": total, "seed": args.seed}
    same = ("seq_len", "tokens_per_step", "seed")  # what exact resume needs: B and the GPU count may change
    params = source["params"] if source is not None else init_parameters(config, args.seed)
    model = build_model(plan, config, B, T, params, comm)
    sample_rng = np.random.default_rng(args.seed)
    # each checkpoint's weights are checked on this fixed batch before they are saved (checkpoint.refusal)
    probe_loader = DataLoader(val_pattern or train_pattern, B, T, shuffle=False, vocab_size=config.vocab_size)
    probe_batch = probe_loader.next_batch()
    start, recent_losses, log_bytes = 0, [], 0
    if resume is not None:
        state = source["state"]
        for key in same:
            now = run[key]
            if state["run"][key] != now:
                raise UserError(f"--resume: the checkpoint was made with {key} {state['run'][key]}, "
                                f"this run asks for {now}")
        model.set_state(source["params"], source["adam_m"], source["adam_v"])
        try:
            train_loader.load_state_dict(state["loader"])
        except ValueError as e:
            raise UserError(f"--resume: {e}") from None
        sample_rng.bit_generator.state = state["sample_rng"]
        start, recent_losses, log_bytes = state["step"], state.get("recent_losses", []), state.get("log_bytes")
        print(f"resuming from {resume['path']} (step {start})", file=sys.stderr)
        if start >= steps:
            print(f"note: the checkpoint is at step {start}, the run has {steps} steps: nothing to train "
                  "(ask for more with -x)", file=sys.stderr)
    last_good = resume["path"] if resume is not None else None

    opt = AdamWConfig(weight_decay=args.weight_decay, grad_clip=args.grad_clip)
    flops_per_step = matmul_flops_per_token(config, T) * total
    peak = plan.peak_flops * world if plan.peak_flops else None  # MFU per GPU
    model_name = "from checkpoint" if source is not None else args.model or defaults["model"]
    gpus = f" x {world} GPUs (ZeRO-1 over NCCL)" if world > 1 else ""
    print(f"device {device}{gpus} | model {model_name}: "
          f"{ParameterLayout(config).size / 1e6:.2f}M params, vocab {config.vocab_size} | B={B} T={T} "
          f"grad_accum={grad_accum} ({total} tokens/step) | {steps} steps, {train_loader.batches_per_epoch} "
          f"steps/epoch", file=sys.stderr)

    def diverged(message: str) -> TrainingDiverged:
        return TrainingDiverged(f"{message}; stopping. The last good checkpoint is "
                                f"{last_good or 'none (none was written)'}; try a lower --lr")

    def checkpoint(done_steps: int) -> None:
        """Rank 0 writes the full state (gathered from every rank's shard); every rank takes part."""
        nonlocal last_good, recent_losses
        params = model.get_params()  # None on ranks other than 0
        probe_loss = model.forward(*probe_batch)  # the same batch and weights on every rank
        reason = refusal(params, probe_loss, recent_losses) if params is not None else None
        if mean_over_ranks(comm, float(reason is not None))[0] > 0:  # never replace a good checkpoint by a diverged one
            raise diverged(f"step {done_steps - 1}: {reason or 'rank 0 refused the weights'}; not saving a checkpoint")
        recent_losses = (recent_losses + [probe_loss])[-RECENT:]
        adam_m, adam_v = model.get_optimizer_state()
        if rank != 0:
            return
        state = {"run": run | {"world_size": world}, "loader": train_loader.state_dict(),
                 "sample_rng": sample_rng.bit_generator.state, "probe_loss": probe_loss,
                 "recent_losses": recent_losses, "log_bytes": log.synced_size(), "args": vars(args)}
        last_good = save_checkpoint(out, done_steps, config, params, adam_m, adam_v, state, keep=args.keep_checkpoints)

    # on several GPUs the decoder reads a snapshot of the weights gathered for each sample
    decoder = decoder_for(model, plan, max_len=T) if args.sample_every and comm is None else None

    def sample(step: int) -> None:
        step_decoder = decoder or decoder_for(model, plan, max_len=T)
        if rank != 0:
            return
        result = generate(step_decoder, [tokenizer.bos_id], args.gen_tokens, sample_rng, args.temperature, args.top_k)
        tqdm.write(f"--- sample at step {step} ---\n{tokenizer.decode(result.tokens)}\n---")

    loss = val_loss = None
    done, began = start, time.perf_counter()
    with run_dir.open_log(log_bytes) as log, GracefulStop() as stop, \
            tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True, disable=not sys.stderr.isatty()) as bar:
        for step in range(start, steps):
            last = step == steps - 1
            if val_loader is not None and args.val_every and (step % args.val_every == 0 or last):
                val_loss = evaluate(model, val_loader, args.val_batches, comm)
                log.write(f"s:{step} tel:{val_loss:.6f}")
                tqdm.write(f"step {step}: val loss {val_loss:.4f}")
            if args.sample_every and step > 0 and step % args.sample_every == 0:
                sample(step)
            t0 = time.perf_counter()
            step_lr = learning_rate(step, steps, lr, args.warmup, args.schedule, args.final_lr_frac)
            inputs, targets = train_loader.next_batch()
            batches = list(zip(np.split(inputs, grad_accum), np.split(targets, grad_accum)))
            loss, norm = model.train_step(batches, step_lr, step + 1, opt)
            # the mean loss over ranks, and whether any rank was asked to stop: all stop at this step
            loss, stops = mean_over_ranks(comm, loss, float(stop.requested))
            stopping = stops > 0
            if comm is not None:
                comm.beat()
            if not (math.isfinite(loss) and math.isfinite(norm)):
                raise diverged(f"step {step}: loss {loss}, grad norm {norm} is not finite")
            dt = time.perf_counter() - t0
            log.write(f"s:{step} trl:{loss:.6f} lr:{step_lr:.6e} norm:{norm:.4f}")
            mfu = flops_per_step / dt / peak if peak else None
            if not sys.stdout.isatty() and ((step + 1) % args.print_every == 0 or last):
                tqdm.write(step_line(step, steps, loss, step_lr, norm, dt, total, mfu))
            postfix = {"loss": f"{loss:.4f}", "lr": f"{step_lr:.2e}", "norm": f"{norm:.3f}",
                       "tok/s": f"{total / dt:,.0f}"}
            if peak:
                postfix["mfu"] = f"{mfu:.1%}"
            bar.set_postfix(postfix)
            bar.update(1)
            done = step + 1
            if stopping or last or (args.checkpoint_every and done % args.checkpoint_every == 0):
                checkpoint(done)
                if stopping:
                    break
    if args.sample_every and done == steps and done > start:
        sample(steps)
    elapsed, trained = time.perf_counter() - began, done - start
    shown = {name: "n/a" if value is None else f"{value:.4f}" for name, value in (("train", loss), ("val", val_loss))}
    stopped = stop.requested or done < steps  # here, or on another rank
    outcome = f"stopped by {stop.name or 'another rank'} after step {done}/{steps}" if stopped else f"done: step {done}/{steps}"
    print(f"{outcome} | {trained} steps in {elapsed:.1f} s, {trained * total / max(elapsed, 1e-9):,.0f} tok/s | "
          f"train loss {shown['train']} | val loss {shown['val']} | checkpoint {last_good} | log {run_dir.log_path}")
    if stopped:
        print(f"rerun with --resume to continue from {last_good}", file=sys.stderr)
    return stop.exit_code


def connect(env: DistributedEnv, timeout: float):
    """The NCCL communicator of this rank, on the GPU of its LOCAL_RANK."""
    from llama.cuda import select_device
    from llama.parallel.nccl import Communicator
    select_device(env.local_rank)
    return Communicator(env, timeout)


@contextlib.contextmanager
def quiet(enabled: bool):
    """Ranks other than 0 print nothing while they train; their errors still reach stderr (main)."""
    if not enabled:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


def main(argv=None) -> int:
    args = parse_args(argv)
    where = ""
    try:
        env = DistributedEnv.from_environ()
        where = f"rank {env.rank}: " if env.world_size > 1 else ""
        comm = connect(env, args.dist_timeout) if env.world_size > 1 else None
        run_dir = (RunDir(args.output_dir, resume=args.resume, overwrite=args.overwrite) if env.is_main
                   else FollowerRunDir(args.output_dir))
        with comm or contextlib.nullcontext(), run_dir, quiet(not env.is_main):
            return train(args, run_dir, comm)
    except (UserError, PlanError, ConfigError, ShardError, TokenizerError, CheckpointError, RunDirError, HFError,
            DistributedError) as e:
        print(f"error: {where}{e}", file=sys.stderr)
        return 2
    except OSError as e:  # a missing file, a full disk, a read-only folder
        detail = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{detail}{e.strerror or e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {where}{e}", file=sys.stderr)
        return 1
    except StopNow as e:
        print(f"\nstopped at once by a second {e}, without saving; rerun with --resume to continue from the last "
              f"checkpoint in {args.output_dir}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"\ninterrupted; rerun with --resume to continue from the last checkpoint in {args.output_dir}",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # progress lines reach a log file as they happen
    sys.exit(main())
