"""Launcher of the random initialization on the GPU (kernels/init.cu), the twin of llama/params.py's
init_parameters: the same values, bit for bit, written straight into device memory."""

from __future__ import annotations

import numpy as np

from ..runtime.cuda import DeviceArray, empty
from ..params import ParameterLayout, initial_std
from .common import F32, blocks, check, kernel

HOST_CHUNK = 1 << 26  # values drawn on the GPU per download when the host wants the array (256 MB)


def init_normal(out: DeviceArray, start: int, seed: int, std: float) -> None:
    """out (n,) fp32 = std * the standard normals of flat offsets start..start+n-1 (llama/twins/init.py
    standard_normals), each rounded once to fp32."""
    check("out", out, (out.size,), F32)
    if start < 0 or not 0 <= seed < 2 ** 64:
        raise ValueError(f"start must be >= 0 and seed in [0, 2**64), got {start} and {seed}")
    n = out.size
    philox_blocks = (start + n + 3) // 4 - start // 4
    kernel("init", "init_normal", "PQQQd")(blocks(philox_blocks), 256, out.ptr, n, start, seed, float(std))


def fill_parameters(out: DeviceArray, layout: ParameterLayout, seed: int, start: int = 0, on_values=None) -> None:
    """out (n,) fp32 = the initial flat parameters start..start+n-1 of the layout (a whole model, a shard,
    a chunk); on_values(k), when given, after each tensor's part with its number of values."""
    end = start + out.size
    if end > layout.size:
        raise ValueError(f"parameters [{start}, {end}) outside the layout's {layout.size}")
    for t in layout.tensors.values():
        lo, hi = max(start, t.offset), min(end, t.offset + t.size)
        if lo >= hi:
            continue
        part = out.view(lo - start, (hi - lo,))
        std = initial_std(layout.config, t.name, t.shape)
        if std is None:
            part.upload(np.ones(hi - lo, np.float32))
        else:
            init_normal(part, lo, seed, std)
        if on_values is not None:
            on_values(hi - lo)


def init_parameters_on_gpu(layout: ParameterLayout, seed: int, on_values=None) -> np.ndarray:
    """The host array of init_parameters(layout.config, seed), drawn on the GPU a chunk at a time."""
    flat = np.empty(layout.size, np.float32)
    chunk = empty(min(HOST_CHUNK, layout.size))
    for start in range(0, layout.size, chunk.size):
        part = chunk.prefix(min(chunk.size, layout.size - start))
        fill_parameters(part, layout, seed, start, on_values)
        flat[start:start + part.size] = part.download()
    return flat
