"""Scoring as lm-evaluation-harness 0.4.x scores a multiple_choice task with a Hugging Face causal model:

- each choice is a request (context, " " + choice); the context's trailing spaces move to the
  continuation; the continuation's tokens are those of encode(context + continuation) past the first
  len(encode(context)); the model reads context tokens then continuation tokens, with no BOS (HFLM's
  default for causal models);
- a request longer than the window T + 1 loses tokens from the left; the model reads all but its last
  token and the continuation's log-likelihood is the sum of the log-probs of its tokens;
- acc: the argmax of the log-likelihoods is the label; acc_norm: the argmax of each divided by its
  choice's length in characters (lm-eval's completion_len, the choice without the delimiter);
- the standard error of a mean of 0/1 scores is the sample standard deviation over sqrt(n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .tasks import TARGET_DELIMITER, Item


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's HFLM._encode_pair: (context ids, continuation ids) split at the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


@dataclass(frozen=True)
class Request:
    """One choice of one item as the model reads it: inputs (at most T ids), their next ids, and where
    the continuation's targets are: inputs[start:] predict them."""
    item: int
    choice: int
    inputs: list[int]
    targets: list[int]
    start: int


def make_request(tokenizer, item: Item, index: int, choice: int, T: int) -> Request:
    context, continuation = encode_pair(tokenizer, item.context, TARGET_DELIMITER + item.choices[choice])
    if not continuation or len(continuation) > T:
        raise ValueError(f"item {index}, choice {choice}: its continuation has {len(continuation)} tokens; "
                         f"it must have 1 to {T} (the window)")
    window = (context + continuation)[-(T + 1):]
    return Request(index, choice, window[:-1], window[1:], len(window) - 1 - len(continuation))


def item_requests(tokenizer, items: list[Item], T: int, first_index: int = 0, step: int = 1) -> list[Request]:
    """Every choice of every item (numbered first_index, first_index + step, ...)."""
    return [make_request(tokenizer, item, first_index + i * step, c, T)
            for i, item in enumerate(items) for c in range(len(item.choices))]


@dataclass
class Pass:
    """One forward pass: (b, t) tokens and targets, zero-padded on the right, and the requests of its rows."""
    tokens: np.ndarray
    targets: np.ndarray
    requests: list[Request]


def make_passes(requests: list[Request], B: int, pad_to: int = 8) -> list[Pass]:
    """The requests, longest first (lm-eval's order), B rows a pass, each pass as long as its longest
    row rounded up to a multiple of pad_to (not past the longest request)."""
    ordered = sorted(requests, key=lambda r: -len(r.inputs))
    passes = []
    for first in range(0, len(ordered), B):
        rows = ordered[first:first + B]
        longest = len(rows[0].inputs)
        t = min(-(-longest // pad_to) * pad_to, len(ordered[0].inputs))
        tokens, targets = np.zeros((len(rows), t), np.int32), np.zeros((len(rows), t), np.int32)
        for row, request in enumerate(rows):
            tokens[row, :len(request.inputs)] = request.inputs
            targets[row, :len(request.targets)] = request.targets
        passes.append(Pass(tokens, targets, rows))
    return passes


def pass_loglikelihoods(passed: Pass, losses: np.ndarray) -> list[float]:
    """Each row's continuation log-likelihood, from the (b, t) per-token losses of the pass."""
    return [-float(np.sum(losses[row, r.start:len(r.inputs)], dtype=np.float64))
            for row, r in enumerate(passed.requests)]


@dataclass(frozen=True)
class ItemScore:
    index: int
    label: int
    loglikelihoods: tuple[float, ...]
    lengths: tuple[int, ...]  # each choice's length in characters

    @property
    def prediction(self) -> int:
        return int(np.argmax(self.loglikelihoods))

    @property
    def prediction_norm(self) -> int:
        return int(np.argmax(np.array(self.loglikelihoods) / np.array(self.lengths, dtype=np.float64)))

    def record(self) -> dict:
        """The item as a JSONL line of the per-example scores."""
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


def metrics(scores: list[ItemScore]) -> dict[str, float]:
    """acc, acc_stderr, acc_norm, acc_norm_stderr over the items."""
    acc = mean_and_stderr([float(s.prediction == s.label) for s in scores])
    acc_norm = mean_and_stderr([float(s.prediction_norm == s.label) for s in scores])
    return {"acc": acc[0], "acc_stderr": acc[1], "acc_norm": acc_norm[0], "acc_norm_stderr": acc_norm[1]}
