"""Check llama/eval against lm-evaluation-harness 0.4.13 itself, task by task (hellaswag, arc_easy, arc_challenge,
piqa, winogrande, openbookqa, copa, boolq, lambada_openai, mmlu), on the same documents: those our readers take
from each task's file (llama/eval/benchmarks.py; default ../shared/evaldata, else --task-source or the downloads).

1. requests (no torch; --requests-only stops here): for every item of every task, lm-eval's loglikelihood
   requests built by lm-eval's own code from the same document must be ours, string for string: the context and
   each continuation, the right choice's index and the choices' lengths that acc_norm divides by;
2. scores (torch and transformers, a GPU unless --device cpu): lm-eval's HFLM (lm_eval/models/huggingface.py)
   scores the first --items items of each task (all of a smaller set; MMLU: the first of each subject) through
   HFLM.loglikelihood on one Hugging Face folder, in fp32: a random d12 of two layers (built as
   scripts/check_eval_transformers.py builds it), or --model (a folder export_hf.py wrote, e.g. a d12 trained in
   bf16); ours scores the same items on the same folder in fp32 (and, for the record, in --also-dtype). Each
   log-likelihood must agree to 1e-3, acc and acc_norm must be the same (LAMBADA: every greedy match the same,
   perplexity to 1e-3 relative).
Exit 1 with one line naming the first difference; 0 when every task agrees.

    bash scripts/fetch_lmeval_wheels.sh          # where PyPI is reachable: the wheels into .whl-lmeval/
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl-lmeval/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    python3 scripts/check_eval_lmeval.py --requests-only                 # part 1, on any machine
    python3 scripts/check_eval_lmeval.py --items 500                     # both parts, the random 2-layer model
    python3 scripts/check_eval_lmeval.py --items 500 --model out/d12_hf  # a trained d12 exported to HF
    python3 scripts/check_eval_lmeval.py --items 500 --scored-only       # part 1 on part 2's items only (GPU time)

What comes from lm-eval's code, imported from the installed package: each task's YAML, read by lm-eval's own
loader (lm_eval/tasks/_yaml_loader.py: its include and !function, which imports the task's utils module:
hellaswag's process_docs and preprocess, winogrande's and copa's doc_to_text/doc_to_target/doc_to_choice);
the Jinja templates rendered by lm_eval.utils.apply_template; the few-shot documents drawn by
lm_eval.api.samplers (first_n for MMLU); the prompt's pieces joined by lm_eval.api.utils (Message,
maybe_delimit); Instance; HFLM's tokenization, truncation, batching and log-softmax. What is written out here,
following lm_eval/api/task.py line for line (that module imports `datasets`, which the GPU machines lack, so it
cannot be imported there): ConfigurableTask.doc_to_text/doc_to_target/doc_to_choice's choice between a field, a
template and a function; fewshot_context, build_qa_turn and multiple_input_context's order of the pieces;
construct_requests' arguments; process_results' acc, acc_norm and greedy match; the perplexity aggregation.
hellaswag/utils.py imports `datasets` only for process_docs' Dataset.map: where the package is missing, a
stand-in module whose Dataset maps over a list is in sys.modules while the YAMLs load.

Why lm_eval 0.4.13: the GPU machines have transformers 5, which 0.4.9 cannot be imported under (its package
__init__ files import every model module, and hf_vlms.py reads transformers.AutoModelForVision2Seq, gone in 5).
0.4.13 loads lm_eval and lm_eval.models lazily, so `from lm_eval.models.huggingface import HFLM` imports only what
HFLM needs. One default changed: 0.4.13 leaves the BOS to the tokenizer, whose Llama 3 post-processor prepends
<|begin_of_text|>; HFLM(add_bos_token=False) asks for 0.4.9's rule for causal models, the one llama/eval follows.
HFLM's imports are torch, transformers, huggingface_hub, numpy, packaging, requests, tqdm, typing_extensions and
pyyaml, which the machines have, and the four wheels of .whl-lmeval/ (scripts/fetch_lmeval_wheels.sh): lm_eval
0.4.13, accelerate 1.15.0 (huggingface.py imports Accelerator), jinja2 3.1.6 and markupsafe 3.0.3 (CPython 3.12).
"""

import argparse
import ast
import dataclasses
import importlib.util
import sys
import tempfile
import time
import types
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_eval_transformers import CHECK_CONFIG, our_scores, random_hf_folder  # noqa: E402

from llama.runtime.cli import positive_int  # noqa: E402
from llama.data.tokenizer import Llama3Tokenizer  # noqa: E402
from llama.eval.benchmarks import BENCHMARKS, MMLU_SUBJECTS, Benchmark, Documents  # noqa: E402
from llama.eval.items import LOGLIKELIHOOD, Task, TaskError  # noqa: E402
from llama.eval.scoring import ItemScore, metrics  # noqa: E402
from llama.eval.tasks import benchmark_task, load_documents  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EVALDATA = REPO.parent / "shared" / "evaldata"
TOLERANCE = 1e-3  # the largest difference allowed between two log-likelihoods of one choice, in nats
WHEELS_HELP = ("install lm-eval's wheels first: bash scripts/fetch_lmeval_wheels.sh (where PyPI is reachable), then "
               "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-lmeval/*.whl && "
               "export PYTHONPATH=/tmp/site:$PWD")


# ---- lm-eval's pieces

def lm_eval_root() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        raise ImportError("No module named 'lm_eval'")
    return Path(spec.submodule_search_locations[0])


def module_from_file(name: str, path: Path) -> types.ModuleType:
    """A module of lm_eval by its file, without its package's __init__ (lm_eval/tasks/__init__.py imports the
    TaskManager and with it lm_eval/api/task.py, which imports datasets)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ListDataset(list):
    """The one use hellaswag/utils.py makes of datasets.Dataset: map, which adds each returned field to the row."""

    def map(self, function):
        return ListDataset({**doc, **function(doc)} for doc in self)


@contextmanager
def datasets_or_stand_in():
    """The datasets package, or while the YAMLs load, a module of that name holding ListDataset as Dataset."""
    try:
        import datasets
        yield datasets.Dataset.from_list
        return
    except ImportError:
        pass
    sys.modules["datasets"] = types.SimpleNamespace(Dataset=ListDataset)
    try:
        yield ListDataset
    finally:
        del sys.modules["datasets"]


class LmEval:
    """The parts of the installed lm_eval this check uses, and each task's config read by lm-eval's loader."""

    def __init__(self):
        import lm_eval.api.samplers
        import lm_eval.api.utils
        import lm_eval.utils
        self.root = lm_eval_root()
        self.apply_template = lm_eval.utils.apply_template
        self.samplers, self.api_utils = lm_eval.api.samplers, lm_eval.api.utils
        loader = module_from_file("lm_eval_yaml_loader", self.root / "tasks" / "_yaml_loader.py")
        self.configs = {}
        with datasets_or_stand_in() as self.as_dataset:
            for name, benchmark in BENCHMARKS.items():
                yamls = ([f"mmlu/default/mmlu_{s}.yaml" for s in MMLU_SUBJECTS] if name == "mmlu" else [benchmark.yaml])
                for path in yamls:
                    self.configs[path] = loader.load_yaml(self.root / "tasks" / path)


class LmEvalTask:
    """One task as lm_eval/api/task.py's ConfigurableTask builds its requests, from its YAML's config (written out
    where noted; lm-eval's own functions everywhere else)."""

    def __init__(self, lm: LmEval, config: dict, fewshot_docs: list[dict] | None = None):
        self.lm, self.config = lm, config
        self.target_delimiter = config.get("target_delimiter", " ")
        self.fewshot_delimiter = config.get("fewshot_delimiter", "\n\n")
        self.sampler = None
        if fewshot_docs is not None:  # fewshot_config: sampler: first_n (MMLU's)
            sampler = config.get("fewshot_config", {}).get("sampler", "default")
            self.sampler = {"first_n": lm.samplers.FirstNSampler, "default": lm.samplers.ContextSampler}[sampler](
                fewshot_docs, rnd=1234)

    def resolve(self, doc: dict, spec, kind: str):
        """ConfigurableTask.doc_to_text / doc_to_target / doc_to_choice (kind "text", "target", "choice")."""
        if isinstance(spec, (int, list)):
            return spec
        if callable(spec):
            return spec(doc)
        if spec in doc:
            return doc[spec]
        rendered = self.lm.apply_template(spec, doc)
        if kind == "choice":
            return ast.literal_eval(rendered)
        if rendered.isdigit() and self.config.get("doc_to_choice") is not None:
            return ast.literal_eval(rendered)
        if kind == "target" and len(rendered) >= 2 and rendered[0] == "[" and rendered[-1] == "]":
            try:
                return ast.literal_eval(rendered)
            except (SyntaxError, ValueError):
                return rendered
        return rendered

    def text(self, doc):
        return self.resolve(doc, self.config["doc_to_text"], "text")

    def target(self, doc):
        return self.resolve(doc, self.config["doc_to_target"], "target")

    def choices(self, doc):
        spec = self.config.get("doc_to_choice")
        return None if spec is None else self.resolve(doc, spec, "choice")

    def qa_turn(self, q: str, c=None, a=None, tgt_delim=" ", few_delim="\n\n") -> list:
        """ConfigurableTask.build_qa_turn without a gen_prefix: the question with the target delimiter when an
        answer follows, then the answer (c[a] for an index) with the fewshot delimiter."""
        Message = self.lm.api_utils.Message
        has_answer = a is not None and a != ""
        turn = [Message("user", q, tgt_delim if has_answer else "")]
        if has_answer:
            turn.append(Message("assistant", c[a] if (c and isinstance(a, int)) else a[0] if isinstance(a, list)
                                else a, few_delim))
        return turn

    def requests(self, doc: dict, num_fewshot: int = 0) -> list[tuple[str, str]]:
        """fewshot_context then construct_requests: the (context, continuation) of each request of the doc."""
        description = self.config.get("description") or ""
        description = doc[description] if description in doc else self.lm.apply_template(description, doc)
        system = self.lm.api_utils.maybe_delimit(None, description, self.fewshot_delimiter)
        messages = [self.lm.api_utils.Message("system", system)] if system else []
        text, choices = self.text(doc), self.choices(doc)
        multiple_input = isinstance(text, int)
        if num_fewshot:
            for shot in self.sampler.sample(n=num_fewshot, eval_doc=None):
                q, c, a = self.text(shot), self.choices(shot), self.target(shot)
                if multiple_input:
                    q, c = c[q], None
                messages += self.qa_turn(q, c, a, self.target_delimiter, self.fewshot_delimiter)
        if self.config["output_type"] == "loglikelihood":
            return [("".join(m.to_text() for m in messages + self.qa_turn(text)), self.target(doc))]
        if multiple_input:  # multiple_input_context: each choice is a context; the target follows each
            contexts = ["".join(m.to_text() for m in messages + self.qa_turn(q, tgt_delim="")) for q in choices]
            return [(context, f"{self.target_delimiter}{self.target(doc)}") for context in contexts]
        context = "".join(m.to_text() for m in messages + self.qa_turn(text, choices, None, self.target_delimiter, ""))
        return [(context, f"{self.target_delimiter}{choice}") for choice in choices]

    def gold_and_lengths(self, doc: dict) -> tuple[int, tuple[int, ...]]:
        """process_results' gold (doc_to_text for multiple inputs, else doc_to_target; a string is looked up in the
        choices) and completion_len (each doc_to_choice string's length)."""
        choices = self.choices(doc)
        gold = self.text(doc) if isinstance(self.text(doc), int) else self.target(doc)
        if isinstance(gold, str):
            gold = choices.index(gold)
        return gold, tuple(len(choice) for choice in choices)


def lm_eval_documents(lm: LmEval, benchmark: Benchmark, documents: Documents) -> list[tuple[LmEvalTask, dict]]:
    """Each of our documents with the lm-eval task that builds its requests, after the task's process_docs where
    the file's rows are raw (HellaSwag's original file)."""
    if benchmark.name == "mmlu":
        tasks = {s: LmEvalTask(lm, lm.configs[f"mmlu/default/mmlu_{s}.yaml"], documents.shots[s])
                 for s in MMLU_SUBJECTS}
        return [(tasks[doc["subject"]], doc) for doc in documents.docs]
    task = LmEvalTask(lm, lm.configs[benchmark.yaml])
    docs = documents.docs
    if "process_docs" in task.config and not documents.format.processed:
        docs = list(task.config["process_docs"](lm.as_dataset(docs)))
    return [(task, doc) for doc in docs]


def check_requests(lm_docs: list, task: Task, chosen: list[int] | None = None) -> str | None:
    """Part 1: each item's requests, label and choice lengths against lm-eval's (lm_docs: lm_eval_documents' pairs,
    an item's at its index); every item, or those chosen; what differs, or None."""
    for i in range(len(task.items)) if chosen is None else chosen:
        (lm_task, doc), item = lm_docs[i], task.items[i]
        theirs = lm_task.requests(doc, task.num_fewshot)
        if theirs != item.requests():
            for c, (a, b) in enumerate(zip(item.requests(), theirs)):
                if a != b:
                    return f"item {i}, request {c}: ours {a!r} vs lm-eval's {b!r}"
            return f"item {i}: {len(item.requests())} requests (ours) vs {len(theirs)} (lm-eval's)"
        if task.kind != LOGLIKELIHOOD:
            gold, lengths = lm_task.gold_and_lengths(doc)
            if (item.label, tuple(map(len, item.choices))) != (gold, lengths):
                return (f"item {i}: label {item.label}, lengths {tuple(map(len, item.choices))} (ours) vs {gold}, "
                        f"{lengths} (lm-eval's)")
    return None


# ---- part 2: HFLM's log-likelihoods against ours

def picks(task: Task, count: int) -> list[int]:
    """The items part 2 scores: the first `count` (MMLU: the first of each subject, as many as make `count`)."""
    if not task.parts:
        return list(range(min(count, len(task.items))))
    each, chosen, first = -(-count // len(task.parts)), [], 0
    for _, size in task.parts:
        chosen += range(first, first + min(each, size))
        first += size
    return chosen


def instances(requests: list[list[tuple[str, str]]], task_name: str, instance_class) -> list:
    """HFLM.loglikelihood's input: one Instance per request, as construct_requests makes it (doc_id i, idx c)."""
    return [instance_class(request_type="loglikelihood", doc={}, arguments=arguments, idx=c, metadata=(task_name, i, 1))
            for i, item in enumerate(requests) for c, arguments in enumerate(item)]


def scores_from_results(task: Task, golds: list[tuple[int, tuple[int, ...]]], results: list) -> list[ItemScore]:
    """process_results of each item from loglikelihood's (log-likelihood, is_greedy) pairs, in the requests' order:
    multiple choice, the lls with lm-eval's gold and completion lengths; loglikelihood, the ll and is_greedy."""
    counts = [len(item.choices) for item in task.items]
    if len(results) != sum(counts):
        raise ValueError(f"{len(results)} results for {sum(counts)} requests")
    scores, first = [], 0
    for i, (count, (gold, lengths)) in enumerate(zip(counts, golds)):
        values = tuple(float(value) for value, _ in results[first:first + count])
        greedy = bool(results[first][1]) if task.kind == LOGLIKELIHOOD else None
        scores.append(ItemScore(i, gold, values, lengths, greedy))
        first += count
    return scores


def mismatch(ours: list[ItemScore], theirs: list[ItemScore], names: tuple[str, ...],
             tolerance: float = TOLERANCE) -> str | None:
    """One line on the first log-likelihood further than tolerance from lm-eval's, else on a metric differing
    (acc, acc_norm exactly; perplexity to tolerance, relative); None when they agree."""
    for o, t in zip(ours, theirs):
        for choice, (a, b) in enumerate(zip(o.loglikelihoods, t.loglikelihoods)):
            if not abs(a - b) <= tolerance:
                return (f"item {o.index}, choice {choice}: log-likelihood {a:.6f} (ours) vs {b:.6f} (lm-eval's HFLM), "
                        f"{abs(a - b):.2e} apart (tolerance {tolerance:.0e})")
    ours_m, theirs_m = metrics(ours, names), metrics(theirs, names)
    picked = {"acc": lambda s: s.correct if s.greedy is not None else s.prediction,
              "acc_norm": lambda s: s.prediction_norm}
    for name in names:
        if name == "perplexity":
            if not abs(ours_m[name] - theirs_m[name]) <= tolerance * theirs_m[name]:
                return f"perplexity {ours_m[name]:.4f} (ours) vs {theirs_m[name]:.4f} (lm-eval's HFLM)"
        elif ours_m[name] != theirs_m[name]:
            differ = sum(picked[name](o) != picked[name](t) for o, t in zip(ours, theirs))
            return (f"{name} {ours_m[name]:.4f} (ours) vs {theirs_m[name]:.4f} (lm-eval's HFLM); {differ} of "
                    f"{len(ours)} items differ")
    return None


def subset(task: Task, chosen: list[int]) -> Task:
    return dataclasses.replace(task, items=[task.items[i] for i in chosen], parts=())


def check_scores(lm_model, prepared: list, folder: Path, args) -> list[str]:
    """Part 2 on one folder: each task's picked items through HFLM and ours; a line for each task that differs."""
    from lm_eval.api.instance import Instance
    failures = []
    for benchmark, documents, task, lm_docs in prepared:
        chosen = picks(task, args.items)
        small = subset(task, chosen)
        lm_requests = [lm_docs[i][0].requests(lm_docs[i][1], task.num_fewshot) for i in chosen]
        golds = [lm_docs[i][0].gold_and_lengths(lm_docs[i][1]) if task.kind != LOGLIKELIHOOD else (0, (0,))
                 for i in chosen]
        start = time.perf_counter()
        results = lm_model.loglikelihood(instances(lm_requests, task.name, Instance), disable_tqdm=True)
        theirs, their_seconds = scores_from_results(small, golds, results), time.perf_counter() - start
        for dtype in ("fp32", *args.also_dtype):
            start = time.perf_counter()
            ours, _ = our_scores(folder, small, dtype, args.rows, args.device)
            our_seconds = time.perf_counter() - start
            worst = max(abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o.loglikelihoods, t.loglikelihoods))
            ours_m, theirs_m = metrics(ours, task.metrics), metrics(theirs, task.metrics)
            shown = ", ".join(f"{m} {ours_m[m]:.4f} vs {theirs_m[m]:.4f}" for m in task.metrics)
            print(f"  {task.name}: {len(chosen)} items, ours {dtype} vs lm-eval's HFLM fp32: largest log-likelihood "
                  f"difference {worst:.2e}; {shown} (HFLM {their_seconds:.1f} s, ours {our_seconds:.1f} s)", flush=True)
            failure = mismatch(ours, theirs, task.metrics) if dtype == "fp32" else None
            if failure:
                print(f"  FAIL {task.name}: {failure}", flush=True)
                failures.append(f"{task.name}: {failure}")
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task-source", default=str(EVALDATA) if EVALDATA.is_dir() else None,
                   help="a folder of the tasks' files (default: ../shared/evaldata where it is, else the downloads)")
    p.add_argument("--tasks", default=",".join(BENCHMARKS), help="comma-separated task names (default: all)")
    p.add_argument("--requests-only", action="store_true", help="part 1 only (no torch needed)")
    p.add_argument("--scored-only", action="store_true",
                   help="part 1 on the items part 2 scores only: every item's requests need no GPU (--requests-only "
                        "checks them on any machine), and take MMLU's 5-shot prompts a minute or more")
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: a random d12 of 2 layers)")
    p.add_argument("--tokenizer", default="data/tokenizer/tokenizer.model",
                   help="the Llama 3 tokenizer.model of the random folder")
    p.add_argument("--items", type=positive_int, default=500, help="part 2: items of each task (all of smaller sets)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where both sides run")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="HFLM's batch size (its fp32 log-probs of a batch of MMLU's 2k-token prompts: 8 GB at 8)")
    p.add_argument("--rows", type=positive_int, default=64, help="our rows a forward pass")
    p.add_argument("--also-dtype", nargs="*", default=[], choices=("bf16",), help="also report ours in these")
    args = p.parse_args(argv)
    if args.scored_only and args.requests_only:
        print("error: --scored-only limits part 1 to part 2's items; --requests-only runs no part 2", file=sys.stderr)
        return 2
    try:
        lm = LmEval()
    except ImportError as e:
        print(f"error: lm-eval cannot be imported ({e}); {WHEELS_HELP}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"error: --tasks {', '.join(unknown)}: not a task ({', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    print(f"lm_eval {version('lm_eval')}; files: {args.task_source or 'the downloads'}")
    prepared, failed = [], False
    for name in names:
        benchmark = BENCHMARKS[name]
        try:
            documents = load_documents(benchmark, None, args.task_source)
        except TaskError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        task, lm_docs = benchmark_task(benchmark, documents), lm_eval_documents(lm, benchmark, documents)
        chosen = picks(task, args.items) if args.scored_only else None
        failure = check_requests(lm_docs, task, chosen)
        checked = (f"the {len(chosen)} of {len(task.items)} items part 2 scores" if chosen is not None
                   else f"{len(task.items)} items")
        print(f"{name} ({documents.format.name}, {documents.path}): {checked}: "
              + (f"FAIL: {failure}" if failure else "every request, label and choice length as lm-eval's"), flush=True)
        failed |= failure is not None
        prepared.append((benchmark, documents, task, lm_docs))
    if failed or args.requests_only:
        print("FAIL: requests differ" if failed else "PASS: every request as lm-eval builds it")
        return 1 if failed else 0
    import torch
    from lm_eval.models.huggingface import HFLM
    print("versions: " + ", ".join(f"{n} {version(n)}" for n in ("lm_eval", "torch", "transformers")))
    torch.backends.cuda.matmul.allow_tf32 = False
    with tempfile.TemporaryDirectory() as workdir:
        folder = Path(args.model) if args.model else random_hf_folder(
            Path(workdir) / "check", CHECK_CONFIG, Llama3Tokenizer(args.tokenizer), torch.float32, 0.1, args.device)
        print(f"model: {args.model or 'random d12 of 2 layers'}; HFLM fp32 on {args.device}", flush=True)
        lm_model = HFLM(pretrained=str(folder), device=args.device, dtype="float32", batch_size=args.batch_size,
                        add_bos_token=False)
        failures = check_scores(lm_model, prepared, folder, args)
    if failures:
        print(f"FAIL: {len(failures)} of {len(prepared)} tasks differ; the first: {failures[0]}")
        return 1
    checked = "the scored items'" if args.scored_only else "every task's"
    print(f"PASS: {checked} requests as lm-eval's; every log-likelihood within {TOLERANCE:.0e} of HFLM's, the same "
          "acc, acc_norm and greedy matches, perplexity to 1e-3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
