"""A task run on a model: the items tokenized once into passes of B rows of at most T tokens, each pass one
forward with targets whose per-token losses (Model.token_losses) give the choices' log-likelihoods.

On several GPUs each rank scores its share of the items (every world-th, from its rank) in the same number
of passes, padding with tiny ones, since the forward's collectives must match on every rank; the counts of
right answers are then summed over the ranks (accuracy_over_ranks).
"""

from __future__ import annotations

import math

import numpy as np

from .scoring import ItemScore, item_requests, make_passes, pass_loglikelihoods
from .tasks import Task

FILLER_PASS = (np.zeros((1, 8), np.int32), np.zeros((1, 8), np.int32))  # a rank's pass past its share


class Evaluation:
    """A task prepared for a model with batches of up to (B, T), on rank `rank` of `world`."""

    def __init__(self, task: Task, tokenizer, B: int, T: int, rank: int = 0, world: int = 1):
        self.task = task
        share = task.items[rank::world]
        self.items = {rank + i * world: item for i, item in enumerate(share)}
        self.passes = make_passes(item_requests(tokenizer, share, T, rank, world), B)
        self.rows = sum(len(p.requests) for p in self.passes)
        self.pass_count = max(math.ceil(sum(len(item.choices) for item in task.items[r::world]) / B)
                              for r in range(world))

    def run(self, model, on_pass=None) -> list[ItemScore]:
        """Score this rank's items with the model (which keeps its weights; on_pass(rows) after each pass)."""
        loglikelihoods = {}
        for passed in self.passes:
            model.forward(passed.tokens, passed.targets)
            for request, value in zip(passed.requests, pass_loglikelihoods(passed, model.token_losses())):
                loglikelihoods[request.item, request.choice] = value
            if on_pass is not None:
                on_pass(len(passed.requests))
        for _ in range(self.pass_count - len(self.passes)):
            model.forward(*FILLER_PASS)
        return [ItemScore(index, item.label, tuple(loglikelihoods[index, c] for c in range(len(item.choices))),
                          tuple(len(choice) for choice in item.choices)) for index, item in self.items.items()]


def accuracy_over_ranks(scores: list[ItemScore], comm=None) -> tuple[float, float]:
    """(acc, acc_norm) over every rank's items (comm None: this process's)."""
    counts = [sum(s.prediction == s.label for s in scores), sum(s.prediction_norm == s.label for s in scores),
              len(scores)]
    if comm is not None:
        counts = comm.host_reduce(counts)
    return float(counts[0]) / counts[2], float(counts[1]) / counts[2]
