"""Launchers of the GEMM versions 5 to 8 that the plan runs on Hopper (kernels/gemm_wgmma.cu, sm_90a; the ladder's
other rungs on the same templates launch through launch_cooperative and launch_pingpong from dev/cuda/gemm_ladder.py):
TMA tensor maps encoded through the driver (ctypes on libcuda, cuTensorMapEncodeTiled).

Maps depend only on pointers and shapes, so they are cached, on the host and in device memory
(the kernel reads them from there: PyCUDA's launches carry at most 256 bytes of arguments): a
training step that reuses its buffers encodes and uploads each pair of maps once.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import numpy as np

from ..runtime.cuda import DeviceArray, driver, runtime, to_device, zeros
from .common import kernel, kernel_constant, kernel_entries, multiprocessors
from .gemm_problem import GemmProblem

MODULE = "gemm_wgmma"  # the module of the launchers below (and the default of launch_cooperative, launch_pingpong)
BM, BK = kernel_constant("gemm_wgmma", "WG_BM"), kernel_constant("gemm_wgmma", "WG_BK")


def cooperative_stages(module: str = MODULE, directory: Path | None = None) -> dict[int, int]:
    """The pipeline stages by tile width of a module's cooperative entries (versions 6 and 7 here)."""
    return {int(bn): int(stages) for name, bn, stages, *_ in kernel_entries(module, "GEMM_WGMMA_ENTRY", directory)
            if "_nt_" in name}


STAGES = cooperative_stages()
PINGPONG_STAGED_STAGES = kernel_constant("gemm_wgmma", "PP5_STAGES")  # versions 5 and 8
STAGING_BYTES = kernel_constant("gemm_wgmma", "STAGING_BYTES")  # versions 5 to 8: the epilogue's staged rows
UNIT_RING_BYTES = kernel_constant("gemm_wgmma", "UNIT_RING_BYTES")  # versions 7, 8: the claimed units' ring
# the ping-pong versions' split-K model (version 3's, H200 figures): one 128x128x64 k-block on one SM at ~650
# TFLOP/s over 132 SMs; the reduce pass's bandwidth and its launch
KBLOCK_SECONDS, REDUCE_BYTES_PER_SECOND, REDUCE_LAUNCH_SECONDS, MAX_SPLITS = 0.43e-6, 3e12, 3e-6, 32
UINT8_TYPE, BF16_TYPE, INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZERO = 0, 9, 0, 3, 3, 0


@functools.cache
def _encode():
    function = driver().cuTensorMapEncodeTiled
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                         ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                         ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return function


@functools.lru_cache(maxsize=4096)
def tensor_map(ptr: int, inner: int, rows: int, batches: int, ld: int, batch_stride: int, box_rows: int,
               element_bytes: int = 2) -> bytes:
    """The 128-byte CUtensorMap of a (batches, rows, inner) bf16 (element_bytes 2) or FP8 (1) array with row
    stride ld and batch stride batch_stride (elements), read in boxes of 128 bytes (inner) x box_rows,
    128-byte swizzled."""
    storage = ctypes.create_string_buffer(128 + 64)
    address = (ctypes.addressof(storage) + 63) & ~63  # the map must be 64-byte aligned
    dims = (ctypes.c_uint64 * 3)(inner, rows, batches)
    strides = (ctypes.c_uint64 * 2)(ld * element_bytes, max(batch_stride, rows * ld) * element_bytes)
    box = (ctypes.c_uint32 * 3)(128 // element_bytes, box_rows, 1)
    unit = (ctypes.c_uint32 * 3)(1, 1, 1)
    element_type = BF16_TYPE if element_bytes == 2 else UINT8_TYPE
    result = _encode()(address, element_type, 3, ptr, dims, strides, box, unit, INTERLEAVE_NONE, SWIZZLE_128B,
                       L2_PROMOTION_256B, OOB_FILL_ZERO)
    if result != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {result} for a ({batches}, {rows}, {inner}) "
                           f"{'bf16' if element_bytes == 2 else 'FP8'} array with row stride {ld}")
    return ctypes.string_at(address, 128)


def operand_maps(p: GemmProblem, bn: int) -> tuple[bytes, bytes]:
    """A's and B's maps: K-major operands in boxes of 128 bytes (K) x tile rows, M/N-major in 64 x 64 slabs."""
    if p.fp8:  # 'nt' only: both K-major, 128 values per row of a box
        return (tensor_map(p.a, p.K, p.M, p.batch, p.lda, p.stride_a, BM, 1),
                tensor_map(p.b, p.K, p.N, p.batch, p.ldb, p.stride_b, bn, 1))
    if p.layout == "tn":  # A stored (K, M)
        map_a = tensor_map(p.a, p.M, p.K, p.batch, p.lda, p.stride_a, BK)
    else:                 # A stored (M, K)
        map_a = tensor_map(p.a, p.K, p.M, p.batch, p.lda, p.stride_a, BM)
    if p.layout == "nt":  # B stored (N, K)
        map_b = tensor_map(p.b, p.K, p.N, p.batch, p.ldb, p.stride_b, bn)
    else:                 # B stored (K, N)
        map_b = tensor_map(p.b, p.N, p.K, p.batch, p.ldb, p.stride_b, BK)
    return map_a, map_b


def gemm_wgmma6(p: GemmProblem, bn: int | None = None) -> None:
    """Version 6: wgmma + TMA, warp-specialized, persistent (one CTA per multiprocessor at most), cooperative
    consumers (the ladder's version 2) whose epilogue sends each warp's rows through shared memory and writes them
    as whole row segments (version 5's epilogue)."""
    launch_cooperative(p, bn, "gemm_wgmma6", staging=STAGING_BYTES)


def gemm_wgmma7(p: GemmProblem, bn: int | None = None) -> None:
    """Version 7: version 6 whose CTAs claim their tiles after the first (their block index) one by one from a
    counter (tile_counter()) instead of taking every grid-th, so that CTAs that start late (multiprocessors held
    by NCCL) leave those tiles to the others. The same results bit for bit."""
    launch_cooperative(p, bn, "gemm_wgmma7", staging=STAGING_BYTES, dynamic=True)


def launch_cooperative(p: GemmProblem, bn: int | None, entry: str, staging: int, dynamic: bool = False,
                       stages: dict[int, int] = STAGES, module: str = MODULE, directory: Path | None = None) -> None:
    """Launch a cooperative version's kernel `entry`_<layout>_128x<bn> (versions 6 and 7; the ladder's 2) of
    <directory>/<module>.cu (kernels/gemm_wgmma.cu by default), whose entries have these stages by tile width."""
    sms = multiprocessors()
    if bn is None:  # the wide tile once it alone fills the GPU
        bn = 256 if math.ceil(p.M / BM) * math.ceil(p.N / 256) * p.batch >= sms else 128
    tiles = math.ceil(p.M / BM) * math.ceil(p.N / bn) * p.batch
    maps = device_maps(b"".join(operand_maps(p, bn)))
    shared = stages[bn] * (BM + bn) * BK * 2 + staging + 1024 + 16 * stages[bn] + UNIT_RING_BYTES * dynamic
    kind, extra = _variant(p, dynamic)
    kernel(module, f"{entry}_{kind}_128x{bn}", "PP" + "P" * len(extra) + "PPqiiiiiiiiif", directory)(
        (min(tiles, sms),), 384, maps.ptr, p.c, *extra, p.cos, p.sin, p.stride_c, p.M, p.N, p.K, p.batch,
        *p.epilogue_args(), shared=shared)


def _variant(p: GemmProblem, dynamic: bool) -> tuple[str, tuple]:
    """The kernel name's operand part (the layout, or 'fp8': both operands K-major, 'nt') and the arguments after c:
    FP8's scales, or bf16's tile counter (versions 7 and 8; null for the others)."""
    if not p.fp8:
        return p.layout, (tile_counter().ptr if dynamic else 0,)
    if dynamic or p.layout != "nt":
        raise ValueError(f"FP8 GEMMs take both operands K-major ('nt', not {p.layout!r}) on a static version")
    return "fp8", (p.row_scales, p.col_scales)


def tile_counter() -> DeviceArray:
    """Versions 7 and 8's tile counter on the runtime's current stream: one uint32, zeroed once; every launch
    leaves it at zero. A stream's launches run one after another, so one counter serves them all (two streams'
    may overlap: one each). Allocated by the stream's first launch, which must come before a graph capture (as
    the tensor maps' upload)."""
    stream = runtime().stream.handle
    if stream not in _TILE_COUNTERS:
        _TILE_COUNTERS[stream] = zeros(1, np.uint32)
    return _TILE_COUNTERS[stream]


_TILE_COUNTERS = {}


def gemm_wgmma5(p: GemmProblem, splits: int = 1) -> None:
    """Version 5: ping-pong consumer warpgroups on 128 x 128 tiles, persistent (the ladder's version 3), whose
    epilogue sends each warp's rows through shared memory and writes them as whole row segments. splits > 1 (one
    batch, fp32 c): split s multiplies k-blocks [s * split_kb, (s + 1) * split_kb) and writes its partial product to
    batch s of c (splits, M, N); splits is a count that splitk_splits3 returns."""
    launch_pingpong(p, splits, "gemm_wgmma5", PINGPONG_STAGED_STAGES, staging=STAGING_BYTES)


def gemm_wgmma8(p: GemmProblem, splits: int = 1) -> None:
    """Version 8: version 5 whose CTAs claim their work units (split-K ones too) one by one from a counter, as
    version 7's. splits as version 5's; the same results bit for bit."""
    launch_pingpong(p, splits, "gemm_wgmma8", PINGPONG_STAGED_STAGES, staging=STAGING_BYTES, dynamic=True)


def launch_pingpong(p: GemmProblem, splits: int, entry: str, stages: int, staging: int, dynamic: bool = False,
                    module: str = MODULE, directory: Path | None = None) -> None:
    """Launch a ping-pong version's kernel `entry`_<layout> (versions 5 and 8; the ladder's 3) of
    <directory>/<module>.cu (kernels/gemm_wgmma.cu by default)."""
    k_blocks = math.ceil(p.K / p.k_block)
    split_kb = math.ceil(k_blocks / splits)
    if splits > 1 and (p.batch != 1 or p.mode != "f32" or math.ceil(k_blocks / split_kb) != splits):
        raise ValueError(f"{entry}: {splits} splits of {k_blocks} k-blocks (fp32 partials of one batch, "
                         "every split non-empty) are not a valid split")
    units = math.ceil(p.M / BM) * math.ceil(p.N / 128) * p.batch * splits
    maps = device_maps(b"".join(operand_maps(p, 128)))
    shared = stages * (BM + 128) * BK * 2 + staging + 1024 + 16 * stages + 16 + UNIT_RING_BYTES * dynamic
    kind, extra = _variant(p, dynamic)
    kernel(module, f"{entry}_{kind}", "PP" + "P" * len(extra) + "PPqiiiiiiiiiiif", directory)(
        (min(units, multiprocessors()),), 384, maps.ptr, p.c, *extra, p.cos, p.sin, p.stride_c, p.M, p.N, p.K,
        p.batch, splits, split_kb, *p.epilogue_args(), shared=shared)


def splitk_splits3(p: GemmProblem, sms: int) -> int:
    """The ping-pong versions' split-K count (5 and 8; the ladder's 3, which brought it) for a weight gradient (tn
    or FP8's nt, fp32 out, one batch) on sms multiprocessors: the one that minimizes a model of the time, rounds of
    128 x 128 work units over the multiprocessors times k-blocks per split, plus the reduce pass (reads the partials
    and c, writes c). Any count of non-empty splits."""
    if (p.layout != "tn" and not p.fp8) or p.batch != 1 or p.mode not in ("f32", "acc_f32"):
        return 1
    tiles, k_blocks = math.ceil(p.M / BM) * math.ceil(p.N / 128), math.ceil(p.K / p.k_block)
    best, best_seconds = 1, math.inf
    for splits in range(1, min(MAX_SPLITS, k_blocks) + 1):
        split_kb = math.ceil(k_blocks / splits)
        if math.ceil(k_blocks / split_kb) != splits:  # an empty last split: a smaller count does the same
            continue
        seconds = math.ceil(tiles * splits / sms) * split_kb * KBLOCK_SECONDS
        if splits > 1:
            seconds += (splits + 2) * p.M * p.N * 4 / REDUCE_BYTES_PER_SECOND + REDUCE_LAUNCH_SECONDS
        if seconds < best_seconds:
            best, best_seconds = splits, seconds
    return best


@functools.lru_cache(maxsize=4096)
def device_maps(maps: bytes) -> DeviceArray:
    """The A and B maps in device memory (allocations are 256-byte aligned; a map needs 64)."""
    return to_device(np.frombuffer(maps, dtype=np.uint8))
