"""Scores in lm-evaluation-harness 0.4's results layout, which dashboards and comparison scripts read:
"results" per task ("<metric>,none" and "<metric>_stderr,none", "alias", "sample_len"), "groups" for MMLU (its
subjects as tasks, its four categories and itself as groups: the mean weighted by size, the pooled standard
error, lm_eval/api/group.py's aggregate) and for the suite, "group_subtasks", "n-shot", "higher_is_better",
"n-samples", "versions" and "config".
"""

from __future__ import annotations

import math

from .benchmarks import MMLU_CATEGORIES
from .items import Task
from .scoring import ItemScore, metrics, suite_score

HIGHER_IS_BETTER = {"acc": True, "acc_norm": True, "perplexity": False, "centered_acc": True}
SUITE_METRIC = "centered_acc"  # the suite's summary: the mean over its tasks of (acc - chance) / (1 - chance)


def pooled_stderr(stderrs: list[float], sizes: list[int]) -> float:
    """lm_eval/api/metrics.py's pooled_sample_stderr: a size-weighted group's standard error."""
    variance = sum((n - 1) * s ** 2 * n for n, s in zip(sizes, stderrs)) / (sum(sizes) - len(sizes))
    return math.sqrt(variance / sum(sizes))


def entry(name: str, values: dict[str, float], size: int, alias: str | None = None) -> dict:
    """A task's or group's "results" entry."""
    out = {"name": name, "alias": alias or name, "sample_len": size}
    for metric, value in values.items():
        out[f"{metric},none"] = value if math.isfinite(value) else "N/A"
    return out


def group_values(members: list[tuple[dict[str, float], int]], metric: str) -> dict[str, float]:
    """A size-weighted group's metric and its pooled standard error, from (member's values, size) pairs."""
    sizes = [size for _, size in members]
    value = sum(values[metric] * size for values, size in members) / sum(sizes)
    stderrs = [values[f"{metric}_stderr"] for values, _ in members]
    usable = all(math.isfinite(s) for s in stderrs) and sum(sizes) > len(sizes)
    return {metric: value, f"{metric}_stderr": pooled_stderr(stderrs, sizes) if usable else float("nan")}


def parts_results(task: Task, scores: list[ItemScore], out: dict) -> dict[str, float]:
    """MMLU's subjects as tasks and its categories and itself as groups, into `out` (name -> entry); the task's
    own values (acc over every item, weighted by size as lm-eval's mmlu group is)."""
    subjects, first = {}, 0
    for name, count in task.parts:
        if count:
            subjects[name] = (metrics(scores[first:first + count], task.metrics), count)
            out["results"][name] = entry(name, subjects[name][0], count, " - " + name.removeprefix("mmlu_"))
            out["n-shot"][name] = task.num_fewshot
            out["n-samples"][name] = {"original": count, "effective": count}
            out["higher_is_better"][name] = {m: HIGHER_IS_BETTER[m] for m in task.metrics}
        first += count
    categories = []
    for category, names in MMLU_CATEGORIES.items():
        members = [subjects[f"mmlu_{s}"] for s in names.split() if f"mmlu_{s}" in subjects]
        if members:
            group = f"{task.name}_{category}"
            values = group_values(members, "acc")
            size = sum(n for _, n in members)
            out["results"][group] = out["groups"][group] = entry(group, values, size, category)
            out["group_subtasks"][group] = [f"mmlu_{s}" for s in names.split() if f"mmlu_{s}" in subjects]
            categories.append((values, size, group))
    out["group_subtasks"][task.name] = [group for *_, group in categories]
    return group_values([(values, size) for values, size, _ in categories], "acc")


def results_json(evaluated: list[tuple[Task, list[ItemScore]]], config: dict, suite: str | None = None) -> dict:
    """lm-eval's results dict of the evaluated tasks (with a suite, its summary as a group over them)."""
    out = {"results": {}, "groups": {}, "group_subtasks": {}, "versions": {}, "n-shot": {}, "higher_is_better": {},
           "n-samples": {}, "config": config}
    for task, scores in evaluated:
        values = parts_results(task, scores, out) if task.parts else metrics(scores, task.metrics)
        out["results"][task.name] = entry(task.name, values, len(scores))
        if task.parts:
            out["groups"][task.name] = out["results"][task.name]
        else:
            out["group_subtasks"][task.name] = []
        out["versions"][task.name] = 1.0
        out["n-shot"][task.name] = task.num_fewshot
        out["higher_is_better"][task.name] = {m: HIGHER_IS_BETTER[m] for m in task.metrics}
        out["n-samples"][task.name] = {"original": task.original, "effective": len(scores)}
    if suite is not None:
        score = suite_score([(t, out["results"][t.name]["acc,none"]) for t, _ in evaluated])
        summary = {SUITE_METRIC: score, f"{SUITE_METRIC}_stderr": float("nan")}
        out["results"][suite] = out["groups"][suite] = entry(suite, summary, sum(len(s) for _, s in evaluated))
        out["group_subtasks"][suite] = [t.name for t, _ in evaluated]
        out["higher_is_better"][suite] = {SUITE_METRIC: True}
    if not out["groups"]:
        del out["groups"]
    return out
