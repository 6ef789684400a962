"""A task run on a model: the items tokenized once into passes of up to B rows of at most T tokens, each pass one
forward whose per-token losses (Model.token_losses) give the choices' log-likelihoods, or, for the rows scored
from the logits (greedy matches; rows that answer several one-token continuations), one forward without targets
whose logits at the continuations' positions (Model.read_logits) give them.

On several GPUs each rank scores its share of the items (every world-th, from its rank) in the same number
of passes, padding with tiny ones, since the forward's collectives must match on every rank; the counts of
right answers are then summed over the ranks (accuracy_over_ranks). There every row is scored from the losses:
a task that needs the logits (a greedy match) runs on one process only.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass

import numpy as np

from ..runtime.progress import phase
from .items import LOGLIKELIHOOD, Task, TaskError
from .scoring import ItemScore, item_requests, make_passes, pass_loglikelihoods, pass_logit_scores, shareable

FILLER_PASS = (np.zeros((1, 8), np.int32), np.zeros((1, 8), np.int32))  # a rank's pass past its share
DEFAULT_ROWS = {"cuda": 128, "cpu": 8}  # rows (choices) a forward pass
DEFAULT_TOKENS = {"cuda": 65_536, "cpu": 4_096}  # at most this many tokens a pass (fewer rows where rows are long)


class Evaluation:
    """A task prepared for a model with batches of up to (B, T), on rank `rank` of `world`. max_tokens: fewer
    rows a pass where the task's rows are long, B times the longest row at most that many tokens. logits: rows
    may be scored from the logits (default: on one process), which a loglikelihood task needs."""

    def __init__(self, task: Task, tokenizer, B: int, T: int, rank: int = 0, world: int = 1,
                 logits: bool | None = None, max_tokens: int | None = None):
        self.task = task
        logits = world == 1 if logits is None else logits
        if task.kind == LOGLIKELIHOOD and not logits:
            raise TaskError(f"{task.name} scores greedy matches from the logits, which a run on several GPUs does not "
                            "read; evaluate it on one (scripts/eval.py)")
        share = task.items[rank::world]
        self.items = {rank + i * world: item for i, item in enumerate(share)}
        try:
            requests = item_requests(tokenizer, share, T, rank, world)
        except ValueError as e:
            raise ValueError(f"{task.name}: {e}") from None
        longest = -(-max((len(r.inputs) for r in requests), default=1) // 8) * 8
        self.B = min(B, max(1, max_tokens // longest)) if max_tokens else B
        if task.kind == LOGLIKELIHOOD:
            self.passes = make_passes(requests, self.B, logits=True)
        else:  # one row for the requests that read the same tokens and continue with one token (MMLU's letters)
            shared, alone = shareable(requests) if logits else ([], requests)
            self.passes = make_passes(alone, self.B) + make_passes(shared, self.B, logits=True)
        self.rows = len(requests)
        self.pass_count = max(math.ceil(sum(len(item.choices) for item in task.items[r::world]) / self.B)
                              for r in range(world)) if world > 1 else len(self.passes)

    @property
    def T(self) -> int:
        """The longest pass's length: the T a model built for this evaluation needs."""
        return max((p.tokens.shape[1] for p in self.passes), default=8)

    def run(self, model, on_pass=None) -> list[ItemScore]:
        """Score this rank's items with the model (which keeps its weights; on_pass(requests) after each pass)."""
        loglikelihoods, greedy = {}, {}
        for passed in self.passes:
            if passed.logits:
                model.forward(passed.tokens)
                for request, value, match in pass_logit_scores(passed, model.read_logits):
                    loglikelihoods[request.item, request.choice] = value
                    greedy[request.item, request.choice] = match
            else:
                model.forward(passed.tokens, passed.targets)
                for request, value in zip(passed.requests, pass_loglikelihoods(passed, model.token_losses())):
                    loglikelihoods[request.item, request.choice] = value
            if on_pass is not None:
                on_pass(passed.answered)
        for _ in range(self.pass_count - len(self.passes)):
            model.forward(*FILLER_PASS)
        loglikelihood = self.task.kind == LOGLIKELIHOOD
        return [ItemScore(index, item.label, tuple(loglikelihoods[index, c] for c in range(len(item.choices))),
                          tuple(len(choice) for choice in item.choices), greedy[index, 0] if loglikelihood else None)
                for index, item in self.items.items()]


def accuracy_over_ranks(scores: list[ItemScore], comm=None) -> tuple[float, float]:
    """(acc, acc_norm) over every rank's items (comm None: this process's)."""
    counts = [sum(s.correct for s in scores), sum(s.prediction_norm == s.label for s in scores), len(scores)]
    if comm is not None:
        counts = comm.host_reduce(counts)
    return float(counts[0]) / counts[2], float(counts[1]) / counts[2]


@dataclass
class TaskRun:
    """A task's scores on a model, and the seconds spent tokenizing it, building a model for it (0 when the last
    one served) and scoring it."""
    task: Task
    scores: list[ItemScore]
    tokenizing: float
    building: float
    scoring: float


def run_tasks(tasks: list[Task], tokenizer, build, B: int, T: int, max_tokens: int) -> list[TaskRun]:
    """Each task on one process, its passes of up to B rows of at most max_tokens tokens in all; build(B, T) makes
    a model for a task's passes, kept for the next tasks while theirs fit it. Each phase shows its progress
    (llama/progress.py: a bar on a terminal, lines in a log)."""
    runs, model, shape = [], None, (0, 0)
    for task in tasks:
        began = time.perf_counter()
        with phase(f"{task.name}: tokenizing {len(task.items):,} items"):
            evaluation = Evaluation(task, tokenizer, B, T, max_tokens=max_tokens)
        tokenized = time.perf_counter()
        if evaluation.B > shape[0] or evaluation.T > shape[1]:
            model = None
            gc.collect()  # the last model's buffers go before the next one's are allocated
            shape = (evaluation.B, evaluation.T)
            model = build(*shape)
            model.forward(*FILLER_PASS)  # loads the kernels, which the scoring's time leaves out
        built = time.perf_counter()
        with phase(f"{task.name}: scoring", total=evaluation.rows, unit="choice") as progress:
            scores = evaluation.run(model, progress.update)
        runs.append(TaskRun(task, scores, tokenized - began, built - tokenized, time.perf_counter() - built))
    return runs
