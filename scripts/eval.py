"""Score a checkpoint or a Hugging Face Llama folder on benchmarks, as lm-evaluation-harness 0.4.x scores them
(llama/eval/): on the GPU with the training kernels (every choice of many items in one forward pass), else on the
CPU with the numpy reference.

    python3 scripts/eval.py out/ckpt_00002000 --task suite          # all ten tasks and their summary
    python3 scripts/eval.py Llama-3.2-1B --task arc_easy,hellaswag --limit 1000 --output scores.jsonl
    python3 scripts/eval.py out --task mmlu --task-source ../shared/evaldata
    python3 scripts/eval.py out --task my_questions.jsonl

MODEL is a checkpoint folder, a run folder (its newest checkpoint) or a folder with config.json and
safetensors (also written hf:PATH), as for generate.py. --task is one or more of hellaswag, arc_easy,
arc_challenge, piqa, winogrande, openbookqa, copa, boolq, lambada_openai, mmlu (5-shot), comma-separated; suite
(all of them, summed up as the mean of their centered accuracies, (acc - chance) / (1 - chance)); or a JSONL of
{"context": ..., "choices": [...], "label": k}, each choice scored as the continuation " " + choice. Each task's
original file is downloaded on first use into the per-user cache; --task-source names a local copy, a folder of
copies (the originals, llm-foundry's JSONL, llama.cpp's HellaSwag text) or a mirror. Prints each task's metrics
with their standard errors and examples/s; writes each item's scores to --output and lm-eval's results JSON beside
it (<output>_results.json). A mistake in the arguments or the files is one error line and exit code 2, before
anything is scored; Ctrl-C stops with exit code 130 and writes nothing.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from llama.runtime.cli import existing_path, positive_int
from llama.data.tokenizer import TokenizerError
from llama.eval.items import TaskError
from llama.eval.results import SUITE_METRIC, results_json
from llama.eval.runner import DEFAULT_ROWS, DEFAULT_TOKENS, TaskRun, run_tasks
from llama.eval.scoring import task_metrics
from llama.eval.tasks import SUITE, load_tasks
from llama.io.checkpoint import CheckpointError
from llama.io.hf import HFError
from llama.io.model_folder import load_model
from llama.options import DEVICES, DTYPES
from llama.model import build_model
from llama.run.plan import evaluation_plan



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("model", type=existing_path, help="checkpoint folder, run folder, or Hugging Face folder")
    p.add_argument("--task", default="hellaswag", help="task names (comma-separated), suite, or a JSONL file of "
                   "multiple-choice items")
    p.add_argument("--limit", type=positive_int, default=None, help="score the first N items of each task only")
    p.add_argument("-b", "--batch-size", type=positive_int, default=None,
                   help="rows (choices) a forward pass (default: 128 on the GPU, 8 on the CPU)")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="tokens a forward pass at most: fewer rows where they are long (default: 65536 on the GPU, "
                        "4096 on the CPU)")
    p.add_argument("--output", default=None, help="per-item scores, JSONL (default: eval_<task>.jsonl); lm-eval's "
                   "results JSON goes beside it (<output>_results.json)")
    p.add_argument("--task-source", default=None,
                   help="a local copy of the task's file, a folder of copies, or a mirror's base URL (default: the "
                        "original files, downloaded on first use)")
    p.add_argument("--data-dir", default=None, help="download folder (default: eval/ in the per-user cache, "
                   "llama/cache.py)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.model or tokenizer.json (default: the model's)")
    p.add_argument("--device", choices=DEVICES, default=None, help="default: cuda if usable, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="GPU precision (default: bf16 where it runs)")
    return p.parse_args(argv)


def output_paths(args) -> tuple[Path, Path]:
    """(the per-item JSONL, the results JSON beside it), their folder checked before anything is scored."""
    names = [args.task] if Path(args.task).is_file() else args.task.split(",")
    name = "+".join(Path(n).stem for n in names)
    output = Path(args.output or f"eval_{name}.jsonl")
    folder = output.parent
    if not folder.is_dir():
        raise TaskError(f"--output {output}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise TaskError(f"--output {output}: cannot write in {folder}")
    if output.is_dir():
        raise TaskError(f"--output {output} is a folder; name the JSONL file to write")
    return output, output.with_name(output.stem + "_results.json")


def write_aside(path: Path, text: str) -> None:
    """Write the file under another name, then rename it: a reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def evaluate(args, tasks, config, params, tokenizer) -> tuple[list[TaskRun], str]:
    """Each task's run on the model (llama/eval/runner.py: a model built for each task's passes, kept while the
    next fits), and the device's name."""
    plan = evaluation_plan(config, args.device, args.dtype)
    rows, tokens = args.batch_size or DEFAULT_ROWS[plan.device], args.tokens or DEFAULT_TOKENS[plan.device]
    runs = run_tasks(tasks, tokenizer, lambda B, T: build_model(config, plan, (B, T), params), rows,
                     min(config.max_seq_len, 1 << 16), tokens)
    return runs, f"{plan.device} {plan.dtype}"


def report(run: TaskRun) -> str:
    values = task_metrics(run.task, run.scores)
    shown = " | ".join(f"{m} {values[m]:.4f}" + (f" ± {values[m + '_stderr']:.4f}" if len(run.scores) > 1 else "")
                       for m in run.task.metrics)
    return (f"{run.task.name}: {len(run.scores):,} items | {shown} | {len(run.scores) / run.scoring:,.1f} examples/s "
            f"({run.scoring:.1f} s)")


def main(argv=None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    try:
        output, results_path = output_paths(args)
        tasks = load_tasks(args.task, args.data_dir, args.task_source, args.limit)
        config, params, tokenizer = load_model(args.model, args.tokenizer)
        runs, device = evaluate(args, tasks, config, params, tokenizer)
    except (TaskError, CheckpointError, HFError, TokenizerError, ValueError, OSError, MemoryError) as e:  # PlanError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the GPU's
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: nothing was written", file=sys.stderr)
        return 130
    for run in runs:
        print(report(run))
    suite = SUITE if args.task == SUITE else None
    config_out = {"model": "llama-cuda scripts/eval.py", "model_args": str(args.model), "device": device,
                  "batch_size": args.batch_size, "limit": args.limit}
    results = results_json([(run.task, run.scores) for run in runs], config_out, suite)
    results["total_evaluation_time_seconds"] = f"{time.perf_counter() - began:.1f}"
    if suite:
        print(f"suite of {len(runs)} tasks ({', '.join(run.task.name for run in runs)}): mean centered accuracy "
              f"{results['results'][suite][f'{SUITE_METRIC},none']:.4f}")
    write_aside(output, "".join(json.dumps({"task": run.task.name, **s.record()}) + "\n" for run in runs
                                for s in run.scores))
    write_aside(results_path, json.dumps(results, indent=2) + "\n")
    seconds = {part: sum(getattr(run, part) for run in runs) for part in ("tokenizing", "building", "scoring")}
    print(f"[{device}] {sum(len(run.scores) for run in runs):,} items in {time.perf_counter() - began:.1f} s "
          f"(tokenizing {seconds['tokenizing']:.1f} s, building models {seconds['building']:.1f} s, scoring "
          f"{seconds['scoring']:.1f} s) | scores: {output} | results: {results_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
