"""The evaluation tests' files: ../shared/evaldata (the real sets, when this checkout sits beside it; the tests
that read it skip with a reason where it is absent), and small files of a task's format that stand in for its
set, pinned in its place."""

import dataclasses
import json
from pathlib import Path

import pytest

from llama.data.tokenizer import ByteTokenizer
from llama.eval.benchmarks import BENCHMARKS
from llama.eval.files import git_blob_id

EVALDATA = Path(__file__).resolve().parents[1].parent / "shared" / "evaldata"
needs_evaldata = pytest.mark.skipif(not EVALDATA.is_dir(), reason=f"{EVALDATA} is not here (the real evaluation "
                                    "files lie beside the repository on the development machines)")


def accept(monkeypatch, name: str, path: Path | None = None, count: int | None = None) -> None:
    """Make a small file stand in for a task's set: its item count accepted and, given the file, the git blob id
    of its original pinned to it."""
    benchmark = BENCHMARKS[name]
    changes = {"counts": (count,)} if count is not None else {}
    if path is not None:
        source = dataclasses.replace(benchmark.sources[0], git_blob=git_blob_id(path))
        changes["sources"] = (source, *benchmark.sources[1:])
    monkeypatch.setitem(BENCHMARKS, name, dataclasses.replace(benchmark, **changes))


class LetterTokenizer(ByteTokenizer):
    """Bytes, except " A" to " D", which are one token each (ids 260-263), as in the Llama 3 tokenizer: MMLU's
    continuations are one token."""

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids, i = [self.bos_id] if bos else [], 0
        while i < len(text):
            if text[i:i + 2] in (" A", " B", " C", " D"):
                ids.append(260 + "ABCD".index(text[i + 1]))
                i += 2
            else:
                ids += list(text[i].encode())
                i += 1
        return ids


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
