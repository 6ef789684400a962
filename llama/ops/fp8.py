"""--dtype fp8's launchers: the FP8 casts (kernels/fp8.cu), float8 e4m3fn (llama.runtime.cuda.FP8) with one power-of-two
fp32 scale per row or per column, bit for bit llama/twins/fp8.py's quantize_fp8; and the FP8 GEMM
(kernels/gemm_wgmma.cu's version 6 with FP8 operands), which multiplies the casts and applies their scales in its
epilogue."""

from __future__ import annotations

import math
from typing import Callable

from ..runtime.cuda import BF16, FP8, DeviceArray, empty
from ..options import FP8_SCALINGS
from .common import I32, U32, check, check_aligned, kernel, kernel_constant
from .gemm import GemmVersion, gemm_epilogue, launch_gemm
from .gemm_problem import GemmProblem
from .gemm_wgmma import gemm_wgmma6

AMAX_ROWS, AMAX_ROW_WARPS = kernel_constant("fp8", "FP8_AMAX_ROWS"), kernel_constant("fp8", "FP8_AMAX_ROW_WARPS")
AMAX_COLUMNS = 32 * 8  # fp8_amax's block: AMAX_ROWS rows of x, warps of 32 lanes that load 8 columns each
TILE = kernel_constant("fp8", "FP8_TILE")  # fp8_cast's tile of x: TILE rows and columns
ROW_VECTORS = kernel_constant("fp8", "FP8_ROW_VECTORS")  # fp8_cast_rows_<V>: V 16-byte vectors a thread, at most
ROW_COLUMNS = 256 * 8  # columns of a row per vector: 256 threads, 8 bf16 each
_AMAX = {}


def _amax_workspace(size: int) -> DeviceArray:
    """fp8_amax's output when the caller gives none, grown on demand (the first call of a shape allocates
    it, not later ones, so a CUDA graph can capture those)."""
    if _AMAX.get("array") is None or _AMAX["array"].size < size:
        _AMAX["array"] = empty(size, U32)
    return _AMAX["array"]


def cast_fp8(x: DeviceArray, rows: DeviceArray | None = None, row_scales: DeviceArray | None = None,
             cols: DeviceArray | None = None, col_scales: DeviceArray | None = None,
             amax: DeviceArray | None = None, scaling: str = "row", amax_ready: bool = False) -> None:
    """The FP8 casts of the bf16 x (R, C) (a 3D (B, T, C) is taken as (B * T, C)), as requested:
    rows (R, C) fp8 with row_scales (R,) fp32 = twins.fp8.quantize_fp8(x, axis=-1, scaling), and/or
    cols (C, R) fp8 = the transpose of the values of quantize_fp8(x, axis=0, scaling), with col_scales (C,) fp32.
    x / scale is exact and rounds to nearest even. scaling "tensor": every scale is the one of x's amax.
    The row-wise cast alone of rows up to ROW_VECTORS * ROW_COLUMNS values runs in one pass over x
    (cast_rows_one_pass); the others take two, the amax then the cast (cast_two_passes), whose scratch amax
    is uint32 or int32 of at least R + C elements (zeroed here before each use), else a workspace of this
    module's. amax_ready (row-wise): amax already holds x's row maxima then its column maxima, as fp8_amax
    leaves them (ops.swiglu_backward_bf16 writes them with x), so the cast skips its amax pass.
    x 16-byte aligned with C a multiple of 8; rows need C, cols R a multiple of 16; both 16-byte aligned."""
    if len(x.shape) == 3:
        x = x.reshape(x.shape[0] * x.shape[1], x.shape[2])
    if len(x.shape) != 2:
        raise ValueError(f"x: expected a 2D (R, C) or 3D (B, T, C) array, got {x.shape}")
    R, C = x.shape
    check("x", x, (R, C), BF16)
    if min(R, C) < 1:
        raise ValueError(f"cast_fp8: empty x {x.shape}")
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"cast_fp8: scaling {scaling!r}, choose from {', '.join(FP8_SCALINGS)}")
    if (rows is None) != (row_scales is None) or (cols is None) != (col_scales is None):
        raise ValueError("cast_fp8: give rows with row_scales and cols with col_scales")
    if rows is None and cols is None:
        raise ValueError("cast_fp8: no output requested (rows, cols)")
    if C % 8:
        raise ValueError(f"x: needs C a multiple of 8 (16-byte loads), got C = {C}")
    outputs = {}
    for name, values, scales, (length, width), width_name in (("rows", rows, row_scales, (R, C), "C"),
                                                                ("cols", cols, col_scales, (C, R), "R")):
        if values is None:
            continue
        check(name, values, (length, width), FP8)
        check(f"{name[:-1]}_scales", scales, (length,))
        if width % 16:
            raise ValueError(f"{name}: needs {width_name} a multiple of 16 (16-byte rows), got {width_name} = {width}")
        outputs[name] = values
    check_aligned(x=x, **outputs)
    if amax is not None and (amax.dtype not in (U32, I32) or amax.size < R + C):
        raise ValueError(f"amax: needs {R + C} uint32 or int32, has {amax.size} {amax.dtype}")
    if amax_ready:
        if amax is None or scaling != "row":
            raise ValueError("cast_fp8: amax_ready needs the amax it names and row-wise scaling")
        cast_from_amax(x, rows, row_scales, cols, col_scales, amax, scaling)
    elif scaling == "row" and cols is None and C <= ROW_VECTORS * ROW_COLUMNS:
        cast_rows_one_pass(x, rows, row_scales)
    else:
        cast_two_passes(x, rows, row_scales, cols, col_scales, amax, scaling)


def cast_rows_one_pass(x: DeviceArray, rows: DeviceArray, row_scales: DeviceArray) -> None:
    """fp8_cast_rows_<V> (v2): the row-wise cast of the checked bf16 x (R, C) in one pass, a block a row holding
    it in registers, with V the least of 1, 2, 4, 8 16-byte vectors a thread that holds C."""
    R, C = x.shape
    vectors = next(v for v in (1, 2, 4, ROW_VECTORS) if C <= v * ROW_COLUMNS)
    kernel("fp8", f"fp8_cast_rows_{vectors}", "PPPi")((R,), 256, rows.ptr, row_scales.ptr, x.ptr, C)


def cast_two_passes(x: DeviceArray, rows: DeviceArray | None, row_scales: DeviceArray | None,
                    cols: DeviceArray | None, col_scales: DeviceArray | None, amax: DeviceArray | None,
                    scaling: str) -> None:
    """fp8_amax then fp8_cast (v1) of the checked bf16 x (R, C): the requested outputs, any scaling."""
    R, C = x.shape
    amax = (amax if amax is not None else _amax_workspace(R + C)).view(0, (R + C,))
    amax.fill_zero()
    row_amax, col_amax = _amax_pointers(amax, R, rows, cols, scaling)
    tensor = int(scaling == "tensor")
    kernel("fp8", "fp8_amax", "PPPiii")((math.ceil(R / AMAX_ROWS), math.ceil(C / AMAX_COLUMNS)), (32, AMAX_ROW_WARPS),
                                        row_amax, 0 if tensor else col_amax, x.ptr, R, C, tensor)
    cast_from_amax(x, rows, row_scales, cols, col_scales, amax, scaling)


def cast_from_amax(x: DeviceArray, rows: DeviceArray | None, row_scales: DeviceArray | None,
                   cols: DeviceArray | None, col_scales: DeviceArray | None, amax: DeviceArray, scaling: str) -> None:
    """fp8_cast of the checked bf16 x (R, C) into the requested outputs, from the row then column maxima in amax
    (for "tensor", x's max in its first element)."""
    R, C = x.shape
    row_amax, col_amax = _amax_pointers(amax, R, rows, cols, scaling)
    kernel("fp8", "fp8_cast", "PPPPPPPiii")((math.ceil(R / TILE), math.ceil(C / TILE)), 256, _ptr(rows),
                                            _ptr(row_scales), _ptr(cols), _ptr(col_scales), x.ptr, row_amax, col_amax,
                                            R, C, int(scaling == "tensor"))


def _amax_pointers(amax: DeviceArray, R: int, rows: DeviceArray | None, cols: DeviceArray | None,
                   scaling: str) -> tuple[int, int]:
    """Where the row and the column maxima of x (R, C) sit in amax: rows first, then columns, null (0) for an
    output not requested; "tensor": both at the first element, which holds x's max."""
    if scaling == "tensor":
        return amax.ptr, amax.ptr
    return 0 if rows is None else amax.ptr, 0 if cols is None else amax.ptr + R * amax.dtype.itemsize


def _ptr(array: DeviceArray | None) -> int:
    """A kernel's pointer argument: null for an output not requested."""
    return 0 if array is None else array.ptr


# ---- the FP8 GEMM (version 6 of kernels/gemm_wgmma.cu with FP8 = true; the ladder's version 5: dev/cuda)

FP8_GEMM_VERSIONS = {"wgmma6": GemmVersion(gemm_wgmma6)}  # the versions the plan picks from


def gemm_fp8(c: DeviceArray, a: DeviceArray, a_scales: DeviceArray, b: DeviceArray, b_scales: DeviceArray,
             alpha: float = 1.0, accumulate: bool = False, rope: tuple | None = None, *,
             version: str | Callable[[int, int, int], str], versions: dict = FP8_GEMM_VERSIONS) -> None:
    """c (M, N) = alpha * (a_scales[:, None] * a) @ (b_scales[:, None] * b)^T: FP8 e4m3 a (M, K) and b (N, K),
    both K-major as FP8 wgmma reads them (cast_fp8 writes the transposed copies a GEMM on another layout needs),
    fp32 accumulation, the power-of-two scales (M,) and (N,) applied in the epilogue. c, alpha, accumulate and
    rope as ops.gemm's. version: 'wgmma6' (a name in versions, FP8_GEMM_VERSIONS by default), or a chooser of one by
    (M, N, K) (the plan's)."""
    M, N = c.shape
    K = a.shape[-1]
    check("a", a, (M, K), FP8)
    check("b", b, (N, K), FP8)
    check("a_scales", a_scales, (M,))
    check("b_scales", b_scales, (N,))
    check_aligned(a_scales=a_scales, b_scales=b_scales)
    epilogue = gemm_epilogue("gemm_fp8", c, (a, b), M, N, K, accumulate, rope)
    if accumulate and alpha == 0:
        return
    launch_gemm(GemmProblem("nt", 1, M, N, K, a.ptr, K, M * K, b.ptr, K, N * K, c.ptr, M * N, alpha=alpha, fp8=True,
                            row_scales=a_scales.ptr, col_scales=b_scales.ptr, **epilogue),
                c, accumulate, version, versions)
