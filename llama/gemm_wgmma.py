"""Launcher of the GEMM ladder's version 2 (kernels/gemm_wgmma.cu, Hopper sm_90a): TMA tensor maps
encoded through the driver (ctypes on libcuda, cuTensorMapEncodeTiled) and passed by value.

Maps depend only on pointers and shapes, so they are cached, on the host and in device memory
(the kernel reads them from there: PyCUDA's launches carry at most 256 bytes of arguments): a
training step that reuses its buffers encodes and uploads each pair of maps once.
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np

from .cuda import DeviceArray, to_device
from .ops import GemmProblem, _kernel, multiprocessors

BM, BK = 128, 64
STAGES = {256: 4, 128: 6}
BF16_TYPE, INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZERO = 9, 0, 3, 3, 0


@functools.cache
def _encode():
    function = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                         ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                         ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return function


@functools.lru_cache(maxsize=4096)
def tensor_map(ptr: int, inner: int, rows: int, batches: int, ld: int, batch_stride: int, box_rows: int) -> bytes:
    """The 128-byte CUtensorMap of a (batches, rows, inner) bf16 array with row stride ld and batch
    stride batch_stride (elements), read in boxes of 64 (inner) x box_rows, 128-byte swizzled."""
    storage = ctypes.create_string_buffer(128 + 64)
    address = (ctypes.addressof(storage) + 63) & ~63  # the map must be 64-byte aligned
    dims = (ctypes.c_uint64 * 3)(inner, rows, batches)
    strides = (ctypes.c_uint64 * 2)(ld * 2, max(batch_stride, rows * ld) * 2)
    box = (ctypes.c_uint32 * 3)(64, box_rows, 1)
    unit = (ctypes.c_uint32 * 3)(1, 1, 1)
    result = _encode()(address, BF16_TYPE, 3, ptr, dims, strides, box, unit, INTERLEAVE_NONE, SWIZZLE_128B,
                       L2_PROMOTION_256B, OOB_FILL_ZERO)
    if result != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {result} for a ({batches}, {rows}, {inner}) "
                           f"bf16 array with row stride {ld}")
    return ctypes.string_at(address, 128)


def operand_maps(p: GemmProblem, bn: int) -> tuple[bytes, bytes]:
    """A's and B's maps: K-major operands in boxes of 64 (K) x tile rows, M/N-major in 64 x 64 slabs."""
    if p.layout == "tn":  # A stored (K, M)
        map_a = tensor_map(p.a, p.M, p.K, p.batch, p.lda, p.stride_a, BK)
    else:                 # A stored (M, K)
        map_a = tensor_map(p.a, p.K, p.M, p.batch, p.lda, p.stride_a, BM)
    if p.layout == "nt":  # B stored (N, K)
        map_b = tensor_map(p.b, p.K, p.N, p.batch, p.ldb, p.stride_b, bn)
    else:                 # B stored (K, N)
        map_b = tensor_map(p.b, p.N, p.K, p.batch, p.ldb, p.stride_b, BK)
    return map_a, map_b


def gemm_wgmma(p: GemmProblem, bn: int | None = None) -> None:
    """Version 2: wgmma + TMA, warp-specialized, persistent (one CTA per multiprocessor at most)."""
    sms = multiprocessors()
    if bn is None:  # the wide tile once it alone fills the GPU
        bn = 256 if math.ceil(p.M / BM) * math.ceil(p.N / 256) * p.batch >= sms else 128
    tiles = math.ceil(p.M / BM) * math.ceil(p.N / bn) * p.batch
    maps = device_maps(b"".join(operand_maps(p, bn)))
    shared = STAGES[bn] * (BM + bn) * BK * 2 + 1024 + 16 * STAGES[bn]
    _kernel("gemm_wgmma", f"gemm_wgmma_{p.layout}_128x{bn}", "PPPPqiiiiiiiiif")(
        (min(tiles, sms),), 384, maps.ptr, p.c, p.cos, p.sin, p.stride_c, p.M, p.N, p.K, p.batch,
        *p.epilogue_args(), shared=shared)


@functools.lru_cache(maxsize=4096)
def device_maps(maps: bytes) -> DeviceArray:
    """The A and B maps in device memory (allocations are 256-byte aligned; a map needs 64)."""
    return to_device(np.frombuffer(maps, dtype=np.uint8))
