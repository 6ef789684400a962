"""Launchers of the decoder's own kernels (kernels/decode.cu): RoPE at absolute positions with the
KV-cache write, attention of new positions over the cache, and the last position of each sequence.
The caches are (B, KV, max_len, D) per layer, bf16 or fp32."""

from __future__ import annotations

from ..cuda import BF16, DeviceArray
from .common import BLOCK, F32, blocks, check, kernel

CACHE_KERNELS = {F32: "f32", BF16: "bf16"}
ATTENTION_BLOCK = 256


def _cache_suffix(k_cache: DeviceArray, v_cache: DeviceArray) -> str:
    if k_cache.dtype not in CACHE_KERNELS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must both be float32 or bfloat16, got {k_cache.dtype} and {v_cache.dtype}")
    return CACHE_KERNELS[k_cache.dtype]


def rope_kv_write(q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, qkv: DeviceArray, cos: DeviceArray,
                  sin: DeviceArray, p0: int) -> None:
    """qkv (B, n, (H + 2KV) * D) -> q (B, H, n, D) rotated at positions p0.., and k (rotated), v
    written into the caches (B, KV, T_max, D) at p0 .. p0 + n - 1."""
    B, H, n, D = q.shape
    _check_cache(k_cache, v_cache, B, D)
    KV, T_max = k_cache.shape[1], k_cache.shape[2]
    check("q", q, (B, H, n, D))
    check("qkv", qkv, (B, n, (H + 2 * KV) * D))
    if not 0 <= p0 <= T_max - n or cos.shape[0] < p0 + n or cos.shape[1:] != (D // 2,) or sin.shape != cos.shape:
        raise ValueError(f"positions {p0}..{p0 + n - 1} do not fit the cache ({T_max}) or cos/sin {cos.shape}")
    suffix = _cache_suffix(k_cache, v_cache)
    kernel("decode", f"rope_kv_write_{suffix}", "PPPPPPiiiiiii")(
        blocks(qkv.size // 2), BLOCK, q.ptr, k_cache.ptr, v_cache.ptr, qkv.ptr, cos.ptr, sin.ptr,
        B, n, H, KV, D, p0, T_max)


def decode_attention(out: DeviceArray, q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, p0: int) -> None:
    """out (B, n, H * D): query i of q (B, H, n, D), at position p0 + i, attends to cached keys 0 .. p0 + i."""
    B, H, n, D = q.shape
    _check_cache(k_cache, v_cache, B, D)
    KV, T_max = k_cache.shape[1], k_cache.shape[2]
    if KV == 0 or H % KV:
        raise ValueError(f"attention: {H} query heads cannot share {KV} kv heads")
    if D > ATTENTION_BLOCK or D % 2:
        raise ValueError(f"head_dim {D} must be even and at most {ATTENTION_BLOCK}")
    if not 0 <= p0 <= T_max - n:
        raise ValueError(f"positions {p0}..{p0 + n - 1} do not fit the cache ({T_max})")
    check("out", out, (B, n, H * D))
    shared = 4 * (D + ATTENTION_BLOCK + ATTENTION_BLOCK // D * D)
    kernel("decode", f"decode_attention_{_cache_suffix(k_cache, v_cache)}", "PPPPiiiiii")(
        (n, H, B), ATTENTION_BLOCK, out.ptr, q.ptr, k_cache.ptr, v_cache.ptr, n, H, KV, D, p0, T_max, shared=shared)


def last_positions(out: DeviceArray, x: DeviceArray) -> None:
    """out (B, C) = x (B, n, C)[:, n - 1]."""
    B, n, C = x.shape
    check("out", out, (B, C))
    kernel("decode", "last_positions", "PPiii")(blocks(B * C), BLOCK, out.ptr, x.ptr, B, n, C)


def _check_cache(k_cache: DeviceArray, v_cache: DeviceArray, B: int, D: int) -> None:
    if len(k_cache.shape) != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be (B={B}, KV, T_max, D={D}), got {k_cache.shape} and {v_cache.shape}")
