"""Token shards in llm.c's formats: an int32[256] header, then the tokens.

header[0] magic, [1] version, [2] number of tokens, and, our additions in spare fields, [3] the
vocabulary size of the tokenizer that wrote the shard (0 when unknown, as in llm.c's own) and [4] 1 when
the shard belongs to a dataset whose manifest lists it (scripts/prepare_data.py's, llama/data/manifest.py):
such a shard is used only with its manifest, so that a dataset cut short is never taken as whole.
  Llama 3: magic 20240801, version 7, uint32 tokens.
  GPT-2:   magic 20240520, version 1, uint16 tokens (read only).
A loss-mask sidecar (<shard>.mask.bin beside <shard>.bin, our addition for chat data) has the same
header with magic 20240812, version 1, and one uint8 per token: 1 where the token counts in the loss.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMATS = {  # magic -> (name, version, token dtype)
    20240801: ("llama3", 7, np.dtype(np.uint32)),
    20240520: ("gpt2", 1, np.dtype(np.uint16)),
}
LLAMA3_MAGIC = 20240801
MASK_MAGIC, MASK_VERSION = 20240812, 1
MASK_SUFFIX = ".mask.bin"  # a token shard name.bin has its loss mask in name.mask.bin


class ShardError(ValueError):
    """A shard file that is not a valid token shard, or does not fit the model."""


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    format: str
    num_tokens: int
    vocab_size: int  # of the tokenizer that wrote it; 0 if the writer did not record it
    dtype: np.dtype
    listed: bool = False  # a shard of a dataset with a manifest (header[4])


def _write_atomically(path: Path, header: np.ndarray, body: np.ndarray) -> None:
    """header then body, through a temporary file renamed into place: a shard that exists is whole."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(body.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or Ctrl-C: no half-written .tmp left behind
        tmp.unlink(missing_ok=True)
        raise


def write_shard(path: str | Path, tokens: np.ndarray, vocab_size: int, listed: bool = False) -> None:
    """Write tokens as a Llama 3 shard, atomically (a temporary file renamed into place); listed: one of a
    dataset whose manifest lists it."""
    tokens = np.asarray(tokens)
    if tokens.size >= 2 ** 31:
        raise ShardError(f"a shard holds fewer than 2^31 tokens, got {tokens.size}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ShardError(f"tokens outside the vocabulary [0, {vocab_size})")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:5] = [LLAMA3_MAGIC, 7, tokens.size, vocab_size, int(listed)]
    _write_atomically(Path(path), header, tokens.astype(np.uint32))


def mask_path(shard: str | Path) -> Path:
    """The loss-mask sidecar of a token shard: name.bin -> name.mask.bin."""
    shard = Path(shard)
    return shard.with_name(shard.name.removesuffix(".bin") + MASK_SUFFIX)


def is_mask_sidecar(path: str | Path) -> bool:
    return str(path).endswith(MASK_SUFFIX)


def write_mask(path: str | Path, mask: np.ndarray) -> None:
    """Write a loss mask (0 or 1 per token) as a sidecar shard, atomically."""
    mask = np.asarray(mask)
    if mask.size and (mask.min() < 0 or mask.max() > 1):
        raise ShardError("a loss mask holds only 0 and 1")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = [MASK_MAGIC, MASK_VERSION, mask.size]
    _write_atomically(Path(path), header, mask.astype(np.uint8))


def open_mask(path: str | Path, num_tokens: int) -> np.ndarray:
    """A loss-mask sidecar as a read-only uint8 memmap, checked against its token shard's length."""
    path = check_mask(path, num_tokens)
    if num_tokens == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_BYTES, shape=(num_tokens,))


def check_mask(path: str | Path, num_tokens: int) -> Path:
    """A loss-mask sidecar's header and size against its token shard's length (nothing else is read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES), dtype=np.int32)
        size = path.stat().st_size
    except OSError as e:
        raise ShardError(f"cannot read loss mask {path}: {e.strerror}") from None
    if header.size < HEADER_INTS or int(header[0]) != MASK_MAGIC or int(header[1]) != MASK_VERSION:
        raise ShardError(f"{path}: not a loss-mask sidecar (magic {MASK_MAGIC}, version {MASK_VERSION})")
    if int(header[2]) != num_tokens or size != HEADER_BYTES + num_tokens:
        raise ShardError(f"{path}: a mask of {int(header[2])} tokens in {size} bytes, but its shard holds "
                         f"{num_tokens} tokens")
    return path


def read_header(path: str | Path) -> ShardInfo:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except OSError as e:
        raise ShardError(f"cannot read shard {path}: {e.strerror}") from None
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path}: too short for a shard header ({len(raw)} bytes)")
    header = np.frombuffer(raw, dtype=np.int32)
    magic, version, num_tokens = (int(x) for x in header[:3])
    if magic not in FORMATS:
        raise ShardError(f"{path}: bad magic number {magic} (expected {' or '.join(map(str, FORMATS))})")
    name, expected_version, dtype = FORMATS[magic]
    if version != expected_version:
        raise ShardError(f"{path}: unsupported {name} shard version {version} (expected {expected_version})")
    expected = HEADER_BYTES + num_tokens * dtype.itemsize
    if num_tokens < 0 or size != expected:
        raise ShardError(f"{path}: file is {size} bytes but its header promises {num_tokens} tokens "
                         f"({expected} bytes); the file is truncated or corrupt")
    vocab, listed = (int(header[3]), int(header[4]) == 1) if name == "llama3" else (0, False)
    return ShardInfo(path, name, num_tokens, vocab, dtype, listed)


def open_shard(path: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """The shard's tokens as a read-only memmap, after checking the header, the file size and, when
    vocab_size is given, that the writer's vocabulary and every token fit the model."""
    info = read_header(path)
    if vocab_size is not None and info.vocab_size and info.vocab_size != vocab_size:
        raise ShardError(f"{info.path}: written by a tokenizer with vocab {info.vocab_size}, "
                         f"but the model's vocab is {vocab_size}")
    if info.num_tokens == 0:
        return np.zeros(0, dtype=info.dtype)
    tokens = np.memmap(info.path, dtype=info.dtype, mode="r", offset=HEADER_BYTES, shape=(info.num_tokens,))
    if vocab_size is not None:
        top = int(tokens.max())
        if top >= vocab_size:
            raise ShardError(f"{info.path}: token id {top} is outside the model's vocabulary [0, {vocab_size})")
    return tokens
