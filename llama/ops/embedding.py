"""The token embedding's launchers (kernels/embedding.cu; twin llama/twins/embedding.py): the fp32 path's
lookup and its scatter-add gradient, and the bf16 path's, whose gradient sums each token's rows in
segments of EMBEDDING_SEGMENT positions, deterministic."""

from __future__ import annotations

import numpy as np

from ..runtime.cuda import BF16, DeviceArray
from .common import BLOCK, F32, I32, blocks, check, check_vectors, kernel, kernel_constant

EMBEDDING_SEGMENT = kernel_constant("embedding", "EMBEDDING_SEGMENT")  # positions per segment of the bf16 backward
EMBEDDING_FORWARD_VECTORS = kernel_constant("embedding", "EMBEDDING_FORWARD_VECTORS")  # 16-byte vectors per thread


def embedding_forward(out: DeviceArray, tokens: DeviceArray, wte: DeviceArray) -> None:
    """out (N, C) = wte[tokens]."""
    N, C = tokens.size, wte.shape[1]
    check("tokens", tokens, tokens.shape, I32)
    check("out", out, (N, C))
    kernel("embedding", "embedding_forward", "PPPii")(blocks(N * C), BLOCK, out.ptr, tokens.ptr, wte.ptr, N, C)


def embedding_backward(dwte: DeviceArray, dout: DeviceArray, order: DeviceArray, starts: DeviceArray,
                       unique: DeviceArray, num_unique: int) -> None:
    """dwte (V, C) += dout rows grouped by token; order/starts/unique from sort_tokens()."""
    N, C = dout.shape
    check("dwte", dwte, (dwte.shape[0], C))
    check("order", order, (N,), I32)
    if starts.dtype != I32 or unique.dtype != I32 or starts.size < num_unique + 1 or unique.size < num_unique:
        raise ValueError("embedding_backward: starts/unique must be int32 with room for num_unique groups")
    kernel("embedding", "embedding_backward", "PPPPPi")((num_unique,), BLOCK, dwte.ptr, dout.ptr, order.ptr,
                                                          starts.ptr, unique.ptr, C)


def sort_tokens(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host side of embedding_backward: positions grouped by token (stable), group starts, tokens."""
    flat = tokens.ravel()
    order = np.argsort(flat, kind="stable").astype(np.int32)
    unique, counts = np.unique(flat, return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return order, starts, unique.astype(np.int32)


def embedding_forward_bf16(out: DeviceArray, tokens: DeviceArray, wte: DeviceArray) -> None:
    """out (N, C) = wte[tokens], bf16 (wte is the bf16 copy of the table)."""
    N, (V, C) = tokens.size, wte.shape
    check("tokens", tokens, tokens.shape, I32)
    check("wte", wte, (V, C), BF16)
    check("out", out, (N, C), BF16)
    check_vectors(C, out=out, wte=wte)
    kernel("embedding", "embedding_forward_bf16", "PPPii")(blocks(N * C // 8, BLOCK * EMBEDDING_FORWARD_VECTORS),
                                                             BLOCK, out.ptr, tokens.ptr, wte.ptr, N, C)


def token_segments(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host side of embedding_backward_bf16, for N positions: `order` (N,) int32, the positions grouped
    by token (stable), and `segments` (N, 4) int32, one row per segment of at most EMBEDDING_SEGMENT
    positions of one token: {group begin, group end (indices into order), token, index of the segment
    in its group}. Tokens with several segments come first (most first); unused rows are zero. The
    shapes depend on N only, so the uploads fit a captured graph."""
    flat = tokens.ravel().astype(np.int64)
    N = flat.size
    order = np.sort(flat * N + np.arange(N)) % N  # a stable argsort by one sort of unique keys (faster)
    ids = flat[order]
    begins = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))  # one sort serves the groups too
    unique, counts = ids[begins], np.diff(np.append(begins, flat.size))
    per_group = -(-counts // EMBEDDING_SEGMENT)
    several = np.flatnonzero(per_group > 1)  # most segments first, then the one-segment groups in order
    groups = np.concatenate([several[np.argsort(-per_group[several], kind="stable")], np.flatnonzero(per_group == 1)])
    per_group = per_group[groups]
    order = order.astype(np.int32)
    group = np.repeat(groups, per_group)
    index = np.arange(len(group)) - np.repeat(np.cumsum(per_group) - per_group, per_group)
    segments = np.zeros((N, 4), dtype=np.int32)
    for column, values in enumerate((begins[group], begins[group] + counts[group], unique[group], index)):
        segments[:len(group), column] = values
    return order, segments


def embedding_partial_rows(N: int) -> int:
    """A bound on the segments of tokens with more than one (each has > EMBEDDING_SEGMENT positions)."""
    return 2 * N // EMBEDDING_SEGMENT + 1


def embedding_bf16_scratch_size(N: int, C: int) -> int:
    """float32 elements of embedding_backward_bf16's scratch: partial rows, then counters."""
    rows = embedding_partial_rows(N)
    return rows * C + rows


def embedding_backward_bf16(dwte: DeviceArray, dout: DeviceArray, order: DeviceArray, segments: DeviceArray,
                            scratch: DeviceArray) -> None:
    """dwte (V, C) fp32 += the bf16 dout (N, C) rows grouped by token, deterministic; order and segments
    from token_segments(); scratch float32 (embedding_bf16_scratch_size(N, C),), zeroed once."""
    N, C = dout.shape
    check("dout", dout, (N, C), BF16)
    check("dwte", dwte, (dwte.shape[0], C))
    check("order", order, (N,), I32)
    check("segments", segments, (N, 4), I32)
    size = embedding_bf16_scratch_size(N, C)
    if scratch.dtype != F32 or scratch.size < size:
        raise ValueError(f"scratch: needs {size} float32, has {scratch.size} {scratch.dtype}")
    if C > 8192:
        raise ValueError(f"embedding_backward_bf16 takes C <= 8192, got {C}")
    check_vectors(C, dwte=dwte, dout=dout, segments=segments, scratch=scratch)
    counters = scratch.ptr + embedding_partial_rows(N) * C * 4
    kernel("embedding", "embedding_backward_bf16", "PPPPPPi")((N,), C // 8, dwte.ptr, scratch.ptr, counters, dout.ptr,
                                                                order.ptr, segments.ptr, C)
