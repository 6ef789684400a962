"""Score a checkpoint or a Hugging Face Llama folder on a multiple-choice task, as lm-evaluation-harness 0.4.x
scores it (llama/eval/scoring.py): on the GPU with the training kernels (every choice of many items in one
forward pass), else on the CPU with the numpy reference.

    python scripts/eval.py out/d12 --task hellaswag
    python scripts/eval.py Llama-3.2-1B --task hellaswag --limit 1000 --output scores.jsonl
    python scripts/eval.py out/d12/ckpt_00002000 --task my_questions.jsonl

MODEL is a checkpoint folder, a run folder (its newest checkpoint) or a folder with config.json and
safetensors (also written hf:PATH), as for generate.py. --task is hellaswag (its validation set, 10,042
items, downloaded on first use into the per-user cache) or a JSONL of {"context": ..., "choices": [...], "label": k},
each choice scored as the continuation " " + choice. Prints acc and acc_norm with their standard errors and
the examples/s; writes each item's log-likelihoods and predictions to --output.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from llama.runtime.cli import existing_path, positive_int
from llama.data.tokenizer import TokenizerError
from llama.eval.runner import FILLER_PASS, Evaluation
from llama.run.plan import evaluation_plan
from llama.eval.scoring import metrics
from llama.eval.tasks import TaskError, load_task
from llama.io.checkpoint import CheckpointError
from llama.io.hf import HFError
from llama.io.model_folder import load_model
from llama.options import DEVICES, DTYPES
from llama.runtime.progress import bar
from llama.model import build_model

DEFAULT_ROWS = {"cuda": 128, "cpu": 8}  # rows (choices) a forward pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=existing_path, help="checkpoint folder, run folder, or Hugging Face folder")
    p.add_argument("--task", default="hellaswag", help="hellaswag, or a JSONL file of multiple-choice items")
    p.add_argument("--limit", type=positive_int, default=None, help="score the first N items only")
    p.add_argument("-b", "--batch-size", type=positive_int, default=None,
                   help="rows (choices) a forward pass (default: 128 on the GPU, 8 on the CPU)")
    p.add_argument("--output", default=None, help="per-item scores, JSONL (default: eval_<task>.jsonl)")
    p.add_argument("--task-source", default=None,
                   help="hellaswag: a local copy of hellaswag_val.jsonl, or a mirror's base URL")
    p.add_argument("--data-dir", default=None, help="download folder (default: eval/ in the per-user cache, "
                   "llama/cache.py)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.model or tokenizer.json (default: the model's)")
    p.add_argument("--device", choices=DEVICES, default=None, help="default: cuda if usable, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="GPU precision (default: bf16 where it runs)")
    return p.parse_args(argv)


def score(args) -> tuple[dict, list, float, str]:
    """(metrics, per-item scores, seconds of the scoring, the device's name) of the model on the task."""
    config, params, tokenizer = load_model(args.model, args.tokenizer)
    task = load_task(args.task, args.data_dir, args.task_source, args.limit)
    plan = evaluation_plan(config, args.device, args.dtype)
    rows = args.batch_size or DEFAULT_ROWS[plan.device]
    evaluation = Evaluation(task, tokenizer, rows, min(config.max_seq_len, 1 << 16))
    T = max(p.tokens.shape[1] for p in evaluation.passes)
    model = build_model(config, plan, (rows, T), params)
    model.forward(*FILLER_PASS)  # loads the kernels, which the timing leaves out
    began = time.perf_counter()
    with bar(total=evaluation.rows, desc=task.name, unit="choice", leave=False) as progress:
        scores = evaluation.run(model, progress.update)
    return metrics(scores), scores, time.perf_counter() - began, f"{plan.device} {plan.dtype}"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        results, scores, seconds, device = score(args)
        output = Path(args.output or f"eval_{Path(args.task).stem}.jsonl")
        output.write_text("".join(json.dumps(s.record()) + "\n" for s in scores))
    except (TaskError, CheckpointError, HFError, TokenizerError, ValueError, RuntimeError, OSError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.task}: {len(scores)} items | acc {results['acc']:.4f} ± {results['acc_stderr']:.4f} | "
          f"acc_norm {results['acc_norm']:.4f} ± {results['acc_norm_stderr']:.4f}")
    print(f"[{device}] {len(scores) / seconds:,.1f} examples/s ({seconds:.1f} s) | scores: {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
