"""The bf16 GEMM's front (twin llama/twins/matmul.py): checks device arrays, builds the GemmProblem
(llama/ops/gemm_problem.py) and runs it on one of the versions the plan picks from, GEMM_VERSIONS: version 1
(llama/ops/gemm_mma.py, kernels/gemm_mma.cu) or versions 5 to 8 (llama/ops/gemm_wgmma.py,
kernels/gemm_wgmma.cu), split along K where that version's rule says so. Its epilogue can rotate the QKV
projection by RoPE. The FP8 GEMM (llama/ops/fp8.py) runs through the same launch_gemm, and so do the ladder's other
rungs (dev/cuda/gemm_ladder.py, its own versions)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..runtime.cuda import BF16, FP8, DeviceArray, empty
from .common import F32, check, multiprocessors
from .gemm_mma import gemm_mma, splitk_reduce, splitk_splits
from .gemm_problem import GemmProblem
from .gemm_wgmma import gemm_wgmma5, gemm_wgmma6, gemm_wgmma7, gemm_wgmma8, splitk_splits3


@dataclass(frozen=True)
class GemmVersion:
    """One version's launcher: launch(problem), and launch(problem, splits=s) where it splits K inside the kernel
    (any count: the ping-pong versions); the others run a split as a batch of K / splits rows each."""
    launch: Callable
    splits_in_kernel: bool = False


GEMM_VERSIONS = {"mma": GemmVersion(gemm_mma), "wgmma5": GemmVersion(gemm_wgmma5, splits_in_kernel=True),
                 "wgmma6": GemmVersion(gemm_wgmma6), "wgmma7": GemmVersion(gemm_wgmma7),
                 "wgmma8": GemmVersion(gemm_wgmma8, splits_in_kernel=True)}  # the versions the plan picks from


def gemm(c: DeviceArray, a: DeviceArray, b: DeviceArray, trans_a: bool = False, trans_b: bool = False,
         alpha: float = 1.0, accumulate: bool = False, rope: tuple | None = None, *,
         version: str | Callable[[int, int, int], str], versions: dict = GEMM_VERSIONS) -> None:
    """c = alpha * op(a) @ op(b) with bf16 a, b and fp32 accumulation, over 2D arrays or 3D batches.
    op(a) is (M, K): a is (M, K), or (K, M) with trans_a; op(b) is (K, N): b is (K, N), or (N, K) with trans_b.
    c is bf16 or fp32; accumulate (fp32 c only) adds onto c instead of overwriting it, and alpha = 0
    then leaves c untouched. rope = (cos, sin, T, rotated_columns) rotates the first columns of a
    (tokens, heads * D) bf16 output by RoPE at position row % T (the QKV projection).
    version: 'mma' or 'wgmma5' .. 'wgmma8' (a name in versions, GEMM_VERSIONS by default), or a chooser called with
    (M, N, K) that names one (the plan's: llama.run.plan.GemmChooser)."""
    batched = len(c.shape) == 3
    batch = c.shape[0] if batched else 1
    M, N = c.shape[-2:]
    K = a.shape[-2] if trans_a else a.shape[-1]
    lead = (batch,) if batched else ()
    check("a", a, lead + ((K, M) if trans_a else (M, K)), BF16)
    check("b", b, lead + ((N, K) if trans_b else (K, N)), BF16)
    if trans_a and trans_b:
        raise ValueError("gemm: op(a)^T with op(b)^T is not a layout the model needs")
    epilogue = gemm_epilogue("gemm", c, (a, b), M, N, K, accumulate, rope)
    if accumulate and alpha == 0:
        return
    layout = "tn" if trans_a else "nt" if trans_b else "nn"
    launch_gemm(GemmProblem(layout, batch, M, N, K, a.ptr, a.shape[-1], M * K, b.ptr, b.shape[-1], K * N, c.ptr,
                            M * N, alpha=alpha, **epilogue), c, accumulate, version, versions)


def gemm_epilogue(name: str, c: DeviceArray, operands: tuple, M: int, N: int, K: int, accumulate: bool,
                  rope: tuple | None) -> dict:
    """The GemmProblem fields of c's epilogue (mode, and RoPE's table), after the checks every GEMM front makes:
    c's dtype for the mode, a non-empty problem, 16-byte aligned arrays with rows of a multiple of 8 elements
    (16 for FP8 operands)."""
    if c.dtype not in (BF16, F32) or (accumulate and c.dtype != F32) or (rope is not None and c.dtype != BF16):
        raise ValueError(f"{name}: c must be bf16 or fp32, fp32 to accumulate, bf16 with rope; got {c.dtype}")
    if min(M, N, K) < 1:
        raise ValueError(f"{name}: empty problem M={M} N={N} K={K}")
    for label, array in zip(("a", "b", "c"), (*operands, c)):
        multiple = 16 if array.dtype == FP8 else 8  # elements: whole 16-byte vectors (and 4-column quads)
        if array.ptr % 16 or array.shape[-1] % multiple:
            raise ValueError(f"{name}: {label} {array.shape} needs a 16-byte aligned start and rows of a multiple of "
                             f"{multiple} elements; got row length {array.shape[-1]}")
    mode = "acc_f32" if accumulate else "rope_bf16" if rope is not None else "bf16" if c.dtype == BF16 else "f32"
    if rope is None:
        return dict(mode=mode)
    cos, sin, rope_T, rope_cols = rope
    head_dim = 2 * cos.shape[1]
    if (cos.shape[0] < rope_T or sin.shape != cos.shape or cos.dtype != F32 or rope_cols % head_dim or M % rope_T
            or head_dim % 4):
        raise ValueError(f"{name}: rope needs fp32 cos/sin (>= T, D/2), rows = batches of T tokens, whole heads "
                         "of a multiple of 4")
    return dict(mode=mode, cos=cos.ptr, sin=sin.ptr, rope_T=rope_T, rope_cols=rope_cols, head_dim=head_dim)


def launch_gemm(problem: GemmProblem, c: DeviceArray, accumulate: bool,
                version: str | Callable[[int, int, int], str], versions: dict[str, GemmVersion]) -> None:
    """Run a checked problem on `version` (a name in versions, or a chooser of one by (M, N, K)), split along K
    where that version's rule says so."""
    M, N, K, alpha = problem.M, problem.N, problem.K, problem.alpha
    if callable(version):
        version = version(M, N, K)
    if version not in versions:
        raise ValueError(f"gemm: unknown version {version!r} ({', '.join(versions)})")
    launch, in_kernel = versions[version].launch, versions[version].splits_in_kernel
    splits = splitk_splits3(problem, multiprocessors()) if in_kernel else splitk_splits(problem)
    if splits == 1:
        launch(problem)
        return
    # Split-K for weight gradients with few output tiles: partial products over ranges of K, summed in
    # a fixed order (deterministic, no atomics). Versions 5 and 8 split K inside the kernel (any count);
    # the others run the splits as a batch over K / splits rows each.
    partial = _workspace(splits * M * N)
    partials = replace(problem, c=partial.ptr, mode="f32", alpha=1.0)
    if in_kernel:
        launch(partials, splits=splits)
    else:
        part_k = K // splits
        launch(replace(partials, batch=splits, K=part_k, stride_a=part_k * M, stride_b=part_k * N))
    splitk_reduce(c, partial, splits, accumulate, alpha)


_WORKSPACE = {}


def _workspace(size: int) -> DeviceArray:
    """Scratch for split-K partials, grown on demand (the first step allocates it, not later ones)."""
    if _WORKSPACE.get("array") is None or _WORKSPACE["array"].size < size:
        _WORKSPACE["array"] = empty(size)
    return _WORKSPACE["array"]
