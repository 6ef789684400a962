"""Scoring as lm-evaluation-harness 0.4.x scores a task with a Hugging Face causal model (HFLM):

- each choice is a request (context, continuation) (llama/eval/items.py); the context's trailing spaces move to
  the continuation; the continuation's tokens are those of encode(context + continuation) past the first
  len(encode(context)); the model reads context tokens then continuation tokens, with no BOS (HFLM's default
  for causal models);
- a request longer than the window T + 1 loses tokens from the left; the model reads all but its last token, and
  the continuation's log-likelihood is the sum of the log-probs of its tokens; it is a greedy match when each of
  its tokens is the argmax of the logits before it;
- requests that read the same tokens and continue with one token (MMLU's " A" .. " D", BoolQ's " no" / " yes")
  are one row, scored from its last position's logits, as HFLM's logits cache does;
- multiple choice: acc takes the argmax of the log-likelihoods, acc_norm the argmax of each divided by its
  choice's length in characters (completion_len: doc_to_choice's string, without the delimiter);
  loglikelihood (LAMBADA): acc is the greedy match, perplexity exp(-mean log-likelihood);
- the standard error of a mean of 0/1 scores is the sample standard deviation over sqrt(n); that of perplexity
  (which lm-eval bootstraps) here by the delta method, perplexity times the standard error of the mean
  log-likelihood;
- a suite's summary is the mean over its tasks of the centered accuracy (acc - chance) / (1 - chance), chance
  being a uniform guess's accuracy (1 / choices, 0 for a greedy match).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .items import Item, Task


# where a line begins with a non-space character: the Llama 3 split pattern (llama/data/tokenizer.py) ends a piece
# there whatever follows, since none of its alternatives matches a line break followed by a non-space (its letters
# and digits take no line break, its punctuation ends with the breaks, its spaces take no non-space) and none looks
# past the character after its match; so a text's tokens are its lines' tokens one after the other (Python's \S:
# not str.isspace, which holds for every character the pattern's \s takes)
LINE_START = re.compile(r"(?<=[\r\n])(?=\S)")


class LineTokens:
    """A tokenizer's encode() of many texts that share lines (MMLU's few shots), each line encoded once."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lines, self.contexts = tokenizer, {}, {}

    def line(self, line: str) -> list[int]:
        if (ids := self.lines.get(line)) is None:
            ids = self.lines[line] = self.tokenizer.encode(line)
        return ids

    def context(self, context: str) -> tuple[list[int], str]:
        """The context's ids and its last line."""
        if (known := self.contexts.get(context)) is None:
            lines = LINE_START.split(context)
            known = self.contexts[context] = ([i for line in lines for i in self.line(line)], lines[-1])
        return known


def encode_pair(tokenizer, context: str, continuation: str,
                lines: LineTokens | None = None) -> tuple[list[int], list[int]]:
    """lm-eval's HFLM._encode_pair: (context ids, continuation ids), those of encode(context + continuation) past
    the context's; with lines, the same ids from the context's lines and its last line with the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if lines is None:
        context_ids = tokenizer.encode(context)
        return context_ids, tokenizer.encode(context + continuation)[len(context_ids):]
    context_ids, last = lines.context(context)
    return context_ids, tokenizer.encode(last + continuation)[len(lines.line(last)):]


@dataclass(frozen=True)
class Request:
    """One choice of one item as the model reads it: inputs (at most T ids), their next ids, and where
    the continuation's targets are: inputs[start:] predict them."""
    item: int
    choice: int
    inputs: list[int]
    targets: list[int]
    start: int


def make_request(tokenizer, item: Item, index: int, choice: int, T: int, lines: LineTokens | None = None) -> Request:
    context, continuation = encode_pair(tokenizer, *item.requests()[choice], lines)
    if not continuation or len(continuation) > T:
        raise ValueError(f"item {index}, choice {choice}: its continuation has {len(continuation)} tokens; "
                         f"it must have 1 to {T} (the window)")
    window = (context + continuation)[-(T + 1):]
    return Request(index, choice, window[:-1], window[1:], len(window) - 1 - len(continuation))


def item_requests(tokenizer, items: list[Item], T: int, first_index: int = 0, step: int = 1) -> list[Request]:
    """Every choice of every item (numbered first_index, first_index + step, ...); the contexts encoded line by
    line where the tokenizer's pieces end at line starts (LineTokens), else each request's whole text."""
    lines = LineTokens(tokenizer) if getattr(tokenizer, "splits_at_line_starts", False) else None
    return [make_request(tokenizer, item, first_index + i * step, c, T, lines)
            for i, item in enumerate(items) for c in range(len(item.choices))]


@dataclass
class Pass:
    """One forward pass: (b, t) tokens and targets, zero-padded on the right, and the requests of its rows. With
    logits, it is scored from the logits at the continuations' positions (greedy matches; shared: the other
    requests each row answers, which read the same tokens and continue with one token)."""
    tokens: np.ndarray
    targets: np.ndarray
    requests: list[Request]
    logits: bool = False
    shared: list[list[Request]] | None = None

    @property
    def answered(self) -> int:
        return len(self.requests) + sum(map(len, self.shared or []))


def share_key(request: Request) -> tuple | None:
    """What requests that can share a row have in common: the tokens read, for a one-token continuation."""
    return tuple(request.inputs) if len(request.inputs) - request.start == 1 else None


def shareable(requests: list[Request]) -> tuple[list[Request], list[Request]]:
    """(the requests that read the same tokens as another and continue with one token, the others)."""
    counts = {}
    for request in requests:
        counts[share_key(request)] = counts.get(share_key(request), 0) + 1
    shared = [r for r in requests if share_key(r) is not None and counts[share_key(r)] > 1]
    return shared, [r for r in requests if share_key(r) is None or counts[share_key(r)] == 1]


def share_rows(requests: list[Request]) -> tuple[list[Request], dict[int, list[Request]]]:
    """The requests that need a row (the first of those reading the same tokens with a one-token continuation),
    and for each such row (by id of its request) the others it answers."""
    rows, shared, first = [], {}, {}
    for request in requests:
        key = share_key(request)
        if key is not None and key in first:
            shared[id(first[key])].append(request)
            continue
        if key is not None:
            first[key] = request
            shared[id(request)] = []
        rows.append(request)
    return rows, shared


def make_passes(requests: list[Request], B: int, pad_to: int = 8, logits: bool = False) -> list[Pass]:
    """The requests, longest first (lm-eval's order), B rows a pass, each pass as long as its longest
    row rounded up to a multiple of pad_to (not past the longest request). With logits, requests that read the
    same tokens and continue with one token share a row."""
    rows, shared = share_rows(requests) if logits else (requests, {})
    ordered = sorted(rows, key=lambda r: -len(r.inputs))
    passes = []
    for first in range(0, len(ordered), B):
        chunk = ordered[first:first + B]
        longest = len(chunk[0].inputs)
        t = min(-(-longest // pad_to) * pad_to, len(ordered[0].inputs))
        tokens, targets = np.zeros((len(chunk), t), np.int32), np.zeros((len(chunk), t), np.int32)
        for row, request in enumerate(chunk):
            tokens[row, :len(request.inputs)] = request.inputs
            targets[row, :len(request.targets)] = request.targets
        passes.append(Pass(tokens, targets, chunk, logits, [shared.get(id(r), []) for r in chunk] if logits else None))
    return passes


def pass_loglikelihoods(passed: Pass, losses: np.ndarray) -> list[float]:
    """Each row's continuation log-likelihood, from the (b, t) per-token losses of the pass."""
    return [-float(np.sum(losses[row, r.start:len(r.inputs)], dtype=np.float64))
            for row, r in enumerate(passed.requests)]


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """(b,) log of the sum of exp over each row of (b, V) float32 logits: the exponentials in float32, their sum in
    float64 (a third of a float64 log_softmax's time, which a row's few targets do not need), exponentiated in place
    (one temporary of the logits' size, not two)."""
    top = logits.max(-1, keepdims=True)
    shifted = logits - top
    np.exp(shifted, out=shifted)
    return top[:, 0].astype(np.float64) + np.log(shifted.sum(-1, dtype=np.float64))


def pass_logit_scores(passed: Pass, read_logits) -> list[tuple[Request, float, bool]]:
    """(request, log-likelihood, greedy match) of every request the pass answers, from read_logits(positions, rows),
    the logits at one position of each row whose continuation (or a shared one's) reaches that far."""
    rows = passed.requests
    answers = [[r, *others] for r, others in zip(rows, passed.shared or [[] for _ in rows])]
    reach = np.array([max(len(r.inputs) - r.start for r in answer) for answer in answers])
    loglikelihood = {id(r): 0.0 for answer in answers for r in answer}
    greedy = {id(r): True for answer in answers for r in answer}
    for k in range(int(reach.max())):
        active = np.flatnonzero(reach > k)
        positions = np.array([min(rows[row].start + k, len(rows[row].inputs) - 1) for row in active])
        logits = read_logits(positions, rows=active).astype(np.float32, copy=False)
        lse, best = logsumexp(logits), np.argmax(logits, axis=-1)
        for i, row in enumerate(active):
            for r in answers[row]:
                if r.start + k < len(r.inputs):
                    target = r.targets[r.start + k]
                    loglikelihood[id(r)] += float(logits[i, target]) - float(lse[i])
                    greedy[id(r)] &= bool(best[i] == target)
    return [(r, loglikelihood[id(r)], greedy[id(r)]) for answer in answers for r in answer]


@dataclass(frozen=True)
class ItemScore:
    index: int
    label: int
    loglikelihoods: tuple[float, ...]
    lengths: tuple[int, ...]  # each choice's length in characters
    greedy: bool | None = None  # a loglikelihood task's greedy match

    @property
    def prediction(self) -> int:
        return int(np.argmax(self.loglikelihoods))

    @property
    def prediction_norm(self) -> int:
        return int(np.argmax(np.array(self.loglikelihoods) / np.array(self.lengths, dtype=np.float64)))

    @property
    def correct(self) -> bool:
        """acc's 1 or 0: the right choice has the largest log-likelihood, or the continuation is the greedy one."""
        return self.greedy if self.greedy is not None else self.prediction == self.label

    def record(self) -> dict:
        """The item as a JSONL line of the per-example scores."""
        if self.greedy is not None:
            return {"index": self.index, "loglikelihood": self.loglikelihoods[0], "greedy": self.greedy,
                    "acc": int(self.greedy)}
        return {"index": self.index, "label": self.label, "loglikelihoods": list(self.loglikelihoods),
                "pred": self.prediction, "pred_norm": self.prediction_norm,
                "acc": int(self.prediction == self.label), "acc_norm": int(self.prediction_norm == self.label)}


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """lm-eval's mean and its standard error (sample stddev / sqrt(n); nan for fewer than 2)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def metrics(scores: list[ItemScore], names: tuple[str, ...] = ("acc", "acc_norm")) -> dict[str, float]:
    """Each of the named metrics (acc, acc_norm, perplexity) over the items, with its standard error
    (<name>_stderr)."""
    values = {"acc": lambda: [float(s.correct) for s in scores],
              "acc_norm": lambda: [float(s.prediction_norm == s.label) for s in scores]}
    out = {}
    for name in names:
        if name == "perplexity":
            mean, stderr = mean_and_stderr([s.loglikelihoods[0] for s in scores])
            out["perplexity"], out["perplexity_stderr"] = math.exp(-mean), math.exp(-mean) * stderr
        else:
            out[name], out[f"{name}_stderr"] = mean_and_stderr(values[name]())
    return out


def task_metrics(task: Task, scores: list[ItemScore]) -> dict[str, float]:
    """The metrics lm-eval reports for the task (a user task: acc and acc_norm)."""
    return metrics(scores, task.metrics)


def centered(acc: float, chance: float) -> float:
    """(acc - chance) / (1 - chance): 0 at chance, 1 when every item is right."""
    return (acc - chance) / (1 - chance)


def suite_score(results: list[tuple[Task, float]]) -> float:
    """The mean over the tasks of their centered accuracy, from (task, acc) pairs."""
    return sum(centered(acc, task.chance) for task, acc in results) / len(results)
