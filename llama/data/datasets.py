"""Turning text into token shards: tinyshakespeare and the built-in corpus (llm.c's framing).

Every document starts with the tokenizer's <|begin_of_text|>, as in llm.c's data scripts.
The built-in corpus is the Python standard library's own .py sources on this machine (no
site-packages): real text that is always there, so training works offline out of the box.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np

from ..runtime.progress import bar
from ..cache import cache_dir
from .shards import write_shard

TINYSHAKESPEARE_VAL_TOKENS = 32768


class CorpusError(ValueError):
    """A text that cannot become shards (not UTF-8, or too short to split); the message is one line."""


def encode_documents(texts: Iterable[str | bytes], tokenizer, desc: str = "tokenizing") -> np.ndarray:
    """All documents as one uint32 array, each preceded by <|begin_of_text|>."""
    pieces = []
    for text in bar(texts, desc=desc, unit="doc", leave=False):
        ids = tokenizer.encode_bytes(text) if isinstance(text, bytes) else np.asarray(tokenizer.encode(text))
        pieces += [np.array([tokenizer.bos_id], np.uint32), ids.astype(np.uint32)]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)


def prepare_tinyshakespeare(text_path: str | Path, out_dir: str | Path, tokenizer) -> tuple[Path, Path]:
    """llm.c's split: sections between blank lines are documents; the first 32,768 tokens are val, or
    the first half of a text shorter than twice that, so that training always gets tokens too."""
    path = Path(text_path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); convert "
                          f"it first, e.g. iconv -f latin1 -t utf-8 {path}") from None
    sections = text.split("\n\n")
    docs = [s + "\n\n" if i < len(sections) - 1 else s for i, s in enumerate(sections)]
    tokens = encode_documents(docs, tokenizer, "tinyshakespeare")
    n_val = min(TINYSHAKESPEARE_VAL_TOKENS, tokens.size // 2)
    if n_val == 0:
        raise CorpusError(f"{path} is too short to split into training and validation tokens")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    val, train = out / "tiny_shakespeare_val.bin", out / "tiny_shakespeare_train.bin"
    write_shard(val, tokens[:n_val], tokenizer.vocab_size)
    write_shard(train, tokens[n_val:], tokenizer.vocab_size)
    return train, val


def starter_pack_shards(folder: str | Path | None = None) -> tuple[Path, Path]:
    """(train, val) shards of tinyshakespeare as scripts/download_starter_pack.py writes them into folder
    (default: the per-user cache, llama/cache.py)."""
    out = Path(folder if folder is not None else cache_dir()) / "tinyshakespeare"
    return out / "tiny_shakespeare_train.bin", out / "tiny_shakespeare_val.bin"


def stdlib_sources() -> list[Path]:
    """The standard library's .py files on this machine, without site-packages, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))


def prepare_builtin_corpus(out_dir: str | Path, tokenizer, val_every: int = 50) -> tuple[Path, Path]:
    """Shards of the stdlib sources (every val_every-th file goes to val). Reuses shards made earlier
    for the same vocabulary."""
    out = Path(out_dir)
    train, val = out / f"stdlib_v{tokenizer.vocab_size}_train.bin", out / f"stdlib_v{tokenizer.vocab_size}_val.bin"
    if train.exists() and val.exists():
        return train, val
    files = stdlib_sources()
    if len(files) < 2:
        raise FileNotFoundError("no Python standard library sources found on this machine")
    out.mkdir(parents=True, exist_ok=True)
    docs = [p.read_bytes() for p in files]
    write_shard(val, encode_documents(docs[::val_every], tokenizer, "stdlib val"), tokenizer.vocab_size)
    train_docs = [d for i, d in enumerate(docs) if i % val_every]
    write_shard(train, encode_documents(train_docs, tokenizer, "stdlib train"), tokenizer.vocab_size)
    return train, val
