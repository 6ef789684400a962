"""Launchers of the bf16 flash attention (kernels/flash_attention.cu on mma.sync, kernels/flash_attention_wgmma.cu
on Hopper; twin llama/twins/flash_attention.py): causal grouped-query attention reading q, k, v from the packed
projection, O(T) memory, optionally document-masked (doc_start, doc_end from llama/ops/document_mask.py). The wgmma
build reads its inputs through TMA maps, encoded here. The ladder's rungs (dev/cuda/flash_attention_v<N>.cu) launch
through these too, or, where they differ, through their own launchers in dev/cuda/flash_attention_ladder.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..runtime.cuda import BF16, DeviceArray, runtime
from .common import BLOCK, ROWS_PER_BLOCK, blocks, check, check_aligned, kernel, multiprocessors
from .document_mask import check_document_bounds
from .gemm_wgmma import device_maps, tensor_map

HEAD_DIMS = (64, 128)  # the head dims the kernels are built for
TMA_BOX_ROWS = 64  # the wgmma build loads 64 columns x 64 rows per TMA box


@dataclass(frozen=True)
class FlashSource:
    """Which flash attention build to launch: kernels/flash_attention.cu (the default), kernels/
    flash_attention_wgmma.cu (tma: its kernels take TMA maps first, and its forward the batch count after KV), or
    a rung of the dev/cuda ladder (directory; document_mask: its kernels take doc_start, doc_end last, as every
    production build's do)."""
    module: str = "flash_attention"
    directory: Path | None = None
    tma: bool = False
    document_mask: bool = True


@dataclass(frozen=True)
class _FlashLaunch:
    threads: int
    rows: int  # rows of T per CTA
    shared: int  # dynamic shared memory, bytes
    persistent: bool = False  # the forward's grid is a CTA per SM (at most one per work item), looping over them


_FLASH_CONFIGS = {}
# flash_attention_config's columns: (threads, rows, shared bytes) of the forward, dkdv and dq kernels, then whether
# the forward is persistent
_CONFIG_COLUMNS = {"forward": 0, "dkdv": 3, "dq": 6}
_FORWARD_PERSISTENT = 9


def flash_config(source: FlashSource, D: int, which: str) -> _FlashLaunch:
    """The launch shape of one kernel ('forward', 'dkdv' or 'dq'), from the module's own flash_attention_config
    table, so that tile sizes are defined once, in the .cu file."""
    if source not in _FLASH_CONFIGS:
        rt = runtime()
        # every build unit of the file holds the table; it is read from the forward's, which a run loads first
        module = rt.module(source.module, source.directory, f"flash_attention_forward_d{D}")
        pointer, nbytes = module.get_global("flash_attention_config")
        table = np.empty((2, nbytes // 8), dtype=np.int32)
        rt.drv.memcpy_dtoh(table, pointer)
        _FLASH_CONFIGS[source] = table
    row = _FLASH_CONFIGS[source][{64: 0, 128: 1}[D]]
    at = _CONFIG_COLUMNS[which]
    persistent = which == "forward" and bool(row[_FORWARD_PERSISTENT])
    return _FlashLaunch(*(int(x) for x in row[at:at + 3]), persistent)


def flash_shapes(qkv: DeviceArray, n_heads: int, n_kv_heads: int) -> tuple[int, int, int, int, int]:
    """B, T, H, KV, D of a packed (B, T, (H + 2KV) * D) bf16 qkv; D must be 64 or 128."""
    H, KV = n_heads, n_kv_heads
    if KV < 1 or H < 1 or H % KV:
        raise ValueError(f"flash attention: {H} query heads cannot share {KV} kv heads")
    if not isinstance(qkv, DeviceArray) or len(qkv.shape) != 3 or qkv.dtype != BF16:
        raise ValueError(f"qkv: expected a bf16 DeviceArray (B, T, (H + 2KV) * D), got {qkv!r}")
    B, T, C = qkv.shape
    if B < 1 or T < 1 or C % (H + 2 * KV) or C // (H + 2 * KV) not in HEAD_DIMS:
        raise ValueError(f"qkv: expected (B >= 1, T >= 1, {H + 2 * KV} heads * D) with D 64 or 128, got {qkv.shape}")
    return B, T, H, KV, C // (H + 2 * KV)


def _tma_maps(qkv: DeviceArray, dout: DeviceArray | None = None) -> tuple:
    """The wgmma build's leading argument: the device address of qkv's map, then dout's (the backward)."""
    B, T, C = qkv.shape
    maps = tensor_map(qkv.ptr, C, T, B, C, T * C, TMA_BOX_ROWS)
    if dout is not None:
        HD = dout.shape[2]
        maps += tensor_map(dout.ptr, HD, T, B, HD, T * HD, TMA_BOX_ROWS)
    return (device_maps(maps).ptr,)


def _document_mask(source: FlashSource, doc_start: DeviceArray | None, doc_end: DeviceArray | None, B: int,
                   T: int) -> tuple[str, tuple]:
    """The kernels' trailing document-mask parameters: their signature letters and values (null pointers: plain
    causal); none for a ladder rung without them."""
    pointers = check_document_bounds(doc_start, doc_end, B, T)
    if source.document_mask:
        return "PP", pointers
    if doc_start is not None:
        raise ValueError(f"doc_start: {source.module} has no document mask")
    return "", ()


def flash_attention_forward(out: DeviceArray, lse: DeviceArray, qkv: DeviceArray, n_heads: int, n_kv_heads: int, *,
                            source: FlashSource, doc_start: DeviceArray | None = None,
                            doc_end: DeviceArray | None = None) -> None:
    """Causal grouped-query attention of the packed projection qkv (B, T, (H + 2KV) * D) bf16, q and k
    already rotated: out (B, T, H * D) bf16 and the log-sum-exp of each row of scaled scores lse (B, H, T).
    With doc_start, doc_end (B, T) int32 (ops.document_bounds), query t sees only the keys doc_start[b, t] .. t."""
    B, T, H, KV, D = flash_shapes(qkv, n_heads, n_kv_heads)
    check("out", out, (B, T, H * D), BF16)
    check("lse", lse, (B, H, T))
    check_aligned(out=out, qkv=qkv)
    mask_signature, mask = _document_mask(source, doc_start, doc_end, B, T)
    launch = flash_config(source, D, "forward")
    maps = _tma_maps(qkv) if source.tma else ()
    grid = (H, B, math.ceil(T / launch.rows))
    if launch.persistent:  # a CTA per multiprocessor, at most one per work item
        grid = (min(multiprocessors(), math.prod(grid)), 1, 1)
    batch = (B,) if source.tma else ()
    signature = "P" * len(maps) + "PPPiii" + "i" * len(batch) + mask_signature
    kernel(source.module, f"flash_attention_forward_d{D}", signature, source.directory)(
        grid, launch.threads, *maps, out.ptr, lse.ptr, qkv.ptr, T, H, KV, *batch, *mask, shared=launch.shared)


def flash_attention_scratch_size(B: int, T: int, H: int, D: int, source: FlashSource) -> int:
    """float32 elements of the backward's scratch for this build: delta (B, H, T), the same for every production
    build (a ladder rung that needs more has its own size: dev/cuda/flash_attention_ladder.py)."""
    return B * H * T


@dataclass(frozen=True)
class BackwardArguments:
    """A checked backward problem after its delta kernel: its shape and what its kernels take, in order: the TMA
    maps (a wgmma build's), the pointers dqkv, dout, qkv, lse, delta, cos, sin, the sizes T, H, KV, and last the
    document mask's pointers (none for a rung without it; mask_signature their letters)."""
    shape: tuple[int, int, int, int, int]  # B, T, H, KV, D
    maps: tuple
    pointers: tuple
    sizes: tuple
    mask_signature: str
    mask: tuple

    def leading(self) -> tuple[str, tuple]:
        """The signature letters and values of the maps, pointers and sizes, which every backward kernel takes first."""
        return "P" * len(self.maps) + "PPPPPPPiii", (*self.maps, *self.pointers, *self.sizes)


def backward_arguments(dqkv: DeviceArray, scratch: DeviceArray, dout: DeviceArray, out: DeviceArray,
                       lse: DeviceArray, qkv: DeviceArray, n_heads: int, n_kv_heads: int, cos: DeviceArray | None,
                       sin: DeviceArray | None, source: FlashSource, doc_start: DeviceArray | None,
                       doc_end: DeviceArray | None,
                       scratch_size: Callable[..., int] = flash_attention_scratch_size) -> BackwardArguments:
    """Every check of flash_attention_backward's arguments (the scratch's size scratch_size(B, T, H, D, source)),
    then the delta kernel (delta = rowsum(dout * out) into the scratch's start): what the build's backward kernels
    take, which the caller launches."""
    B, T, H, KV, D = flash_shapes(qkv, n_heads, n_kv_heads)
    check("dqkv", dqkv, qkv.shape, BF16)
    check("dout", dout, (B, T, H * D), BF16)
    check("out", out, (B, T, H * D), BF16)
    check("lse", lse, (B, H, T))
    check("scratch", scratch, (scratch_size(B, T, H, D, source),))
    check_aligned(dqkv=dqkv, dout=dout, out=out, qkv=qkv, scratch=scratch)
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin: pass both (fused inverse RoPE) or neither")
    if cos is not None:
        rows = cos.shape[0] if isinstance(cos, DeviceArray) and len(cos.shape) == 2 else 0
        if rows < T:
            raise ValueError(f"cos: expected float32 (>= {T}, {D // 2}), got {cos!r}")
        check("cos", cos, (rows, D // 2))
        check("sin", sin, (rows, D // 2))
    cos_ptr, sin_ptr = (0, 0) if cos is None else (cos.ptr, sin.ptr)
    mask_signature, mask = _document_mask(source, doc_start, doc_end, B, T)
    kernel(source.module, "flash_attention_backward_delta", "PPPiiii", source.directory)(
        blocks(B * T * H, ROWS_PER_BLOCK), BLOCK, scratch.ptr, dout.ptr, out.ptr, B * T * H, T, H, D)
    maps = _tma_maps(qkv, dout) if source.tma else ()
    return BackwardArguments((B, T, H, KV, D), maps, (dqkv.ptr, dout.ptr, qkv.ptr, lse.ptr, scratch.ptr, cos_ptr,
                                                      sin_ptr), (T, H, KV), mask_signature, mask)


def flash_attention_backward(dqkv: DeviceArray, scratch: DeviceArray, dout: DeviceArray, out: DeviceArray,
                             lse: DeviceArray, qkv: DeviceArray, n_heads: int, n_kv_heads: int,
                             cos: DeviceArray | None = None, sin: DeviceArray | None = None, *,
                             source: FlashSource, doc_start: DeviceArray | None = None,
                             doc_end: DeviceArray | None = None) -> None:
    """dqkv (B, T, (H + 2KV) * D) bf16, packed like qkv, from dout (B, T, H * D) and the forward's out and
    lse; scratch, float32 (flash_attention_scratch_size,), holds delta. With cos/sin (>= T, D/2) float32, dq and dk
    are rotated back by RoPE (dqkv is then the gradient of the projection before RoPE). doc_start, doc_end: the
    forward's document mask. Deterministic: a dK/dV kernel over kv tiles, then a dQ kernel over query tiles."""
    a = backward_arguments(dqkv, scratch, dout, out, lse, qkv, n_heads, n_kv_heads, cos, sin, source, doc_start,
                           doc_end)
    B, T, H, KV, D = a.shape
    signature, args = a.leading()
    dkdv = flash_config(source, D, "dkdv")
    kernel(source.module, f"flash_attention_backward_dkdv_d{D}", signature + a.mask_signature, source.directory)(
        (KV, B, math.ceil(T / dkdv.rows)), dkdv.threads, *args, *a.mask, shared=dkdv.shared)
    dq = flash_config(source, D, "dq")
    kernel(source.module, f"flash_attention_backward_dq_d{D}", signature + a.mask_signature, source.directory)(
        (H, B, math.ceil(T / dq.rows)), dq.threads, *args, *a.mask, shared=dq.shared)
