"""Train a Llama 3.1 model: on the GPU with our CUDA kernels, or on the CPU with the numpy reference.

    python3 train_llama.py                                  # the defaults: a few minutes on a CPU
    python3 train_llama.py -e d12 -b 8 -t 1024 -x 2000 -o runs/d12
    python3 train_llama.py -o runs/d12 --resume             # continue from the newest complete checkpoint
    python3 -m llama.launch --nproc-per-node 8 train_llama.py -e llama3.2-1b -b 8 -t 2048 -o runs/1b

This file parses the command line; the run itself is llama/run/trainer.py's Trainer. On several GPUs
(llama.launch, torchrun, srun or mpirun: one process per GPU) the run is data parallel with ZeRO
(stages 1-3, --zero) over NCCL (llama/parallel/zero.py); -d counts the tokens of a step over all GPUs, and rank 0 alone
prints, logs and writes checkpoints, which resume on any number of GPUs.

With no data arguments it trains on the starter pack's tinyshakespeare shards when they exist
(scripts/download_starter_pack.py), else on the built-in corpus (this machine's Python standard
library sources); both, and the tokenizer, live in the per-user cache (~/.cache/llama-cuda, or
$XDG_CACHE_HOME/llama-cuda; $LLAMA_CUDA_CACHE moves it). Without -o the run goes to out, or out_2,
out_3, ... when out already holds one.
The header (run folder, device, memory, data) and progress go to stdout: progress as a bar on the
terminal a person watches (stdout's, or stderr's when stdout goes to a file), else as one llm.c line per
step (a pipe such as | tee, or files: no bars there), so `| tee log` keeps it all; notes and errors go
to stderr. main.log in the run folder has llm.c's format (llama/runtime/progress.py). Ctrl-C or SIGTERM: the
step finishes, a checkpoint is written, and the exit code is 130 or 143 (a second Ctrl-C stops at once,
without saving; Ctrl-C before training begins ends at once, with 130, and leaves no folder).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from llama.runtime.cli import (ArgumentParser, HelpFormatter, fraction, nonnegative_float, nonnegative_int,
                               positive_float, positive_int, resume_mode, step_count)
from llama.config import ConfigError
from llama.data.shards import ShardError
from llama.data.tokenizer import TokenizerError
from llama.io.checkpoint import CheckpointError, complete_checkpoints, read_state
from llama.io.hf import HFError
from llama.io.run_dir import FollowerRunDir, RunDir, RunDirError, default_output_dir, default_runs, describe_contents
from llama.runtime.kernel_build import KernelBuildError
from llama.runtime.machine import NotEnoughMemory
from llama.options import (DEVICES, DOC_MASKS, DTYPES, FP8_SCALINGS, OPTIMIZERS, RECOMPUTE, REDUCE_DTYPES, SCHEDULES,
                           ZERO_STAGES)
from llama.parallel.distributed import DistributedEnv, DistributedError
from llama.run.plan import RECIPES, PlanError
from llama.runtime.signals import StopNow
from llama.run.trainer import DEVICE_DEFAULTS, Trainer, TrainingDiverged, UserError, data_arguments

PATH_NAMES = {"cpu": "the CPU reference", "bf16": "bf16", "fp8": "fp8", "fp32": "fp32"}


def device_default(key: str) -> str:
    return f"default: {DEVICE_DEFAULTS['cpu'][key]} on the CPU, {DEVICE_DEFAULTS['cuda'][key]} on a GPU"


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark evaluation (scripts/eval.py's scoring)")
    g.add_argument("--eval", default=None, metavar="TASKS",
                   help="score the model on tasks, comma-separated: hellaswag, arc_easy, arc_challenge, piqa, "
                        "winogrande, openbookqa, copa, boolq, lambada_openai, mmlu (each file downloaded on first use "
                        "into the per-user cache), suite (all of them), or a JSONL of {\"context\", \"choices\", "
                        "\"label\"} items; main.log gets s:<step> <task>:<acc> lines (hellaswag's is llm.c's hella) "
                        "(default: none)")
    g.add_argument("--eval-every", type=nonnegative_int, default=None,
                   help="evaluate every N steps and at the last (0: the last only; default: --val-every's N)")
    g.add_argument("--eval-limit", type=positive_int, default=None,
                   help="score the first N items of each task only (default: all)")
    g.add_argument("--eval-source", default=None,
                   help="a local copy of the task's file, a folder of copies (originals, llm-foundry's JSONL, "
                        "llama.cpp's HellaSwag text), or a mirror's base URL (default: the original files)")


def runs_on(kind: int, values) -> str:
    """Which models run each value of a memory recipe (kind: RECIPES' index), from the plan's RECIPES:
    e.g. "none: the CPU reference and the bf16, fp8, fp32 GPU models; full: the CPU reference and the bf16, fp8
    GPU models"."""
    clauses = []
    for value in values:
        paths = [path for path, recipe in RECIPES.items() if value in recipe[kind]]
        gpus = [PATH_NAMES[p] for p in paths if p != "cpu"]
        where = [PATH_NAMES["cpu"]] * ("cpu" in paths) + ([f"the {', '.join(gpus)} GPU models"] if gpus else [])
        clauses.append(f"{value}: {' and '.join(where)}")
    return "; ".join(clauses)


def add_model_and_data(p: argparse.ArgumentParser) -> None:
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
                   "tokenizer/tokenizer.model in the per-user cache, fetched on first use; byte-level tokens when "
                   "offline)")
    g.add_argument("--sft", action="store_true",
                   help="chat fine-tuning on shards that scripts/prepare_data.py wrote from conversations: only the "
                        "tokens their .mask.bin marks (the assistant's replies) count in the loss, averaged over the "
                        "counted tokens of the whole step; implies --doc-mask on")
    g.add_argument("--doc-mask", choices=DOC_MASKS, default="auto",
                   help="attention within each document only (a document starts at each BOS token; RoPE positions "
                        "stay the row's); auto: on with --sft, else off (plain causal attention)")


def add_batch(p: argparse.ArgumentParser) -> None:
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


def add_optimization(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimization")
    g.add_argument("-l", "--lr", type=positive_float, default=None, help=f"peak learning rate ({device_default('lr')})")
    g.add_argument("-u", "--warmup", type=nonnegative_int, default=10, help="warmup steps")
    g.add_argument("-k", "--schedule", choices=SCHEDULES, default="cosine", help="learning-rate schedule")
    g.add_argument("-q", "--final-lr-frac", type=fraction, default=0.1, help="final lr as a fraction of the peak")
    g.add_argument("-c", "--weight-decay", type=nonnegative_float, default=0.1, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=nonnegative_float, default=1.0, help="max global grad norm (0: off)")


def add_memory(p: argparse.ArgumentParser) -> None:
    """The memory recipes; which model runs which is generated from the plan's RECIPES."""
    g = p.add_argument_group("memory")
    g.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="what the backward recomputes instead of keeping: nothing (none), the RMSNorm outputs and "
                        f"SwiGLU (partial), or every layer from its input (full). Runs on {runs_on(0, RECOMPUTE)}. "
                        "default: partial on a GPU in bf16, else none")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="adamw (fp32 moments) or adamw8bit (moments in 8 bits, block-wise; one GPU). Runs on "
                        f"{runs_on(1, OPTIMIZERS)}. default: adamw")
    g.add_argument("--optimizer-in-backward", action="store_true",
                   help="update each group of weights as soon as the backward finishes its gradients, which then "
                        "never exist whole; each group's update is clipped by an estimate of the step's norm (this "
                        "step's norms of the groups done so far, the others' of the last step); one micro-batch a "
                        f"step, one GPU. Runs on {runs_on(2, [True]).removeprefix('True: ')}. default: off")


def add_adapters(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fine-tuning with adapters (LoRA, QLoRA; PEFT's names and defaults)")
    g.add_argument("--lora", type=positive_int, default=None, metavar="RANK",
                   help="train LoRA adapters of this rank on the linear layers of every block, the base frozen (no "
                        "fp32 master, gradient or moments for it): out = x W^T + alpha / rank * (x A^T) B^T "
                        "(default: a full fine-tune)")
    g.add_argument("--lora-alpha", type=positive_float, default=None, help="the adapters' alpha (default: 8, PEFT's)")
    g.add_argument("--lora-dropout", type=fraction, default=0.0,
                   help="dropout on the adapters' input (PEFT's lora_dropout; only 0 is supported for now)")
    g.add_argument("--lora-targets", default=None, metavar="LIST",
                   help="comma-separated linear layers to adapt, of q,k,v,o,gate,up,down (default: all seven; on a "
                        "GPU q,k,v together and gate,up together, as their GEMMs are fused)")
    g.add_argument("--qlora", action="store_true",
                   help="with --lora: keep the frozen base in NF4 (QLoRA: 16 NormalFloat levels, an absmax per 64 "
                        "weights, the absmaxes double-quantized, as bitsandbytes' quantize_4bit), dequantized to bf16 "
                        "a linear layer at a time")


def add_evaluation(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation and sampling")
    g.add_argument("-v", "--val-every", type=nonnegative_int, default=50, help="validate every N steps (0: never)")
    g.add_argument("-m", "--val-batches", type=positive_int, default=10, help="batches per validation")
    g.add_argument("-s", "--sample-every", type=nonnegative_int, default=100, help="sample every N steps (0: never)")
    g.add_argument("-g", "--gen-tokens", type=positive_int, default=64, help="tokens per sample")
    g.add_argument("--temperature", type=nonnegative_float, default=1.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-k", type=nonnegative_int, default=50, help="sample among the k likeliest tokens (0: all)")


def add_output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("-o", "--output-dir", default=None,
                   help="the run's folder: checkpoints, main.log and its lock (default: out, or out_2, out_3, ... "
                        "after the last that holds a run, so that a run never replaces an earlier one; with --resume "
                        "or --overwrite, the last that holds a run)")
    g.add_argument("-n", "--checkpoint-every", type=nonnegative_int, default=100,
                   help="checkpoint every N steps (0: end only)")
    g.add_argument("-nk", "--keep-checkpoints", type=nonnegative_int, default=2,
                   help="how many of the newest checkpoints to keep, besides the one with the lowest probe loss "
                        "(0: all)")
    g.add_argument("-y", "--resume", type=resume_mode, nargs="?", const=True, default=False,
                   help="continue the run in --output-dir from its newest usable checkpoint, refused where there is "
                        "none (llm.c's -y 1 works); --resume auto, for schedulers that rerun one command: continue "
                        "where there is a checkpoint, else start a new run, and say which")
    g.add_argument("--overwrite", action="store_true",
                   help="start over in a folder that holds another run, moving that run into old_run_<n>/")
    g.add_argument("--print-every", type=positive_int, default=1,
                   help="when the step lines show (stdout is not a terminal), print one every N steps")
    g.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the initialization, data and sampling")


def add_device(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("device and precision")
    g.add_argument("--device", choices=DEVICES, default=None, help="default: cuda if usable, else cpu")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="GPU precision: bf16 mixed precision, fp8 (bf16 with the linear layers' GEMMs in FP8 e4m3, "
                        "Hopper; on the CPU the reference's FP8 twin) or exact fp32 (default: bf16 where its kernels "
                        "take the model)")
    g.add_argument("--fp8-scaling", choices=FP8_SCALINGS, default=None,
                   help="--dtype fp8: one scale per row along each GEMM's K (row, the default) or one per tensor "
                        "(tensor, kept for comparison)")
    g = p.add_argument_group("several GPUs")
    g.add_argument("--zero", type=int, choices=ZERO_STAGES, default=None,
                   help="the ZeRO stage, 1 (optimizer state sharded), 2 (and gradients) or 3 (and weights, gathered "
                        "layer by layer); default: the lowest whose buffers fit the GPU")
    g.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default=None,
                   help="the gradients' reduce-scatter in fp32 (the default) or bf16 (half the bytes, rounded)")
    g.add_argument("--dist-timeout", type=positive_float, default=600.0,
                   help="seconds a rank waits for the others (rendezvous, one step) before it stops with an error")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    for add_group in (add_model_and_data, add_batch, add_optimization, add_memory, add_adapters, add_evaluation,
                      add_eval_arguments, add_output, add_device):
        add_group(p)
    args = p.parse_args(argv)
    if args.val_data and not args.train_data:
        p.error("-j/--val-data needs -i/--train-data (the default data brings its own validation split)")
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --output-dir, --overwrite replaces it: pass one of them")
    return args


def check_resume(args: argparse.Namespace, holds: str, chosen: bool) -> None:
    """A plain --resume needs a complete checkpoint in the folder (--resume auto starts anew without one);
    holds: what the folder held before this run (describe_contents). Without -o (chosen), the newest run that
    --resume finds must have trained on this command's data, else the error names the runs that did."""
    out = Path(args.output_dir)
    checkpoints = complete_checkpoints(out)
    if args.resume is True and not checkpoints:
        raise UserError(f"--resume: {out} {holds}, and no complete checkpoint to continue from; start a new run "
                        "without --resume, or pass --resume auto (continue where there is a checkpoint, else start "
                        "anew)")
    mine = data_arguments(vars(args))
    if args.resume and chosen and checkpoints and trained_on(out) != mine:
        same = [str(run) for run in default_runs().values() if trained_on(run) == mine]
        raise UserError(f"--resume without -o continues the newest run, {out}, which trained on {trained_on(out)}, "
                        f"not on {mine}: name the run to continue with -o"
                        + (f" ({', '.join(same)} trained on this data)" if same else ""))


def trained_on(run: Path) -> str | None:
    """The data of the newest complete checkpoint's run in words (None: none, or unreadable)."""
    newest = complete_checkpoints(run)
    try:
        return data_arguments(read_state(newest[-1]).get("args", {})) if newest else None
    except CheckpointError:
        return None


def connect(env: DistributedEnv, timeout: float):
    """The NCCL communicator of this rank, on the GPU of its LOCAL_RANK; a missing GPU or NCCL is one line
    from each rank, before the ranks meet."""
    from llama.runtime.cuda import cuda_unavailable, select_device
    from llama.parallel.nccl import Communicator, NCCLError, version
    select_device(env.local_rank)
    why = cuda_unavailable()
    if why:
        raise UserError(f"{env.world_size} processes need a CUDA GPU each through pycuda, and none is usable here "
                        f"({why})")
    try:
        version()  # loads NCCL
    except NCCLError as e:
        raise UserError(str(e)) from None
    return Communicator(env, timeout)


@contextlib.contextmanager
def quiet(enabled: bool):
    """Ranks other than 0 print nothing while they train; their errors still reach stderr (main)."""
    if not enabled:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


def train(args: argparse.Namespace, chosen: bool, env: DistributedEnv) -> int:
    """The run, on this rank: the ranks connected, the folder claimed (its lock first: another trainer
    there is the error to report) and checked, the Trainer."""
    if chosen and env.is_main:
        print(f"run folder: {args.output_dir} (choose one with -o)")
    holds = describe_contents(Path(args.output_dir))  # before this run makes it
    comm = connect(env, args.dist_timeout) if env.world_size > 1 else None
    run_dir = (RunDir(args.output_dir, resume=args.resume, overwrite=args.overwrite) if env.is_main
               else FollowerRunDir(args.output_dir))
    with comm or contextlib.nullcontext(), run_dir, quiet(not env.is_main):
        check_resume(args, holds, chosen)
        return Trainer(args, run_dir, comm).run()


def interrupted(output_dir: str, how: str, exit_code: int) -> int:
    """The line for a run stopped at once (how: "interrupted", "stopped at once by a second SIGINT"), which
    offers --resume only where there is a checkpoint to resume."""
    if complete_checkpoints(output_dir):
        print(f"\n{how}, without saving; rerun with --resume to continue from the last checkpoint in {output_dir}",
              file=sys.stderr)
    else:
        print(f"\n{how}, before any checkpoint was written: nothing to resume", file=sys.stderr)
    return exit_code


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen = args.output_dir is None  # here, on every rank alike, before rank 0 makes the folder
    if chosen:
        args.output_dir = str(default_output_dir(continuing=bool(args.resume or args.overwrite)))
    where = ""
    try:
        env = DistributedEnv.from_environ()
        where = f"rank {env.rank}: " if env.world_size > 1 else ""
        return train(args, chosen, env)
    except (UserError, PlanError, ConfigError, ShardError, TokenizerError, CheckpointError, RunDirError, HFError,
            DistributedError, NotEnoughMemory, KernelBuildError) as e:
        print(f"error: {where}{e}", file=sys.stderr)
        return 2
    except MemoryError as e:  # past the memory check's estimate
        print(f"error: {where}out of memory ({e or 'MemoryError'}); lower -b or -t, or train a smaller model",
              file=sys.stderr)
        return 2
    except OSError as e:  # a missing file, a full disk, a read-only folder
        detail = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{detail}{e.strerror or e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {where}{e}", file=sys.stderr)
        return 1
    except StopNow as e:
        return interrupted(args.output_dir, f"stopped at once by a second {e}", e.exit_code)
    except KeyboardInterrupt:
        return interrupted(args.output_dir, "interrupted", 130)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # progress lines reach a log file as they happen
    sys.exit(main())
