"""RoPE's launchers (kernels/rope.cu; twin llama/twins/rope.py): the fp32 path's split of the packed qkv
projection into head-major q, k, v with q and k rotated, and its backward. The bf16 path rotates in the
QKV GEMM's epilogue (ops.gemm's rope), the decoder in its QKV GEMV (ops.gemv_qkv_rope); every kernel's
rotation is kernels/rope.cuh's."""

from __future__ import annotations

from ..runtime.cuda import DeviceArray
from .common import BLOCK, blocks, check, kernel


def _rope_shapes(q: DeviceArray, k: DeviceArray, v: DeviceArray, qkv: DeviceArray, cos: DeviceArray, sin: DeviceArray):
    B, H, T, D = q.shape
    KV = k.shape[1]
    check("k", k, (B, KV, T, D))
    check("v", v, (B, KV, T, D))
    check("qkv", qkv, (B, T, (H + 2 * KV) * D))
    if cos.shape[0] < T or cos.shape[1:] != (D // 2,) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin: expected (>= {T}, {D // 2}), got {cos.shape} and {sin.shape}")
    return B, T, H, KV, D


def rope_forward(q: DeviceArray, k: DeviceArray, v: DeviceArray, qkv: DeviceArray, cos: DeviceArray,
                 sin: DeviceArray) -> None:
    """qkv (B, T, (H + 2KV) * D) -> head-major q (B, H, T, D), k, v (B, KV, T, D), q and k rotated."""
    B, T, H, KV, D = _rope_shapes(q, k, v, qkv, cos, sin)
    kernel("rope", "rope_forward", "PPPPPPiiiii")(blocks(qkv.size // 2), BLOCK, q.ptr, k.ptr, v.ptr, qkv.ptr,
                                                   cos.ptr, sin.ptr, B, T, H, KV, D)


def rope_backward(dqkv: DeviceArray, dq: DeviceArray, dk: DeviceArray, dv: DeviceArray, cos: DeviceArray,
                  sin: DeviceArray) -> None:
    B, T, H, KV, D = _rope_shapes(dq, dk, dv, dqkv, cos, sin)
    kernel("rope", "rope_backward", "PPPPPPiiiii")(blocks(dqkv.size // 2), BLOCK, dqkv.ptr, dq.ptr, dk.ptr, dv.ptr,
                                                    cos.ptr, sin.ptr, B, T, H, KV, D)
