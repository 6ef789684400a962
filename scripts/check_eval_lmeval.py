"""Check llama/eval against lm-evaluation-harness itself: lm-eval's HFLM (lm_eval 0.4.13,
lm_eval/models/huggingface.py) and ours score the same items on one Hugging Face folder of random weights (d12's
layers, two of them, fp32, built as scripts/check_eval_transformers.py builds it) with the Llama 3 tokenizer.
HFLM.loglikelihood gets Instance objects as lm-eval's multiple_choice task builds them zero-shot
(lm_eval/api/task.py, construct_requests: the context, then the task's target_delimiter " " and each choice); acc
and acc_norm follow its process_results (the argmax of the log-likelihoods, and of each divided by its choice's
length in characters). Each log-likelihood must agree to 1e-3 and acc and acc_norm must be the same; else it exits
1 with one line saying what differs.

    bash scripts/fetch_lmeval_wheels.sh          # where PyPI is reachable: the wheels into .whl-lmeval/
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl-lmeval/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    python3 scripts/check_eval_lmeval.py --tokenizer data/tokenizer/tokenizer.model --items 300
    python3 scripts/check_eval_lmeval.py --device cpu --items 20    # no GPU: both sides on the CPU (slow)

Without --task-source (a copy of hellaswag_val.jsonl) the items are check_eval_transformers.py's stand-in of
HellaSwag's shape.

Why lm_eval 0.4.13 and not 0.4.9: the GPU machines have transformers 5.17, and 0.4.9 cannot be imported there as
its users import it. Its package __init__ files import the evaluator and every model module, and
lm_eval/models/hf_vlms.py reads transformers.AutoModelForVision2Seq, which transformers 5 removed; its
lm_eval/api/registry.py also imports evaluate and so datasets and pyarrow (40 MB) at the top. 0.4.13 loads
lm_eval and lm_eval.models lazily, so `from lm_eval.models.huggingface import HFLM` runs its package __init__
files and imports only what HFLM needs; its multiple_choice requests (target_delimiter " "), _encode_pair and
_loglikelihood_tokens are 0.4.9's, the rules llama/eval/scoring.py follows. Nothing is loaded behind its back.
One default changed: 0.4.9's HFLM encodes without special tokens for a causal model, while 0.4.13 leaves that to
the tokenizer, whose Llama 3 post-processor prepends <|begin_of_text|>. HFLM(add_bos_token=False) asks for
0.4.9's way, the one llama/eval follows (no BOS).

HFLM's imports are torch, transformers, huggingface_hub, numpy, packaging, requests, tqdm, typing_extensions and
pyyaml, which the machines have (torch 2.11, transformers 5.17), and the four wheels of .whl-lmeval/
(scripts/fetch_lmeval_wheels.sh, about 9.5 MB), installed with --no-deps:

- lm_eval 0.4.13: HFLM and Instance; its other requirements (datasets, evaluate, sacrebleu, scikit-learn,
  rouge-score, sqlitedict, ...) serve tasks, metrics and caching, which this check does not import;
- accelerate 1.15.0 (lm_eval/models/huggingface.py imports Accelerator at the top), jinja2 3.1.6 (there and in
  lm_eval/utils.py) and markupsafe 3.0.3 for CPython 3.12 (jinja2's): the machines have these same versions,
  carried so that the check does not rest on the image keeping them.
"""

import argparse
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_eval_transformers import CHECK_CONFIG, compare, our_scores, random_hf_folder, the_task  # noqa: E402

from llama.runtime.cli import positive_int  # noqa: E402
from llama.data.tokenizer import Llama3Tokenizer  # noqa: E402
from llama.eval.scoring import ItemScore, metrics  # noqa: E402
from llama.eval.tasks import TARGET_DELIMITER, Item  # noqa: E402

TOLERANCE = 1e-3  # the largest difference allowed between two log-likelihoods of one choice, in nats
TASK_NAME = "check_eval_lmeval"
WHEELS_HELP = ("install lm-eval's wheels first: bash scripts/fetch_lmeval_wheels.sh (where PyPI is reachable), then "
               "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-lmeval/*.whl && "
               "export PYTHONPATH=/tmp/site:$PWD")


def multiple_choice_instances(items: list[Item], instance_class) -> list:
    """The loglikelihood requests of lm-eval's multiple_choice task, zero-shot: for each item (doc_id i) and choice
    (idx c), instance_class (lm_eval.api.instance.Instance) of the arguments (context, delimiter + choice)."""
    return [instance_class(request_type="loglikelihood", doc={"context": item.context, "choices": list(item.choices),
                                                               "label": item.label},
                           arguments=(item.context, TARGET_DELIMITER + choice), idx=c, metadata=(TASK_NAME, i, 1))
            for i, item in enumerate(items) for c, choice in enumerate(item.choices)]


def scores_from_results(items: list[Item], results: list) -> list[ItemScore]:
    """The items' scores from loglikelihood's (log-likelihood, is_greedy) pairs, in the requests' order."""
    if len(results) != sum(len(item.choices) for item in items):
        raise ValueError(f"{len(results)} results for {sum(len(item.choices) for item in items)} requests")
    scores, first = [], 0
    for i, item in enumerate(items):
        values = tuple(float(value) for value, _ in results[first:first + len(item.choices)])
        scores.append(ItemScore(i, item.label, values, tuple(len(choice) for choice in item.choices)))
        first += len(item.choices)
    return scores


def mismatch(ours: list[ItemScore], theirs: list[ItemScore], tolerance: float = TOLERANCE) -> str | None:
    """One line on the first log-likelihood further than tolerance from lm-eval's, else on acc or acc_norm
    differing; None when they agree."""
    for o, t in zip(ours, theirs):
        for choice, (a, b) in enumerate(zip(o.loglikelihoods, t.loglikelihoods)):
            if not abs(a - b) <= tolerance:
                return (f"item {o.index}, choice {choice}: log-likelihood {a:.6f} (ours) vs {b:.6f} (lm-eval's HFLM), "
                        f"{abs(a - b):.2e} apart (tolerance {tolerance:.0e})")
    ours_m, theirs_m = metrics(ours), metrics(theirs)
    for metric, picks in (("acc", lambda s: s.prediction), ("acc_norm", lambda s: s.prediction_norm)):
        if ours_m[metric] != theirs_m[metric]:
            differ = sum(picks(o) != picks(t) for o, t in zip(ours, theirs))
            return (f"{metric} {ours_m[metric]:.4f} (ours) vs {theirs_m[metric]:.4f} (lm-eval's HFLM); {differ} of "
                    f"{len(ours)} items pick another choice")
    return None


def lm_eval_scores(folder: Path, items: list[Item], device: str, batch_size: int) -> list[ItemScore]:
    """lm-eval's HFLM on the folder in fp32: the items' log-likelihoods through HFLM.loglikelihood."""
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    torch.backends.cuda.matmul.allow_tf32 = False
    lm = HFLM(pretrained=str(folder), device=device, dtype="float32", batch_size=batch_size, add_bos_token=False)
    return scores_from_results(items, lm.loglikelihood(multiple_choice_instances(items, Instance), disable_tqdm=True))


def check(items: list[Item], task_name: str, tokenizer, args, workdir: Path) -> str | None:
    """Both sides on the same random folder; what differs, or None."""
    import torch
    folder = random_hf_folder(workdir / "check", CHECK_CONFIG, tokenizer, torch.float32, 0.1, args.device)
    theirs = lm_eval_scores(folder, items, args.device, args.batch_size)
    ours, _ = our_scores(folder, items, "fp32", args.rows, args.device)
    worst, acc_diff, norm_diff = compare(ours, theirs)
    ours_m, theirs_m = metrics(ours), metrics(theirs)
    print(f"d12 (2 layers) fp32 on {args.device}, {len(items)} items of {task_name}, ours vs lm-eval's HFLM: largest "
          f"log-likelihood difference {worst:.2e}; acc {ours_m['acc']:.4f} vs {theirs_m['acc']:.4f} ({acc_diff} items "
          f"differ), acc_norm {ours_m['acc_norm']:.4f} vs {theirs_m['acc_norm']:.4f} ({norm_diff} differ)")
    return mismatch(ours, theirs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task-source", default=None, help="a copy of hellaswag_val.jsonl (default: the downloaded one, "
                   "else a stand-in of its shape)")
    p.add_argument("--tokenizer", default="data/tokenizer/tokenizer.model", help="the Llama 3 tokenizer.model")
    p.add_argument("--items", type=positive_int, default=300, help="the first N items")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where both sides run")
    p.add_argument("--batch-size", type=positive_int, default=32, help="HFLM's batch size")
    p.add_argument("--rows", type=positive_int, default=64, help="our rows a forward pass")
    args = p.parse_args(argv)
    try:
        import lm_eval.models.huggingface  # noqa: F401  (as its users import it: the package __init__ files run)
    except ImportError as e:
        print(f"error: lm-eval cannot be imported ({e}); {WHEELS_HELP}", file=sys.stderr)
        return 1
    print("versions: " + ", ".join(f"{name} {version(name)}" for name in ("lm_eval", "torch", "transformers")))
    task = the_task(args.task_source, args.items)
    with tempfile.TemporaryDirectory() as workdir:
        failure = check(task.items, task.name, Llama3Tokenizer(args.tokenizer), args, Path(workdir))
    if failure:
        print(f"FAIL: {failure}")
        return 1
    print(f"PASS: every log-likelihood within {TOLERANCE:.0e} of lm-eval's, the same acc and acc_norm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
