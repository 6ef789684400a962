"""Multiple-choice tasks as lm-evaluation-harness 0.4.x builds them: HellaSwag's validation set, downloaded
on first use from the file llm.c reads and checked against the repository's git blob id, or a user's JSONL
of {"context": ..., "choices": [...], "label": k}.

Each item is scored as lm-eval scores a multiple_choice task: the context, then each choice as its
continuation after the target delimiter " " (llama/eval/scoring.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..cache import cache_dir
from ..data.download import DownloadError, download

TARGET_DELIMITER = " "  # lm-eval's default between the context and each choice
# rowanz/hellaswag's validation set, as llm.c's dev/data/hellaswag.py downloads it; pinned by the git blob id
# of data/hellaswag_val.jsonl in that repository's tree (a SHA-1 of the size and the bytes)
HELLASWAG = dict(base="https://raw.githubusercontent.com", path="rowanz/hellaswag/master/data/hellaswag_val.jsonl",
                 dest="hellaswag/hellaswag_val.jsonl", git_blob="0f5ee25d72216f12317d5d8a7b92deafa423d81e",
                 items=10_042)
LOG_KEYS = {"hellaswag": "hella"}  # main.log's key of a task's accuracy (llm.c's for HellaSwag); "eval" otherwise


def eval_data_dir() -> Path:
    """Where downloaded task files are kept: beside the starter pack, in the per-user cache (llama/cache.py)."""
    return cache_dir() / "eval"


class TaskError(ValueError):
    """A task that cannot be loaded; the message (one line) says why."""


@dataclass(frozen=True)
class Item:
    """One question: the context, the choices as lm-eval's doc_to_choice gives them (without the
    delimiter), and the index of the right one."""
    context: str
    choices: tuple[str, ...]
    label: int


@dataclass(frozen=True)
class Task:
    name: str
    items: list[Item]

    @property
    def log_key(self) -> str:
        return LOG_KEYS.get(self.name, "eval")


def git_blob_id(path: Path) -> str:
    """The id git gives a file's contents: SHA-1 of "blob <size>\\0" and the bytes."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag preprocess: strip, " [title]" -> ". ", drop other [bracketed] tags, "  " -> " "."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag_item(doc: dict) -> Item:
    """lm-eval's hellaswag process_docs: the activity label, ctx_a and ctx_b capitalized (str.capitalize,
    which lowercases the rest), each preprocessed."""
    context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return Item(hellaswag_preprocess(doc["activity_label"] + ": " + context),
                tuple(hellaswag_preprocess(ending) for ending in doc["endings"]), int(doc["label"]))


def hellaswag_file(data_dir: str | Path | None = None, source: str | None = None) -> Path:
    """HellaSwag's validation file, checked: `source` (a local copy, or a mirror's base URL serving the same
    path), else the copy under data_dir (default: eval_data_dir()), downloaded there when missing or wrong (resumed, retried)."""
    expected = HELLASWAG["git_blob"]
    if source is not None and not source.startswith(("http://", "https://")):
        path = Path(source)
        if not path.is_file() or git_blob_id(path) != expected:
            raise TaskError(f"{source} is not HellaSwag's validation file (its git blob id is not {expected})")
        return path
    dest = Path(data_dir if data_dir is not None else eval_data_dir()) / HELLASWAG["dest"]
    if dest.is_file() and git_blob_id(dest) == expected:
        return dest
    if dest.exists():
        dest.unlink()  # download() would take any complete file under the final name as verified
    url = f"{(source or HELLASWAG['base']).rstrip('/')}/{HELLASWAG['path']}"
    try:
        download(url, dest)
    except DownloadError as e:
        raise TaskError(f"{e} (or name a copy of hellaswag_val.jsonl with --task-source)") from None
    if git_blob_id(dest) != expected:
        dest.unlink()
        raise TaskError(f"{url}: the downloaded file is not HellaSwag's validation set (its git blob id is not "
                        f"{expected}); it was deleted")
    return dest


def read_jsonl(path: Path) -> list[tuple[int, object]]:
    """(line number, value) of each non-blank line; TaskError naming the line that is not JSON."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
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


def user_item(row: object) -> Item | None:
    """An item of a user's JSONL line, or None when the line is not one."""
    if not isinstance(row, dict):
        return None
    context, choices, label = row.get("context"), row.get("choices"), row.get("label")
    if not (isinstance(context, str) and context and isinstance(choices, list) and len(choices) >= 2
            and all(isinstance(c, str) and c for c in choices) and type(label) is int and 0 <= label < len(choices)):
        return None
    return Item(context, tuple(choices), label)


def load_user_task(path: Path) -> Task:
    """A user's multiple-choice JSONL; TaskError with the line number of the first bad line."""
    items = []
    for number, row in read_jsonl(path):
        item = user_item(row)
        if item is None:
            raise TaskError(f'{path}:{number}: expected {{"context": a non-empty string, "choices": two or more '
                            'non-empty strings, "label": the index of the right choice}')
        items.append(item)
    if not items:
        raise TaskError(f"{path} holds no items")
    return Task(path.stem, items)


def load_task(name: str, data_dir: str | Path | None = None, source: str | None = None,
              limit: int | None = None) -> Task:
    """"hellaswag" or the path of a user's JSONL; the first `limit` items when given."""
    if name == "hellaswag":
        rows = read_jsonl(hellaswag_file(data_dir, source))
        task = Task(name, [hellaswag_item(row) for _, row in rows])
    elif Path(name).is_file():
        task = load_user_task(Path(name))
    else:
        raise TaskError(f"--task {name}: neither hellaswag nor a JSONL file of multiple-choice items")
    return Task(task.name, task.items[:limit]) if limit else task
