"""Check llama/eval against transformers on the GPU (needs torch and transformers), on a Hugging Face folder of
random weights that transformers builds and saves, with the Llama 3 tokenizer (data/tokenizer/tokenizer.model):

1. the same items scored by transformers with lm-evaluation-harness 0.4.x's documented HFLM rules, written
   out here from its source (HFLM._encode_pair, _loglikelihood_tokens: no BOS, the window's left truncation,
   right padding, log_softmax of the logits, the continuation's last positions; acc and acc_norm as its
   multiple_choice process_results), against ours in fp32 (each log-likelihood to 1e-3, the same acc and
   acc_norm) and, for the record, in bf16;
2. the time of the whole set on llama3.2-1b and d12 (random weights), ours in bf16 against transformers in bf16.

    python scripts/check_eval_transformers.py --task-source hellaswag_val.jsonl
    python scripts/check_eval_transformers.py --check-items 200 --time-models d12

Without --task-source (and no downloaded copy) the items are a stand-in with HellaSwag's shape (10,042 items
of four endings; contexts of 20-60 words, endings of 8-30, from the README's words), and it says so.
lm-eval itself is not run: its wheel set (datasets, evaluate, accelerate, sacrebleu, scikit-learn, ...) is
not on the device, which reaches no package index.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from llama.runtime.cli import positive_int
from llama.config import LlamaConfig, get_preset
from llama.data.tokenizer import Llama3Tokenizer, hf_tokenizer_files
from llama.eval.runner import FILLER_PASS, Evaluation
from llama.run.plan import evaluation_plan
from llama.eval.scoring import ItemScore, metrics
from llama.eval.tasks import HELLASWAG, Item, Task, TaskError, load_task
from llama.io.hf import transformers_config
from llama.io.model_folder import load_model
from llama.model import build_model

REPO = Path(__file__).resolve().parents[1]
CHECK_CONFIG = get_preset("d12").replace(n_layers=2)  # part 1's model: d12's layers (head_dim 64), two of them


def stand_in_task(count: int = 10_042, seed: int = 0) -> Task:
    """Items of HellaSwag's shape from the README's words (the real file is not here), less those that spell a
    special token such as <|eot_id|>: transformers' tokenizer reads them as that token, ours as text."""
    words = [w for w in (REPO / "README.md").read_text().split() if "<|" not in w and "|>" not in w]
    rng = np.random.default_rng(seed)

    def text(low: int, high: int) -> str:
        return " ".join(words[i] for i in rng.integers(0, len(words), rng.integers(low, high + 1)))
    return Task("hellaswag (stand-in)", [Item(text(20, 60), tuple(text(8, 30) for _ in range(4)), int(rng.integers(4)))
                                         for _ in range(count)])


def the_task(source: str | None, limit: int | None) -> Task:
    try:
        return load_task("hellaswag", None, source, limit)
    except TaskError as e:
        print(f"note: the real HellaSwag file is not here ({e}); using a stand-in of its shape", file=sys.stderr)
        task = stand_in_task()
        return Task(task.name, task.items[:limit] if limit else task.items)


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
    for name, content in hf_tokenizer_files(tokenizer, config.max_seq_len).items():
        (folder / name).write_text(json.dumps(content))
    return folder


def lm_eval_requests(hf_tokenizer, items: list[Item]) -> list[tuple[int, int, list[int], list[int]]]:
    """(item, choice, context ids, continuation ids) as HFLM.loglikelihood makes them (target delimiter " ")."""
    requests = []
    for i, item in enumerate(items):
        for c, choice in enumerate(item.choices):
            context, continuation = item.context, " " + choice
            spaces = len(context) - len(context.rstrip())
            if spaces:
                continuation, context = context[-spaces:] + continuation, context[:-spaces]
            whole = hf_tokenizer.encode(context + continuation, add_special_tokens=False)
            context_ids = hf_tokenizer.encode(context, add_special_tokens=False)
            requests.append((i, c, context_ids, whole[len(context_ids):]))
    return requests


def transformers_loglikelihoods(model, requests: list, max_length: int, rows: int) -> dict:
    """{(item, choice): log-likelihood} as HFLM._loglikelihood_tokens computes it, `rows` requests a batch."""
    import torch
    import torch.nn.functional as F
    ordered = sorted(requests, key=lambda r: -len(r[2] + r[3]))
    out = {}
    with torch.no_grad():
        for first in range(0, len(ordered), rows):
            chunk = ordered[first:first + rows]
            inputs = [(r[2] + r[3])[-(max_length + 1):][:-1] for r in chunk]
            width = max(len(x) for x in inputs)
            batch = torch.zeros((len(chunk), width), dtype=torch.long, device="cuda")
            for row, x in enumerate(inputs):
                batch[row, :len(x)] = torch.tensor(x)
            logprobs = F.log_softmax(model(batch).logits.float(), dim=-1)
            for row, (request, x) in enumerate(zip(chunk, inputs)):
                continuation = torch.tensor(request[3], device="cuda")
                picked = logprobs[row, len(x) - len(request[3]):len(x)].gather(1, continuation[:, None])
                out[request[0], request[1]] = float(picked.sum())
    return out


def transformers_scores(folder: Path, items: list[Item], dtype, rows: int) -> tuple[list[ItemScore], float]:
    """transformers' scores of the items (lm-eval's rules) and the seconds they took (the model loaded first)."""
    import torch
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype, attn_implementation="sdpa")
    model = model.cuda().eval()
    requests = lm_eval_requests(hf_tokenizer, items)
    transformers_loglikelihoods(model, requests[:rows], model.config.max_position_embeddings, rows)  # warm up
    torch.cuda.synchronize()
    began = time.perf_counter()
    values = transformers_loglikelihoods(model, requests, model.config.max_position_embeddings, rows)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    del model
    torch.cuda.empty_cache()
    return [ItemScore(i, item.label, tuple(values[i, c] for c in range(len(item.choices))),
                      tuple(len(choice) for choice in item.choices)) for i, item in enumerate(items)], seconds


def our_scores(folder: Path, items: list[Item], dtype: str, rows: int,
               device: str = "cuda") -> tuple[list[ItemScore], float]:
    """Our scores of the items on the folder's model in dtype on the device, and the seconds they took."""
    config, params, tokenizer = load_model(str(folder), None)
    began = time.perf_counter()
    evaluation = Evaluation(Task("check", items), tokenizer, rows, config.max_seq_len)
    print(f"ours {dtype}: {len(items)} items tokenized into {len(evaluation.passes)} passes in "
          f"{time.perf_counter() - began:.1f} s", file=sys.stderr)
    model = build_model(config, evaluation_plan(config, device, dtype),
                        (rows, max(p.tokens.shape[1] for p in evaluation.passes)), params)
    model.forward(*FILLER_PASS)
    began = time.perf_counter()
    scores = evaluation.run(model)
    return scores, time.perf_counter() - began


def compare(ours: list[ItemScore], theirs: list[ItemScore]) -> tuple[float, int, int]:
    """(largest difference of a log-likelihood, items whose acc differs, items whose acc_norm differs)."""
    worst = max(abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o.loglikelihoods, t.loglikelihoods))
    return (worst, sum(o.prediction != t.prediction for o, t in zip(ours, theirs)),
            sum(o.prediction_norm != t.prediction_norm for o, t in zip(ours, theirs)))


def check_scores(task: Task, tokenizer, args, workdir: Path) -> bool:
    """Part 1: fp32 to 1e-3 and the same acc and acc_norm; bf16 reported."""
    import torch
    items = task.items[:args.check_items]
    folder = random_hf_folder(workdir / "check", CHECK_CONFIG, tokenizer, torch.float32, 0.1)
    theirs, _ = transformers_scores(folder, items, torch.float32, 32)
    ok = True
    for dtype in ("fp32", "bf16"):
        ours, _ = our_scores(folder, items, dtype, 64)
        worst, acc_diff, norm_diff = compare(ours, theirs)
        ours_m, theirs_m = metrics(ours), metrics(theirs)
        print(f"d12 (2 layers) {dtype} vs transformers fp32, {len(items)} items of {task.name}: largest "
              f"log-likelihood difference {worst:.2e}; acc {ours_m['acc']:.4f} vs {theirs_m['acc']:.4f} ({acc_diff} "
              f"items differ), acc_norm {ours_m['acc_norm']:.4f} vs {theirs_m['acc_norm']:.4f} ({norm_diff} differ)")
        if dtype == "fp32":
            ok = worst < 1e-3 and ours_m["acc"] == theirs_m["acc"] and ours_m["acc_norm"] == theirs_m["acc_norm"]
            print(f"fp32 check: {'PASS' if ok else 'FAIL'}")
    return ok


def time_full_set(task: Task, tokenizer, preset: str, args, workdir: Path) -> None:
    """Part 2: the whole set on the preset's model, ours against transformers, both bf16."""
    import torch
    folder = random_hf_folder(workdir / preset, get_preset(preset), tokenizer, torch.bfloat16, 0.02)
    ours, our_seconds = our_scores(folder, task.items, "bf16", args.rows)
    theirs, their_seconds = transformers_scores(folder, task.items, torch.bfloat16, args.transformers_rows)
    n = len(task.items)
    print(f"{preset} bf16, {n} items of {task.name}: ours {our_seconds:.1f} s ({n / our_seconds:,.0f} "
          f"examples/s), transformers {their_seconds:.1f} s ({n / their_seconds:,.0f} examples/s), "
          f"{their_seconds / our_seconds:.2f}x; acc {metrics(ours)['acc']:.4f} vs {metrics(theirs)['acc']:.4f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task-source", default=None, help="a copy of hellaswag_val.jsonl (default: the downloaded one)")
    p.add_argument("--tokenizer", default="data/tokenizer/tokenizer.model", help="the Llama 3 tokenizer.model")
    p.add_argument("--check-items", type=positive_int, default=500, help="items of part 1")
    p.add_argument("--time-models", nargs="+", default=["llama3.2-1b", "d12"], help="presets of part 2's random models")
    p.add_argument("--limit", type=positive_int, default=None, help="part 2: the first N items only")
    p.add_argument("--rows", type=positive_int, default=128, help="our rows a forward pass")
    p.add_argument("--transformers-rows", type=positive_int, default=64, help="transformers' rows a batch")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args(argv)
    tokenizer = Llama3Tokenizer(args.tokenizer)
    task = the_task(args.task_source, args.limit)
    print(f"items: {task.name}, {len(task.items)} (HellaSwag's validation set has {HELLASWAG['items']})")
    with tempfile.TemporaryDirectory() as workdir:
        ok = check_scores(task, tokenizer, args, Path(workdir))
        for preset in [] if args.skip_timing else args.time_models:
            time_full_set(task, tokenizer, preset, args, Path(workdir))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
