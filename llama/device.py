"""One place decides what runs on this device: the training dtype and each kernel family's version.

The trainer prints `describe()` in one line at start. Versions are the rungs of the kernel
ladders (dev/cuda/README.md): the best one the device can run is chosen here and nowhere else.
"""

from __future__ import annotations

import functools

from .cuda import runtime


@functools.cache
def gemm_version() -> str:
    """bf16 GEMM: 'wgmma' (wgmma + TMA, version 2) on Hopper, 'mma' (mma.sync, version 1) from sm_80 on."""
    capability = runtime().device.compute_capability()
    if capability < (8, 0):
        raise RuntimeError(f"bf16 tensor-core kernels need compute capability 8.0 or newer, not {capability}")
    return "wgmma" if capability == (9, 0) else "mma"
