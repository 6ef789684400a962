"""Benchmark llama/eval against transformers on the GPU (needs torch and transformers), task by task on the same
items, on Hugging Face folders of random weights that transformers builds and saves, with the Llama 3 tokenizer:

1. a check: the first --check-items items of each task scored by transformers in fp32 with lm-evaluation-harness
   0.4.x's HFLM rules, written out here from its source (HFLM._encode_pair and _loglikelihood_tokens: no BOS, the
   window's left truncation, the requests sorted longest first, right padding, log_softmax of the logits, the
   continuation's last positions, the greedy match, one row for the requests that read the same tokens and
   continue with one token as its logits cache does; acc and acc_norm as process_results), against ours in fp32
   (each log-likelihood to 1e-3, the same acc and acc_norm, the same greedy matches) on a d12 of two layers, and for
   the record in bf16;
2. the time of each task and of the whole of them on each --time-models preset (random weights), ours in bf16 with
   eval.py's defaults against transformers in bf16 on the same items: examples/s per task, and the whole suite's
   seconds (ours: tokenizing, building models and scoring; transformers: scoring, after its tokenizer).

    python3 scripts/check_eval_transformers.py                                  # the suite: check, then 1B and d12
    python3 scripts/check_eval_transformers.py --tasks hellaswag,mmlu --time-models llama3.2-1b --skip-check
    python3 scripts/check_eval_transformers.py --time-models llama3.1-8b --limit 500 --skip-check

The items are the tasks' files (../shared/evaldata where it is, else --task-source or the downloads). lm-eval itself
is scripts/check_eval_lmeval.py's. Prints one line per task and model, then the suite's totals; exit 1 when the
check fails.
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from llama.runtime.cli import positive_int
from llama.config import LlamaConfig, get_preset
from llama.data.tokenizer import Llama3Tokenizer, hf_tokenizer_files
from llama.eval.items import LOGLIKELIHOOD, Task, TaskError
from llama.run.plan import evaluation_plan
from llama.eval.runner import DEFAULT_ROWS, DEFAULT_TOKENS, FILLER_PASS, Evaluation, TaskRun, run_tasks
from llama.eval.scoring import ItemScore, metrics
from llama.eval.tasks import SUITE, load_tasks
from llama.io.hf import transformers_config
from llama.io.model_folder import load_model
from llama.model import build_model

REPO = Path(__file__).resolve().parents[1]
EVALDATA = REPO.parent / "shared" / "evaldata"
CHECK_CONFIG = get_preset("d12").replace(n_layers=2)  # the check's model: d12's layers (head_dim 64), two of them


def random_hf_folder(folder: Path, config: LlamaConfig, tokenizer: Llama3Tokenizer, dtype, init_std: float,
                     device: str = "cuda") -> Path:
    """A transformers LlamaForCausalLM of the config with random weights (normal, std init_std, drawn on the
    device), saved with the tokenizer's files."""
    import torch
    import transformers
    config = config.replace(vocab_size=tokenizer.vocab_size, max_seq_len=2048)
    hf_config = transformers_config(config, "sdpa")
    hf_config.initializer_range = init_std
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config).to(dtype)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()  # torch's cache of it goes before ours allocate (8B: 16 GB of 80)
    for name, content in hf_tokenizer_files(tokenizer, config.max_seq_len).items():
        (folder / name).write_text(json.dumps(content))
    return folder


def lm_eval_requests(hf_tokenizer, task: Task) -> list[tuple[int, int, list[int], list[int]]]:
    """(item, choice, context ids, continuation ids) as HFLM.loglikelihood makes them from the items' requests."""
    requests = []
    for i, item in enumerate(task.items):
        for c, (context, continuation) in enumerate(item.requests()):
            spaces = len(context) - len(context.rstrip())
            if spaces:
                continuation, context = context[-spaces:] + continuation, context[:-spaces]
            whole = hf_tokenizer.encode(context + continuation, add_special_tokens=False)
            context_ids = hf_tokenizer.encode(context, add_special_tokens=False)
            requests.append((i, c, context_ids, whole[len(context_ids):]))
    return requests


def batches(groups: list, rows: int, tokens: int) -> list[list]:
    """The groups, longest first, in batches of at most `rows` rows and `tokens` tokens (rows times the longest)."""
    ordered, out = sorted(groups, key=lambda group: -len(group[0])), []
    for group in ordered:
        if out and len(out[-1]) < rows and (len(out[-1]) + 1) * len(out[-1][0][0]) <= tokens:
            out[-1].append(group)
        else:
            out.append([group])
    return out


def transformers_loglikelihoods(model, requests: list, max_length: int, rows: int, tokens: int = 8192) -> dict:
    """{(item, choice): (log-likelihood, greedy)} as HFLM._loglikelihood_tokens computes them, longest first, up to
    `rows` rows and `tokens` tokens a batch (the (rows, tokens, vocab) fp32 log-probs of a batch are what fills the
    GPU's memory); requests that read the same tokens and continue with one token share a row."""
    import torch
    import torch.nn.functional as F
    groups = {}
    for request in requests:
        inputs = tuple((request[2] + request[3])[-(max_length + 1):][:-1])
        key = inputs if len(request[3]) == 1 else (inputs, request[:2])
        groups.setdefault(key, (list(inputs), []))[1].append(request)
    out = {}
    with torch.no_grad():
        for chunk in batches(list(groups.values()), rows, tokens):
            width = max(len(inputs) for inputs, _ in chunk)
            batch = torch.zeros((len(chunk), width), dtype=torch.long, device="cuda")
            for row, (inputs, _) in enumerate(chunk):
                batch[row, :len(inputs)] = torch.tensor(inputs)
            logprobs = F.log_softmax(model(batch).logits.float(), dim=-1)
            for row, (inputs, members) in enumerate(chunk):
                for request in members:
                    continuation = torch.tensor(request[3], device="cuda")
                    picked = logprobs[row, len(inputs) - len(request[3]):len(inputs)]
                    greedy = bool((picked.argmax(dim=-1) == continuation).all())
                    out[request[0], request[1]] = (float(picked.gather(1, continuation[:, None]).sum()), greedy)
    return out


def scores_of(task: Task, values: dict) -> list[ItemScore]:
    """The task's ItemScores from {(item, choice): (log-likelihood, greedy)}."""
    greedy = task.kind == LOGLIKELIHOOD
    return [ItemScore(i, item.label, tuple(values[i, c][0] for c in range(len(item.choices))),
                      tuple(len(choice) for choice in item.choices), values[i, 0][1] if greedy else None)
            for i, item in enumerate(task.items)]


def transformers_scores(folder: Path, tasks: list[Task], dtype, rows: int,
                        tokens: int = 8192) -> Iterator[tuple[list[ItemScore], float]]:
    """transformers' scores of each task (lm-eval's rules) and the seconds they took (the model loaded and the
    requests tokenized first), task by task as each is scored."""
    import torch
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype, attn_implementation="sdpa")
    model = model.cuda().eval()
    max_length = model.config.max_position_embeddings
    for task in tasks:
        requests = lm_eval_requests(hf_tokenizer, task)
        transformers_loglikelihoods(model, requests[:rows], max_length, rows, tokens)  # warm up
        torch.cuda.synchronize()
        began = time.perf_counter()
        values = transformers_loglikelihoods(model, requests, max_length, rows, tokens)
        torch.cuda.synchronize()
        yield scores_of(task, values), time.perf_counter() - began
    del model
    torch.cuda.empty_cache()


def our_scores(folder: Path, task: Task, dtype: str, rows: int, device: str = "cuda",
               tokens: int = 8192) -> tuple[list[ItemScore], float]:
    """Our scores of the task's items on the folder's model in dtype on the device (at most `tokens` tokens a pass:
    the fp32 model keeps each pass's logits and attention probabilities), and the seconds they took."""
    config, params, tokenizer = load_model(str(folder), None)
    evaluation = Evaluation(task, tokenizer, rows, config.max_seq_len, max_tokens=tokens)
    model = build_model(config, evaluation_plan(config, device, dtype), (evaluation.B, evaluation.T), params)
    model.forward(*FILLER_PASS)
    began = time.perf_counter()
    scores = evaluation.run(model)
    return scores, time.perf_counter() - began


def compare(ours: list[ItemScore], theirs: list[ItemScore]) -> tuple[float, int, int]:
    """(largest difference of a log-likelihood, items whose acc differs, items whose acc_norm differs)."""
    worst = max(abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o.loglikelihoods, t.loglikelihoods))
    return (worst, sum(o.correct != t.correct for o, t in zip(ours, theirs)),
            sum(o.prediction_norm != t.prediction_norm for o, t in zip(ours, theirs)))


def check_scores(tasks: list[Task], tokenizer, args, workdir: Path) -> bool:
    """Part 1: fp32 to 1e-3 and the same acc, acc_norm and greedy matches; bf16 reported."""
    import torch
    small = [task.limited(args.check_items) for task in tasks]
    folder = random_hf_folder(workdir / "check", CHECK_CONFIG, tokenizer, torch.float32, 0.1)
    ok = True
    theirs_all = list(transformers_scores(folder, small, torch.float32, 32))  # its model gone before ours load
    for task, (theirs, _) in zip(small, theirs_all):
        for dtype in ("fp32", "bf16"):
            ours, _ = our_scores(folder, task, dtype, 64)
            worst, acc_diff, norm_diff = compare(ours, theirs)
            agree = worst < 1e-3 and acc_diff == 0 and ("acc_norm" not in task.metrics or norm_diff == 0)
            shown = ", ".join(f"{m} {metrics(ours, task.metrics)[m]:.4f} vs {metrics(theirs, task.metrics)[m]:.4f}"
                              for m in task.metrics)
            print(f"check {task.name}: d12 (2 layers) {dtype} vs transformers fp32, {len(task.items)} items: largest "
                  f"log-likelihood difference {worst:.2e}; {shown}; items differing: acc {acc_diff}, acc_norm "
                  f"{norm_diff}" + (f" -> {'PASS' if agree else 'FAIL'}" if dtype == "fp32" else ""), flush=True)
            ok &= agree or dtype != "fp32"
    return ok


def our_runs(folder: Path, tasks: list[Task]) -> tuple[list[TaskRun], float]:
    """Each task on the folder's model in bf16 as scripts/eval.py runs it (its defaults on the GPU), and the
    seconds of the whole (tokenizing, building the models, scoring)."""
    config, params, tokenizer = load_model(str(folder), None)
    plan = evaluation_plan(config, "cuda", "bf16")
    began = time.perf_counter()
    runs = run_tasks(tasks, tokenizer, lambda B, T: build_model(config, plan, (B, T), params), DEFAULT_ROWS["cuda"],
                     config.max_seq_len, DEFAULT_TOKENS["cuda"])
    return runs, time.perf_counter() - began


def time_tasks(tasks: list[Task], tokenizer, preset: str, workdir: Path, args) -> None:
    """Part 2: each task on the preset's model, ours against transformers, both bf16, and the totals; ours printed
    before transformers starts, each task's comparison as transformers finishes it."""
    import torch
    folder = random_hf_folder(workdir / preset, get_preset(preset), tokenizer, torch.bfloat16, 0.02)
    runs, ours_total = our_runs(folder, tasks)
    scoring = sum(run.scoring for run in runs)
    parts = {part: sum(getattr(run, part) for run in runs) for part in ("tokenizing", "building")}
    for run in runs:
        n = len(run.scores)
        print(f"{preset} bf16 {run.task.name}, {n:,} items: ours {run.scoring:.1f} s ({n / run.scoring:,.0f} "
              f"examples/s; tokenizing {run.tokenizing:.1f} s)", flush=True)
    print(f"{preset} bf16, {len(tasks)} tasks, {sum(len(run.scores) for run in runs):,} items: ours {ours_total:.1f} s "
          f"in all (tokenizing {parts['tokenizing']:.1f} s, building {parts['building']:.1f} s, scoring {scoring:.1f} "
          f"s)", flush=True)
    gc.collect()  # our last model's GPU memory goes before transformers loads its own
    theirs_total = 0.0
    theirs = transformers_scores(folder, tasks, torch.bfloat16, args.transformers_rows, args.transformers_tokens)
    for run, (their_scores, their_seconds) in zip(runs, theirs, strict=True):  # strict: the generator runs to its end
        n, theirs_total = len(run.scores), theirs_total + their_seconds
        print(f"{preset} bf16 {run.task.name}: transformers {their_seconds:.1f} s ({n / their_seconds:,.0f} "
              f"examples/s), ours {their_seconds / run.scoring:.2f}x; acc {metrics(run.scores)['acc']:.4f} (ours) vs "
              f"{metrics(their_scores)['acc']:.4f}", flush=True)
    print(f"{preset} bf16: transformers scoring {theirs_total:.1f} s, ours {scoring:.1f} s: "
          f"{theirs_total / scoring:.2f}x", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=SUITE, help="task names, comma-separated, or suite (default)")
    p.add_argument("--task-source", default=str(EVALDATA) if EVALDATA.is_dir() else None,
                   help="a folder of the tasks' files (default: ../shared/evaldata where it is, else the downloads)")
    p.add_argument("--tokenizer", default="data/tokenizer/tokenizer.model", help="the Llama 3 tokenizer.model")
    p.add_argument("--check-items", type=positive_int, default=500, help="part 1: items of each task")
    p.add_argument("--time-models", nargs="+", default=["llama3.2-1b", "d12"], help="presets of part 2's random models")
    p.add_argument("--limit", type=positive_int, default=None, help="part 2: the first N items of each task only")
    p.add_argument("--transformers-rows", type=positive_int, default=64, help="transformers' rows a batch at most")
    p.add_argument("--transformers-tokens", type=positive_int, default=16_384,
                   help="transformers' tokens a batch at most (its logits and log-probs: about 10 bytes a token per vocabulary entry)")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args(argv)
    try:
        tokenizer = Llama3Tokenizer(args.tokenizer)
        tasks = load_tasks(args.tasks, None, args.task_source, args.limit)
    except (TaskError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("items: " + ", ".join(f"{task.name} {len(task.items):,}" for task in tasks), flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        ok = args.skip_check or check_scores(tasks, tokenizer, args, Path(workdir))
        for preset in [] if args.skip_timing else args.time_models:
            time_tasks(tasks, tokenizer, preset, Path(workdir), args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
