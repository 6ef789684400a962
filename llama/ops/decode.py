"""Launchers of the decoder's own kernels (kernels/decode.cu): the token embedding and the last
residual add into the fp32 stream with its RMSNorm statistics, the prefill's KV-cache write,
flash-decoding attention over the cache, and the step's end (the sampled ids into the history, the
position advanced). The caches are (B, KV, T_max, D) bf16 per layer; the position, p, lives on the
device (int32 (1,)) so that a captured decode step serves every token."""

from __future__ import annotations

import math

from ..runtime.cuda import BF16, DeviceArray
from .common import BLOCK, F32, I32, blocks, check, check_aligned, kernel, kernel_constant, multiprocessors
from .gemv import DecodeScratch

ATTENTION_THREADS = kernel_constant("decode", "ATT_THREADS")
MAX_HEAD_DIM = kernel_constant("decode", "ATT_MAX_D")
ATTENTION_MIN_KEYS = 256  # the fewest keys a split of the cache takes: fewer cost more in the combine than they save
MAX_SPLITS = kernel_constant("decode", "ATT_MAX_SPLITS")


def embed_tokens(x: DeviceArray, squares: DeviceArray, tokens: DeviceArray, wte: DeviceArray) -> None:
    """x (B, C) fp32 = wte[tokens] (wte (V, C) bf16), squares (B,) = the sums of x^2 per row (one slot of
    the next GEMV's StreamNorm)."""
    B, (V, C) = tokens.size, wte.shape
    check("tokens", tokens, (B,), I32)
    check("wte", wte, (V, C), BF16)
    check("x", x, (B, C), F32)
    check("squares", squares, (B,), F32)
    kernel("decode", "embed_tokens", "PPPPi")((B,), BLOCK, x.ptr, squares.ptr, tokens.ptr, wte.ptr, C, dependent=True)


def last_residual(x: DeviceArray, squares: DeviceArray, h: DeviceArray, branch: DeviceArray) -> None:
    """x (B, C) fp32 = h + branch at the last position (h, branch (B, n, C) bf16), squares (B,) the sums of
    x^2 per row."""
    B, n, C = h.shape
    check("h", h, (B, n, C), BF16)
    check("branch", branch, (B, n, C), BF16)
    check("x", x, (B, C), F32)
    check("squares", squares, (B,), F32)
    kernel("decode", "last_residual", "PPPPii")((B,), BLOCK, x.ptr, squares.ptr, h.ptr, branch.ptr, n, C)


def _check_caches(k_cache: DeviceArray, v_cache: DeviceArray, B: int, D: int) -> tuple[int, int]:
    """(KV, T_max) of the bf16 caches (B, KV, T_max, D)."""
    if len(k_cache.shape) != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D or v_cache.shape != k_cache.shape \
            or k_cache.dtype != BF16 or v_cache.dtype != BF16:
        raise ValueError(f"caches must be bf16 (B={B}, KV, T_max, D={D}), got {k_cache.dtype} {k_cache.shape} and "
                         f"{v_cache.dtype} {v_cache.shape}")
    return k_cache.shape[1], k_cache.shape[2]


def cache_write(k_cache: DeviceArray, v_cache: DeviceArray, qkv: DeviceArray, n_heads: int,
                position: DeviceArray) -> None:
    """k (rotated) and v of the packed projection qkv (B, n, (H + 2KV) * D) bf16 -> the caches at
    positions p .. p + n - 1, p = position[0] (the caller makes sure they fit)."""
    B, n, width = qkv.shape
    D = k_cache.shape[3] if len(k_cache.shape) == 4 else 0
    KV, T_max = _check_caches(k_cache, v_cache, B, D)
    check("qkv", qkv, (B, n, (n_heads + 2 * KV) * D), BF16)
    check("position", position, (1,), I32)
    if D % 8:
        raise ValueError(f"cache_write: head_dim {D} must be a multiple of 8")
    check_aligned(qkv=qkv, k_cache=k_cache, v_cache=v_cache)
    kernel("decode", "cache_write", "PPPPiiiiii")(blocks(B * n * 2 * KV * D // 8), BLOCK, k_cache.ptr, v_cache.ptr,
                                                  qkv.ptr, position.ptr, B, n, n_heads, KV, D, T_max)


def attention_splits(sequences: int, n_heads: int, max_len: int) -> int:
    """The most ranges of the keys per (sequence, query position, head): a block per multiprocessor in
    all, each range at least ATTENTION_MIN_KEYS keys long when the cache is full, at most MAX_SPLITS
    (the kernel uses fewer while the cache is short)."""
    return max(1, min(math.ceil(multiprocessors() / (sequences * n_heads)),
                      math.ceil(max_len / ATTENTION_MIN_KEYS), MAX_SPLITS))


def attention_scratch_size(sequences: int, n_heads: int, head_dim: int, max_len: int) -> int:
    """fp32 values of decode_attention's partial results for `sequences` (batch x query positions)."""
    splits = attention_splits(sequences, n_heads, max_len)
    return 0 if splits == 1 else sequences * splits * n_heads * (head_dim + 2)


def decode_attention(out: DeviceArray, q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray,
                     position: DeviceArray, scratch: DecodeScratch) -> None:
    """out (B, n, H * D) bf16: query i of q (B, n, H, D) at position p + i (p = position[0]) attends to
    the cached keys 0 .. p + i. q is fp32, or bf16 as a view of the packed projection (B, n, (H + 2KV) D)
    (pass that array whole with q=qkv: its first H * D columns are the queries)."""
    B, n = q.shape[:2]
    D = k_cache.shape[3] if len(k_cache.shape) == 4 else 0
    KV, T_max = _check_caches(k_cache, v_cache, B, D)
    H = out.shape[-1] // D if D else 0
    if KV == 0 or H % KV or D > MAX_HEAD_DIM or D % 8:
        raise ValueError(f"decode_attention: {H} query heads over {KV} kv heads, "
                         f"head_dim {D} (a multiple of 8, at most {MAX_HEAD_DIM})")
    check("out", out, (B, n, H * D), BF16)
    check("position", position, (1,), I32)
    if q.dtype == F32:
        check("q", q, (B, n, H, D), F32)
        name, stride = "decode_attention_f32q", H * D
    else:
        check("q", q, (B, n, (H + 2 * KV) * D), BF16)
        name, stride = "decode_attention_bf16q", (H + 2 * KV) * D
    splits = attention_splits(B * n, H, T_max)
    if splits > 1 and (attention_scratch_size(B * n, H, D, T_max) > scratch.partial.size
                       or B * n * H > scratch.counters.size):
        raise ValueError("decode_attention: the scratch is too small for this batch")
    kernel("decode", name, "PPPPiPPPiiiiii")((splits, H, B * n), ATTENTION_THREADS, out.ptr, scratch.partial.ptr,
                                             scratch.counters.ptr, q.ptr, stride, k_cache.ptr, v_cache.ptr,
                                             position.ptr, n, H, KV, D, T_max, ATTENTION_MIN_KEYS, dependent=True)


def advance(history: DeviceArray, position: DeviceArray, ids: DeviceArray) -> None:
    """The end of a decode step: history (B, T_max) int32 at p + 1 = ids (B,), then p += 1."""
    B, T_max = history.shape
    check("history", history, (B, T_max), I32)
    check("ids", ids, (B,), I32)
    check("position", position, (1,), I32)
    kernel("decode", "advance", "PPPii")((1,), 32, history.ptr, position.ptr, ids.ptr, B, T_max, dependent=True)
