"""Tasks by name: the standard ones (llama/eval/benchmarks.py: hellaswag, arc_easy, arc_challenge, piqa,
winogrande, openbookqa, copa, boolq, lambada_openai, mmlu), "suite" for all of them, or a user's JSONL of
{"context": ..., "choices": [...], "label": k}, scored as an lm-eval multiple_choice task (choice k is the
continuation " " + choices[k]).

A standard task's file is its original public file, downloaded on first use into eval/ of the per-user cache
(llama/eval/files.py), unless the source option names a mirror (a base URL serving the same paths), a local copy
(the original, llm-foundry's JSONL, or for HellaSwag llama.cpp's text) or a folder holding one.
"""

from __future__ import annotations

from pathlib import Path

from .benchmarks import (BENCHMARKS, MMLU_SUBJECTS, Benchmark, Documents, benchmark_items, index, read_documents,
                         strings, text)
from .files import downloaded, find_copy, git_blob_id, is_url
from .items import MULTIPLE_CHOICE, Item, Task, TaskError, read_jsonl

SUITE = "suite"  # every standard task; the summary is the mean of their centered accuracies
TASK_NAMES = (*BENCHMARKS, SUITE)


def copy_names(benchmark: Benchmark) -> tuple[str, ...]:
    return tuple(name for fmt in benchmark.formats for name in fmt.names)


def locate(benchmark: Benchmark, data_dir, source: str | None, option: str) -> tuple[Path, bool]:
    """(the task's file, whether it is a download of ours): downloaded (from source when a mirror's URL), or the
    local copy source names, or found in the folder it names."""
    names = copy_names(benchmark)
    if source is None or is_url(source):
        hint = f"; or name a copy ({', '.join(names)}) or a folder holding one with {option}"
        return [downloaded(s, data_dir, source, hint) for s in benchmark.sources][0], True
    path = Path(source)
    if path.is_dir():
        found = find_copy(path, names)
        if found is None:
            raise TaskError(f"{option} {source}: this folder holds no copy of {benchmark.name} (looked for "
                            f"{', '.join(names)})")
        return (found.parents[1] if found.suffix == ".csv" else found), False  # MMLU: the folder of dev/, test/
    if not path.is_file():
        raise TaskError(f"{option} {source}: no such file or folder")
    return path, False


def load_documents(benchmark: Benchmark, data_dir=None, source: str | None = None,
                   option: str = "--task-source") -> Documents:
    """The task's documents from its file (see the module's docstring); a download that is not the task's file is
    deleted, and a local copy in the original format is checked against the pinned git blob id where one is."""
    path, fetched = locate(benchmark, data_dir, source, option)
    try:
        documents = read_documents(benchmark, path)
    except TaskError as e:
        if fetched:
            path.unlink()
            raise TaskError(f"{e}; the download was deleted (rerun to download it again)") from None
        raise
    pinned = benchmark.sources[0]
    if (not fetched and documents.format.name == "original" and pinned.git_blob is not None
            and path.name == Path(pinned.dest).name and git_blob_id(path) != pinned.git_blob):
        raise TaskError(f"{path} is not the original file of {benchmark.title} (its git blob id is not "
                        f"{pinned.git_blob})")
    return documents


def benchmark_task(benchmark: Benchmark, documents: Documents) -> Task:
    parts = ()
    if benchmark.name == "mmlu":  # each subject is reported too, as lm-eval's mmlu_<subject> subtasks
        parts = tuple((f"mmlu_{s}", sum(doc["subject"] == s for doc in documents.docs)) for s in MMLU_SUBJECTS)
    return Task(benchmark.name, benchmark_items(benchmark, documents), benchmark.kind, benchmark.metrics,
                benchmark.log_key, parts, benchmark.num_fewshot)


# ---- a user's JSONL

def user_item(row: object, where: str) -> Item:
    """The item of a user's JSONL line {"context", "choices", "label"}; TaskError naming the field that is wrong."""
    context, choices = text(row, where, "context"), strings(row, where, "choices")
    return Item(context, tuple(choices), index(row, where, "label", len(choices)))


def load_user_task(path: Path) -> Task:
    """A user's multiple-choice JSONL; TaskError with the line number and the field of the first bad line."""
    items = [user_item(row, f"{path}:{number}") for number, row in read_jsonl(path)]
    if not items:
        raise TaskError(f"{path} holds no items")
    return Task(path.stem, items, MULTIPLE_CHOICE, log_key="eval")


# ---- by name

def load_task(name: str, data_dir=None, source: str | None = None, limit: int | None = None,
              options: tuple[str, str] = ("--task", "--task-source")) -> Task:
    """A standard task by name, or a user's JSONL by its path; the first `limit` items when given. options: the
    command's names of the task and source options, for the errors."""
    if name in BENCHMARKS:
        benchmark = BENCHMARKS[name]
        task = benchmark_task(benchmark, load_documents(benchmark, data_dir, source, options[1]))
    elif Path(name).is_file():
        task = load_user_task(Path(name))
    else:
        raise TaskError(f"{options[0]} {name}: neither a task ({', '.join(TASK_NAMES)}) nor a JSONL file of "
                        "multiple-choice items")
    return task.limited(limit)


def task_names(spec: str, options: tuple[str, str] = ("--task", "--task-source")) -> list[str]:
    """The tasks a command line names: "suite", a comma-separated list of names and JSONL paths, or one path;
    TaskError naming every name that is neither (and the tasks there are)."""
    if Path(spec).is_file():
        return [spec]
    names = list(BENCHMARKS) if spec == SUITE else [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS and not Path(n).is_file()]
    if unknown or not names:
        what = ", ".join(unknown) if unknown else repr(spec)
        raise TaskError(f"{options[0]} {what}: {'neither a task' if len(unknown) == 1 else 'neither tasks'} "
                        f"({', '.join(TASK_NAMES)}) nor {'a JSONL file' if len(unknown) == 1 else 'JSONL files'} of "
                        "multiple-choice items")
    if len(set(names)) < len(names):
        raise TaskError(f"{options[0]} {spec}: a task is named twice")
    return names


def load_tasks(spec: str, data_dir=None, source: str | None = None, limit: int | None = None,
               options: tuple[str, str] = ("--task", "--task-source")) -> list[Task]:
    """The tasks of task_names(spec), each loaded by load_task; with several, source must be a folder or a
    mirror, not one file."""
    names = task_names(spec, options)
    if len(names) > 1 and source is not None and Path(source).is_file():
        raise TaskError(f"{options[1]} {source}: names one file, but {options[0]} {spec} names {len(names)} tasks; "
                        "name a folder holding their copies")
    tasks = [load_task(name, data_dir, source, limit, options) for name in names]
    keys = [task.log_key for task in tasks]
    if len(set(keys)) < len(keys):
        raise TaskError(f"{options[0]} {spec}: two tasks would log under the same name ({', '.join(keys)}); "
                        "name one JSONL file at a time")
    return tasks
