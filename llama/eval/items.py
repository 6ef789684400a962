"""What every evaluation task is made of: items as lm-evaluation-harness 0.4 turns a document into loglikelihood
requests, a task (its items, what it reports, its chance level), and the one-line error of a task that cannot be
loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

TARGET_DELIMITER = " "  # lm-eval's default target_delimiter, between a context and its continuation
MULTIPLE_CHOICE, LOGLIKELIHOOD = "multiple_choice", "loglikelihood"  # lm-eval's output types


class TaskError(ValueError):
    """A task that cannot be loaded; the message (one line) says why and, where it can, what to do."""


@dataclass(frozen=True)
class Item:
    """One document's requests as lm-eval builds them. choices are doc_to_choice's strings; choice k is the
    continuation TARGET_DELIMITER + choices[k] after the context, or, with a shared continuation (lm-eval's
    multiple inputs: Winogrande's partial scoring), the continuation TARGET_DELIMITER + continuation after the
    context + choices[k]. label is the right choice's index."""
    context: str
    choices: tuple[str, ...]
    label: int
    continuation: str | None = None

    def requests(self) -> list[tuple[str, str]]:
        """(context, continuation) of each choice: lm-eval's Instance arguments."""
        if self.continuation is None:
            return [(self.context, TARGET_DELIMITER + choice) for choice in self.choices]
        return [(self.context + choice, TARGET_DELIMITER + self.continuation) for choice in self.choices]


@dataclass(frozen=True)
class Task:
    """A task's items. kind: MULTIPLE_CHOICE (acc from the largest log-likelihood, acc_norm from the largest per
    character) or LOGLIKELIHOOD (one continuation an item: acc is a greedy match, and perplexity); metrics: what
    lm-eval's task reports; parts: named runs of consecutive items reported on their own as well (MMLU's
    subjects), as (name, count); original: the number of items before a --limit took the first ones."""
    name: str
    items: list[Item]
    kind: str = MULTIPLE_CHOICE
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    log_key: str = ""
    parts: tuple[tuple[str, int], ...] = field(default=())
    num_fewshot: int = 0
    original: int = 0

    def __post_init__(self):
        if not self.log_key:
            object.__setattr__(self, "log_key", self.name)
        if not self.original:
            object.__setattr__(self, "original", len(self.items))

    @property
    def chance(self) -> float:
        """The accuracy of a uniform random guess: the mean of 1 / choices (0 for a greedy match)."""
        if self.kind == LOGLIKELIHOOD:
            return 0.0
        return sum(1 / len(item.choices) for item in self.items) / len(self.items)

    def limited(self, limit: int | None) -> "Task":
        """The first `limit` items (all of them for None); with parts, the first `limit` of each, as lm-eval's
        --limit takes them from each of MMLU's subtasks."""
        if not limit or limit >= len(self.items):
            return self
        if not self.parts:
            return replace(self, items=self.items[:limit])
        items, parts, first = [], [], 0
        for name, count in self.parts:
            items += self.items[first:first + min(count, limit)]
            parts.append((name, min(count, limit)))
            first += count
        return replace(self, items=items, parts=tuple(parts))


def read_jsonl(path: Path, text: str | None = None) -> list[tuple[int, object]]:
    """(line number, value) of each non-blank line of the file (or of `text`, read from it); TaskError naming the
    line that is not JSON."""
    try:
        lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}:{number}: not JSON ({e.msg})") from None
    return rows
