"""float32 and uint8 safetensors files, streamed in and out, with the header checked before any data is trusted.

The format: a little-endian uint64 header length N, N bytes of JSON naming each tensor's dtype,
shape and [begin, end) byte range in the data section, then the data section. Writing streams each
array from memory (no second copy of a model, and plain OS writes whose errors carry an errno);
reading checks names, dtypes, shapes, ranges and the file size against what the caller expects, and
reads straight into the caller's arrays (page-locked ones too), in pieces read by several threads at
once. The files are ordinary safetensors files for other tools.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
READ_PIECE, READERS = 1 << 26, 8  # bytes a reader reads at once, and readers at a time
DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}  # what is written and read, by safetensors' names


class SafetensorsError(ValueError):
    """A file that is not the safetensors file the caller expects; the message names the file."""


def write_tensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 and uint8 arrays as one safetensors file and fsync it."""
    header, offset = {}, 0
    for name, array in tensors.items():
        if array.dtype not in DTYPES:
            raise ValueError(f"{name}: only float32 and uint8 tensors are written, got {array.dtype}")
        header[name] = {"dtype": DTYPES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).data)
        f.flush()
        os.fsync(f.fileno())


def _header(path: Path) -> tuple[dict, int, int]:
    """The file's JSON header (without __metadata__), its length and the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path} is {size} bytes, too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise SafetensorsError(f"{path} is truncated or not a safetensors file "
                                   f"(header of {n} bytes in a file of {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise SafetensorsError(f"{path}: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, n, size


def tensor_names(path: str | Path) -> set[str]:
    """The names of the tensors in the file (its header only is read)."""
    return set(_header(Path(path))[0])


def check_tensors(path: str | Path, shapes: dict[str, tuple[int, ...]],
                  dtypes: dict[str, np.dtype] | None = None) -> dict[str, tuple[int, int]]:
    """Check that the file holds exactly these tensors (float32 unless dtypes names another) and is complete;
    returns each tensor's absolute (begin, end) byte range."""
    path = Path(path)
    header, n, size = _header(path)
    if set(header) != set(shapes):
        missing, extra = sorted(set(shapes) - set(header)), sorted(set(header) - set(shapes))
        raise SafetensorsError(f"{path}: " + "; ".join(
            part for part in (f"lacks {', '.join(missing[:3])}" if missing else "",
                              f"has unexpected {', '.join(extra[:3])}" if extra else "") if part))
    ranges = {}
    for name, entry in header.items():
        entry = entry if isinstance(entry, dict) else {}
        dtype = np.dtype((dtypes or {}).get(name, np.float32))
        offsets, nbytes = entry.get("data_offsets"), int(np.prod(shapes[name])) * dtype.itemsize
        if (entry.get("dtype"), entry.get("shape")) != (DTYPES[dtype], list(shapes[name])):
            raise SafetensorsError(f"{path}: {name} is {entry.get('dtype')} {entry.get('shape')}, "
                                   f"expected {DTYPES[dtype]} {list(shapes[name])}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and offsets[1] - offsets[0] == nbytes):
            raise SafetensorsError(f"{path}: {name} has the byte range {offsets}, expected {nbytes} bytes")
        ranges[name] = tuple(offsets)
    end = 0
    for begin, stop in sorted(ranges.values()):
        if begin != end:
            raise SafetensorsError(f"{path}: the tensors' byte ranges overlap or leave gaps")
        end = stop
    if size != 8 + n + end:
        raise SafetensorsError(f"{path} is {size} bytes, but its header promises {8 + n + end}; "
                               "the file is truncated or corrupt")
    return {name: (8 + n + begin, 8 + n + stop) for name, (begin, stop) in ranges.items()}


def read_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill view from the file's bytes at offset (one pread returns at most 2 GiB on Linux)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise SafetensorsError(f"{path} ended while being read; the file is truncated")
        done += got


def read_tensors(path: str | Path, out: dict[str, np.ndarray]) -> None:
    """Read the file's tensors into the given contiguous arrays (their dtypes those expected), after
    check_tensors: in pieces of READ_PIECE bytes, READERS at a time (a disk serves several requests in flight
    faster than one sequential read, and the copies out of the page cache run on several cores)."""
    path = Path(path)
    ranges = check_tensors(path, {name: a.shape for name, a in out.items()}, {name: a.dtype for name, a in out.items()})
    pieces = []
    for name, (begin, end) in ranges.items():
        view = memoryview(out[name]).cast("B")
        pieces += [(view[at:at + READ_PIECE], begin + at) for at in range(0, end - begin, READ_PIECE)]
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(READERS) as pool:
            for _ in pool.map(lambda piece: read_into(fd, *piece, path), pieces):
                pass
    finally:
        os.close(fd)
