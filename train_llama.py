"""Train a Llama 3.1 model: on the GPU with our CUDA kernels, or on the CPU with the numpy reference.

    python train_llama.py                                  # the defaults: a few minutes on a CPU
    python train_llama.py -e d12 -b 8 -t 1024 -x 2000 -o out/d12
    python train_llama.py -o out/d12 --resume              # continue from the newest complete checkpoint
    python -m llama.launch --nproc-per-node 8 train_llama.py -e llama3.2-1b -b 8 -t 2048 -o out/1b

This file parses the command line; the run itself is llama/trainer.py's Trainer. On several GPUs
(llama.launch, torchrun, srun or mpirun: one process per GPU) the run is data parallel with ZeRO
(stages 1-3, --zero) over NCCL (llama/parallel/zero.py); -d counts the tokens of a step over all GPUs, and rank 0 alone
prints, logs and writes checkpoints, which resume on any number of GPUs.

With no data arguments it trains on the starter pack's tinyshakespeare shards when they exist
(scripts/download_starter_pack.py), else on the built-in corpus (this machine's Python standard
library sources). Without -o the run goes to out, or out_2, out_3, ... when out already holds one.
Progress shows as a bar on the terminal a person watches (stdout's, or stderr's when stdout goes to a
file), else as one llm.c line per step on stdout (a pipe such as | tee, or files: no bars there), and
always goes to <output_dir>/main.log in llm.c's format (llama/progress.py). Ctrl-C or SIGTERM: the step
finishes, a checkpoint is written, and the exit code is 130 or 143 (a second Ctrl-C stops at once,
without saving).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from llama.cli import (HelpFormatter, flag, fraction, nonnegative_float, nonnegative_int, positive_float, positive_int,
                       step_count)
from llama.config import ConfigError
from llama.data.shards import ShardError
from llama.data.tokenizer import TokenizerError
from llama.io.checkpoint import CheckpointError
from llama.io.hf import HFError
from llama.io.run_dir import FollowerRunDir, RunDir, RunDirError, default_output_dir
from llama.kernel_build import KernelBuildError
from llama.memory import NotEnoughMemory
from llama.options import DTYPES, FP8_SCALINGS, OPTIMIZERS, RECOMPUTE, SCHEDULES, ZERO_STAGES
from llama.parallel.distributed import DistributedEnv, DistributedError
from llama.plan import PlanError
from llama.signals import StopNow
from llama.trainer import DEVICE_DEFAULTS, Trainer, TrainingDiverged, UserError


def device_default(key: str) -> str:
    return f"default: {DEVICE_DEFAULTS['cpu'][key]} on the CPU, {DEVICE_DEFAULTS['cuda'][key]} on a GPU"


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark evaluation (scripts/eval.py's scoring)")
    g.add_argument("--eval", default=None, metavar="TASK",
                   help="score the model on hellaswag (its validation set, downloaded on first use into data/eval/) "
                        "or on a JSONL of {\"context\", \"choices\", \"label\"} items; main.log gets "
                        "s:<step> hella:<acc> lines (default: none)")
    g.add_argument("--eval-every", type=nonnegative_int, default=None,
                   help="evaluate every N steps and at the last (0: the last only; default: --val-every's N)")
    g.add_argument("--eval-limit", type=positive_int, default=None, help="score the first N items only (default: all)")
    g.add_argument("--eval-source", default=None,
                   help="hellaswag: a local copy of hellaswag_val.jsonl, or a mirror's base URL (default: GitHub's raw "
                        "file)")


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
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="adamw (fp32 moments) or adamw8bit (moments in 8 bits, block-wise; the CPU reference so far); "
                        "default adamw")
    g.add_argument("--optimizer-in-backward", action="store_true",
                   help="update each group of weights as soon as the backward finishes its gradients, which then "
                        "never exist whole; clips by the previous step's norm; one micro-batch a step (the CPU "
                        "reference so far)")
    g = p.add_argument_group("memory")
    g.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="what the backward recomputes instead of keeping: nothing, the RMSNorm outputs and SwiGLU "
                        "(partial), or every layer from its input (full; the CPU reference so far); default partial "
                        "on a GPU in bf16, else none")
    g = p.add_argument_group("evaluation and sampling")
    g.add_argument("-v", "--val-every", type=nonnegative_int, default=50, help="validate every N steps (0: never)")
    g.add_argument("-m", "--val-batches", type=positive_int, default=10, help="batches per validation")
    g.add_argument("-s", "--sample-every", type=nonnegative_int, default=100, help="sample every N steps (0: never)")
    g.add_argument("-g", "--gen-tokens", type=positive_int, default=64, help="tokens per sample")
    g.add_argument("--temperature", type=nonnegative_float, default=1.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-k", type=nonnegative_int, default=50, help="sample among the k likeliest tokens (0: all)")
    add_eval_arguments(p)
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
    g.add_argument("-y", "--resume", type=flag, nargs="?", const=True, default=False,
                   help="continue the run in --output-dir from its newest usable checkpoint (llm.c's -y 1 works)")
    g.add_argument("--overwrite", action="store_true",
                   help="start over in a folder that holds another run, moving that run into old_run_<n>/")
    g.add_argument("--print-every", type=positive_int, default=1,
                   help="when the step lines show (stdout is not a terminal), print one every N steps")
    g.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if usable, else cpu")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="GPU precision: bf16 mixed precision, fp8 (bf16 with the linear layers' GEMMs in FP8 e4m3, "
                        "Hopper; on the CPU the reference's FP8 twin) or exact fp32 (default: bf16 where its kernels "
                        "take the model)")
    g.add_argument("--fp8-scaling", choices=FP8_SCALINGS, default=None,
                   help="--dtype fp8: one scale per row along each GEMM's K (row, the default) or one per tensor "
                        "(tensor, kept for comparison)")
    g.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the initialization, data and sampling")
    g.add_argument("--zero", type=int, choices=ZERO_STAGES, default=None,
                   help="several GPUs: the ZeRO stage, 1 (optimizer state sharded), 2 (and gradients) or 3 (and "
                        "weights, gathered layer by layer); default: the lowest whose buffers fit the GPU")
    g.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default=None,
                   help="several GPUs: the gradients' reduce-scatter in fp32 (the default) or bf16 (half the bytes, "
                        "rounded)")
    g.add_argument("--dist-timeout", type=positive_float, default=600.0,
                   help="several GPUs: seconds a rank waits for the others (rendezvous, one step) before it "
                        "stops with an error")
    args = p.parse_args(argv)
    if args.val_data and not args.train_data:
        p.error("-j/--val-data needs -i/--train-data (the default data brings its own validation split)")
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --output-dir, --overwrite replaces it: pass one of them")
    return args


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
    chosen = args.output_dir is None  # here, on every rank alike, before rank 0 makes the folder
    if chosen:
        args.output_dir = str(default_output_dir(continuing=args.resume or args.overwrite))
    where = ""
    try:
        env = DistributedEnv.from_environ()
        if chosen and env.is_main:
            print(f"run folder: {args.output_dir} (choose one with -o)", file=sys.stderr)
        where = f"rank {env.rank}: " if env.world_size > 1 else ""
        comm = connect(env, args.dist_timeout) if env.world_size > 1 else None
        run_dir = (RunDir(args.output_dir, resume=args.resume, overwrite=args.overwrite) if env.is_main
                   else FollowerRunDir(args.output_dir))
        with comm or contextlib.nullcontext(), run_dir, quiet(not env.is_main):
            return Trainer(args, run_dir, comm).run()
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
