"""Launchers of the bf16 mixed-precision path (llama/model/gpu_bf16.py), one per kernel.

Activations are bf16 (llama.cuda.BF16); weights are read from the bf16 copy that adamw_update_bf16
writes next to the fp32 master weights; weight gradients, rstd, losses and the optimizer state are
fp32. The kernels move 16-byte vectors (8 bf16 or 4 fp32), so rows hold a multiple of 8 elements
and arrays start 16-byte aligned (allocations do, and views at offsets that are multiples of 8
elements). Scratch buffers that hold completion counters are allocated zeroed once
(llama.cuda.zeros); every launch leaves the counters at zero again.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import numpy as np

from ..cuda import BF16, FP8, DeviceArray, empty, runtime
from ..optim import DYNAMIC_SIGNED, DYNAMIC_UNSIGNED, MIDPOINTS, QUANT_BLOCK, AdamWConfig
from .common import (BLOCK, CLASSIFIER_BLOCK, F32, F64, I32, NORM_BLOCKS, U8, blocks, check, check_aligned, kernel,
                     multiprocessors)
from .gemm_mma import gemm_mma, splitk_reduce, splitk_splits
from .gemm_problem import GemmProblem
from .gemm_wgmma import (gemm_wgmma, gemm_wgmma3, gemm_wgmma4, gemm_wgmma5, gemm_wgmma6, gemm_wgmma7, gemm_wgmma8,
                          splitk_splits3)

EMBEDDING_SEGMENT = 16  # positions per segment, as in kernels/embedding.cu
EMBEDDING_FORWARD_VECTORS = 4  # 16-byte vectors per thread of embedding_forward_bf16, as in kernels/embedding.cu
RMSNORM_BF16_PARTS, RMSNORM_BF16_GROUP = 256, 16  # fixed row partition of the dweight sums, and its grouping
ADAMW_SCALARS = 3  # lr, 1 - beta1^step, 1 - beta2^step
VECTOR = 8  # bf16 elements per 16-byte vector: rows hold a multiple of this


def check_vectors(row: int, **arrays: DeviceArray) -> None:
    """Rows of a multiple of 8 elements and 16-byte aligned arrays, for 16-byte vector accesses."""
    if row % VECTOR:
        raise ValueError(f"bf16 kernels need rows of a multiple of {VECTOR} elements, got {row}")
    check_aligned(**arrays)


def _row_block(C: int, threads: int) -> tuple[int, int]:
    """A 2D block (threads per row, rows): one thread per 8 columns, in whole warps, about `threads` in all."""
    if not 0 < C <= 8192:
        raise ValueError(f"bf16 row kernels take 0 < C <= 8192 columns, got {C}")
    per_row = 32 * math.ceil(C / 256)
    return per_row, max(1, threads // per_row)


# ---- the GEMM (its versions: llama/ops/gemm_mma.py, llama/ops/gemm_wgmma.py)

GEMM_VERSIONS = {"mma": gemm_mma, "wgmma": gemm_wgmma, "wgmma3": gemm_wgmma3, "wgmma4": gemm_wgmma4,
                 "wgmma5": gemm_wgmma5, "wgmma6": gemm_wgmma6, "wgmma7": gemm_wgmma7,
                 "wgmma8": gemm_wgmma8}  # the ladder's rungs
SPLIT_IN_KERNEL = ("wgmma3", "wgmma5", "wgmma8")  # versions that split K inside the kernel (any count)


def gemm(c: DeviceArray, a: DeviceArray, b: DeviceArray, trans_a: bool = False, trans_b: bool = False,
         alpha: float = 1.0, accumulate: bool = False, rope: tuple | None = None, *,
         version: str | Callable[[int, int, int], str]) -> None:
    """c = alpha * op(a) @ op(b) with bf16 a, b and fp32 accumulation, over 2D arrays or 3D batches.
    op(a) is (M, K): a is (M, K), or (K, M) with trans_a; op(b) is (K, N): b is (K, N), or (N, K) with trans_b.
    c is bf16 or fp32; accumulate (fp32 c only) adds onto c instead of overwriting it, and alpha = 0
    then leaves c untouched. rope = (cos, sin, T, rotated_columns) rotates the first columns of a
    (tokens, heads * D) bf16 output by RoPE at position row % T (the QKV projection).
    version: 'mma' or 'wgmma' .. 'wgmma8' (GEMM_VERSIONS), or a chooser called with (M, N, K) that names
    one (the plan's: llama.plan.GemmChooser)."""
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
                            M * N, alpha=alpha, **epilogue), c, accumulate, version, GEMM_VERSIONS)


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
                version: str | Callable[[int, int, int], str], versions: dict) -> None:
    """Run a checked problem on `version` (a name in versions, or a chooser of one by (M, N, K)), split along K
    where that version's rule says so."""
    M, N, K, alpha = problem.M, problem.N, problem.K, problem.alpha
    if callable(version):
        version = version(M, N, K)
    if version not in versions:
        raise ValueError(f"gemm: unknown version {version!r} ({', '.join(versions)})")
    launch = versions[version]
    splits = splitk_splits3(problem, multiprocessors()) if version in SPLIT_IN_KERNEL else splitk_splits(problem)
    if splits == 1:
        launch(problem)
        return
    # Split-K for weight gradients with few output tiles: partial products over ranges of K, summed in
    # a fixed order (deterministic, no atomics). Versions 3, 5 and 8 split K inside the kernel (any count);
    # the others run the splits as a batch over K / splits rows each.
    partial = _workspace(splits * M * N)
    partials = replace(problem, c=partial.ptr, mode="f32", alpha=1.0)
    if version in SPLIT_IN_KERNEL:
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


# ---- layers


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


def rmsnorm_residual_forward_bf16(residual_out: DeviceArray | None, ln_out: DeviceArray, rstd: DeviceArray,
                             x: DeviceArray, branch: DeviceArray | None, weight: DeviceArray, eps: float) -> None:
    """residual_out (N, C) = x + branch, and ln_out = rmsnorm(residual_out) * weight, all bf16, with
    rstd (N,) fp32; weight is the fp32 master weight. branch=None with residual_out=None: a plain RMSNorm
    of x. residual_out may be x."""
    N, C = x.shape
    if (branch is None) != (residual_out is None):
        raise ValueError("rmsnorm_residual_forward_bf16: give both branch and residual_out, or neither")
    named = {"x": x, "ln_out": ln_out} | ({} if branch is None else {"branch": branch, "residual_out": residual_out})
    for name, array in named.items():
        check(name, array, (N, C), BF16)
    check("rstd", rstd, (N,))
    check("weight", weight, (C,))
    check_vectors(C, weight=weight, **named)
    per_row, rows = _row_block(C, BLOCK)
    kernel("rmsnorm", "rmsnorm_residual_forward_bf16", "PPPPPPiif")(
        (math.ceil(N / rows),), (per_row, rows), 0 if residual_out is None else residual_out.ptr, ln_out.ptr, rstd.ptr,
        x.ptr, 0 if branch is None else branch.ptr, weight.ptr, N, C, np.float32(eps))


def rmsnorm_forward_bf16(out: DeviceArray, rstd: DeviceArray, inp: DeviceArray, weight: DeviceArray,
                         eps: float) -> None:
    """out (N, C) = rmsnorm(inp) * weight, bf16; rstd (N,) fp32 (the first norm, with no residual add)."""
    rmsnorm_residual_forward_bf16(None, out, rstd, inp, None, weight, eps)


def rmsnorm_bf16_scratch_size(C: int) -> int:
    """float32 elements of rmsnorm_backward_bf16's scratch: partial and group sums, then counters."""
    groups = RMSNORM_BF16_PARTS // RMSNORM_BF16_GROUP
    return (RMSNORM_BF16_PARTS + groups) * C + groups + 1


def rmsnorm_backward_bf16(dresidual: DeviceArray, dweight: DeviceArray, scratch: DeviceArray, dln: DeviceArray,
                          h: DeviceArray, weight: DeviceArray, rstd: DeviceArray) -> None:
    """dresidual (N, C) bf16 += the norm's input gradient (the residual gradient passes the add
    unchanged), dweight (C,) fp32 += its gradient, deterministic, in one launch; h is the norm's bf16
    input, weight its fp32 master weight. scratch float32 (rmsnorm_bf16_scratch_size(C),), zeroed once."""
    N, C = h.shape
    for name, array in (("dresidual", dresidual), ("dln", dln), ("h", h)):
        check(name, array, (N, C), BF16)
    check("dweight", dweight, (C,))
    check("weight", weight, (C,))
    check("rstd", rstd, (N,))
    size = rmsnorm_bf16_scratch_size(C)
    if scratch.dtype != F32 or scratch.size < size:
        raise ValueError(f"scratch: needs {size} float32, has {scratch.size} {scratch.dtype}")
    check_vectors(C, dresidual=dresidual, dweight=dweight, dln=dln, h=h, weight=weight, scratch=scratch)
    per_row, rows = _row_block(C, 512)
    parts, groups = RMSNORM_BF16_PARTS, RMSNORM_BF16_PARTS // RMSNORM_BF16_GROUP
    group_partial, counters = scratch.ptr + parts * C * 4, scratch.ptr + (parts + groups) * C * 4
    kernel("rmsnorm", "rmsnorm_backward_bf16", "PPPPPPPPPiiii")(
        (parts,), (per_row, rows), dresidual.ptr, dweight.ptr, scratch.ptr, group_partial, counters, dln.ptr, h.ptr,
        weight.ptr, rstd.ptr, N, C, max(1, math.ceil(N / parts)), RMSNORM_BF16_GROUP, shared=rows * C * 4)


def swiglu_forward_bf16(out: DeviceArray, gate_up: DeviceArray) -> None:
    """out (N, F) = silu(gate) * up of gate_up (N, 2F) = [gate | up], bf16."""
    N, F = out.shape
    check("out", out, (N, F), BF16)
    check("gate_up", gate_up, (N, 2 * F), BF16)
    check_vectors(F, out=out, gate_up=gate_up)
    kernel("swiglu", "swiglu_forward_bf16", "PPii")(blocks(N * F // 8), BLOCK, out.ptr, gate_up.ptr, N, F)


def swiglu_backward_bf16(dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray) -> None:
    """dgate_up (N, 2F) bf16 from dout (N, F); dgate_up may be gate_up itself (in place)."""
    N, F = dout.shape
    check("dout", dout, (N, F), BF16)
    check("gate_up", gate_up, (N, 2 * F), BF16)
    check("dgate_up", dgate_up, (N, 2 * F), BF16)
    check_vectors(F, dout=dout, gate_up=gate_up, dgate_up=dgate_up)
    kernel("swiglu", "swiglu_backward_bf16", "PPPii")(blocks(N * F // 8), BLOCK, dgate_up.ptr, dout.ptr, gate_up.ptr,
                                                       N, F)


def _max_shared_bytes() -> int:
    """Dynamic shared memory one block may opt in to on this GPU, less room for static shared memory."""
    drv = runtime().drv
    return runtime().device.get_attribute(drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) - 1024


def fused_classifier_bf16(logits: DeviceArray, losses: DeviceArray, targets: DeviceArray, dloss: float) -> None:
    """For a chunk of n tokens: losses (n,) fp32 of the bf16 logits (n, V), any V; the logits are
    overwritten by dlogits = (softmax - onehot) * dloss in bf16."""
    n, V = logits.shape
    check("logits", logits, (n, V), BF16)
    check("losses", losses, (n,))
    check("targets", targets, (n,), I32)
    # thread t keeps vectors t + k * CLASSIFIER_BLOCK of a row: as many slots as shared memory holds,
    # then CLASSIFIER_REG_VECTORS in registers (kernels/classifier.cu); one block per multiprocessor
    smem_slots = min(math.ceil(V // 8 / CLASSIFIER_BLOCK), _max_shared_bytes() // (16 * CLASSIFIER_BLOCK))
    kernel("classifier", "fused_classifier_bf16", "PPPiifi")(
        (max(1, min(n, multiprocessors())),), CLASSIFIER_BLOCK, logits.ptr, losses.ptr, targets.ptr, n, V,
        np.float32(dloss), smem_slots, shared=smem_slots * CLASSIFIER_BLOCK * 16)


def loss_accumulate_bf16(total: DeviceArray, losses: DeviceArray, scale: float) -> None:
    """total (1,) += scale * sum(losses (n,)), fp32, in a fixed order."""
    check("total", total, (1,))
    check("losses", losses, (losses.size,))
    kernel("classifier", "loss_accumulate_bf16", "PPif")((1,), 1024, total.ptr, losses.ptr, losses.size, np.float32(scale))


MAP_SIZE = 256  # entries of each table of quantization_maps(), as in kernels/adamw.cu


def quantization_maps() -> np.ndarray:
    """(4, MAP_SIZE) fp32, the tables adamw8bit_update_bf16 reads: the levels and midpoints of m's map
    (DYNAMIC_SIGNED), then of v's (DYNAMIC_UNSIGNED), levels padded with 0 and midpoints with +inf."""
    tables = np.zeros((4, MAP_SIZE), np.float32)
    for row, levels in ((0, DYNAMIC_SIGNED), (2, DYNAMIC_UNSIGNED)):
        midpoints = MIDPOINTS[id(levels)]
        tables[row, :levels.size] = levels
        tables[row + 1] = np.inf
        tables[row + 1, :midpoints.size] = midpoints
    return tables


def adamw8bit_update_bf16(params: DeviceArray, params_bf16: DeviceArray, grads: DeviceArray, m_codes: DeviceArray,
                          m_scales: DeviceArray, v_codes: DeviceArray, v_scales: DeviceArray, decay_mask: DeviceArray,
                          norm_squared: DeviceArray, scalars: DeviceArray, maps: DeviceArray, opt: AdamWConfig) -> None:
    """adamw_update_bf16 with 8-bit moments, as llama/optim.py's AdamW8bitState stores them: codes (n,) uint8
    and one fp32 scale per QUANT_BLOCK values (m_scales, v_scales), dequantized, updated and quantized
    back in one pass; maps: quantization_maps() on the device. The arrays 16-byte aligned (vector loads)."""
    n, blocks_n = params.size, -(-params.size // QUANT_BLOCK)
    check("params", params, (n,))
    check("params_bf16", params_bf16, (n,), BF16)
    check("grads", grads, (n,))
    for name, array in (("m_codes", m_codes), ("v_codes", v_codes), ("decay_mask", decay_mask)):
        check(name, array, (n,), U8)
    for name, array in (("m_scales", m_scales), ("v_scales", v_scales)):
        check(name, array, (blocks_n,))
    check("norm_squared", norm_squared, (1,))
    check("scalars", scalars, (ADAMW_SCALARS,))
    check("maps", maps, (4, MAP_SIZE))
    check_aligned(params=params, params_bf16=params_bf16, grads=grads, m_codes=m_codes, v_codes=v_codes,
                  decay_mask=decay_mask)
    one_minus = (np.float32(1 - opt.beta1), np.float32(1 - opt.beta2))  # rounded from double, as numpy has them
    kernel("adamw", "adamw8bit_update_bf16", "PPPPPPPPPPPqfffffff")(
        blocks(blocks_n * 32, BLOCK), BLOCK, params.ptr, params_bf16.ptr, grads.ptr, m_codes.ptr, m_scales.ptr,
        v_codes.ptr, v_scales.ptr, decay_mask.ptr, norm_squared.ptr, scalars.ptr, maps.ptr, n,
        np.float32(opt.beta1), np.float32(opt.beta2), *one_minus,
        *(np.float32(x) for x in (opt.eps, opt.weight_decay, opt.grad_clip)))


def clip_norm_estimate(out: DeviceArray, current: DeviceArray, previous: DeviceArray, group: int) -> None:
    """out (1,) = the squared norm by which the optimizer in the backward clips `group`'s update:
    sum(current[group:]) + sum(previous[:group]), this step's squared group norms (current (P,), final
    from `group` on) and the last step's (llama/optim.py's clip_norm_estimate), fp32 in a fixed order."""
    check("out", out, (1,))
    check("current", current, (current.size,))
    check("previous", previous, (current.size,))
    if not 0 <= group < current.size:
        raise ValueError(f"group {group} outside the {current.size} groups")
    kernel("global_norm", "clip_norm_estimate", "PPPii")((1,), 32, out.ptr, current.ptr, previous.ptr, group,
                                                         current.size)


def global_norm_squared_bf16(out: DeviceArray, scratch: DeviceArray, grads: DeviceArray) -> None:
    """out (1,) = sum(grads^2) of the flat fp32 gradients, deterministic, in one launch; scratch
    float64 (NORM_BLOCKS + 1,), zeroed once (its last word holds the completion counter)."""
    check("out", out, (1,))
    check("scratch", scratch, (NORM_BLOCKS + 1,), F64)
    check("grads", grads, grads.shape)
    check_vectors(8, grads=grads, scratch=scratch)
    kernel("global_norm", "global_norm_squared_bf16", "PPPPq")((NORM_BLOCKS,), BLOCK, out.ptr, scratch.ptr,
                                                         scratch.ptr + NORM_BLOCKS * 8, grads.ptr, grads.size)


def adamw_scalars(step: int, lr: float, opt: AdamWConfig) -> np.ndarray:
    """The step-dependent values adamw_update_bf16 reads on the device (step counts from 1)."""
    return np.array([lr, 1 - opt.beta1 ** step, 1 - opt.beta2 ** step], dtype=np.float32)


def adamw_update_bf16(params: DeviceArray, params_bf16: DeviceArray, grads: DeviceArray, m: DeviceArray,
                      v: DeviceArray, decay_mask: DeviceArray, norm_squared: DeviceArray, scalars: DeviceArray,
                      opt: AdamWConfig) -> None:
    """adamw_update on the fp32 flat buffers, clipped to opt.grad_clip by the device-side norm, writing
    the bf16 copy params_bf16 of the new params in the same pass; scalars (ADAMW_SCALARS,) fp32 on the
    device holds adamw_scalars(step, lr, opt)."""
    n = params.size
    check("params", params, (n,))
    check("params_bf16", params_bf16, (n,), BF16)
    for name, array in (("grads", grads), ("m", m), ("v", v)):
        check(name, array, (n,))
    check("decay_mask", decay_mask, (n,), U8)
    check("norm_squared", norm_squared, (1,))
    check("scalars", scalars, (ADAMW_SCALARS,))
    check_vectors(8, params=params, params_bf16=params_bf16, grads=grads, m=m, v=v, decay_mask=decay_mask)
    kernel("adamw", "adamw_update_bf16", "PPPPPPPPqfffff")(
        blocks(n, BLOCK * 8), BLOCK, params.ptr, params_bf16.ptr, grads.ptr, m.ptr, v.ptr, decay_mask.ptr,
        norm_squared.ptr, scalars.ptr, n, *(np.float32(x) for x in (opt.beta1, opt.beta2, opt.eps, opt.weight_decay,
                                                                     opt.grad_clip)))


# ---- precision conversions (kernels/convert.cu)

def round_to_bf16(out: DeviceArray, x: DeviceArray) -> None:
    """out (n,) bf16 = x (n,) fp32, rounded to nearest even."""
    check("x", x, out.shape)
    check("out", out, x.shape, BF16)
    kernel("convert", "round_to_bf16", "PPq")(blocks(x.size), BLOCK, out.ptr, x.ptr, x.size)


def widen_bf16(out: DeviceArray, x: DeviceArray, accumulate: bool = False) -> None:
    """out (n,) fp32 = x (n,) bf16, or out += x with accumulate."""
    check("x", x, out.shape, BF16)
    check("out", out, x.shape)
    kernel("convert", "widen_bf16", "PPqi")(blocks(x.size), BLOCK, out.ptr, x.ptr, x.size, int(accumulate))
