"""What every launcher shares: compiled kernels by name, argument checks, grid sizes.

A launcher checks the shapes and dtypes of its device arrays, raises ValueError on a mismatch,
and launches asynchronously on the runtime's stream (llama/cuda.py). Outputs come first in the
argument list, as in llm.c. Gradient outputs of parameters (dweight) are accumulated (+=),
activations' gradients are overwritten except where a docstring says `+=`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..cuda import DeviceArray, runtime

F32, F64, I32, U8 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.uint8)
BLOCK = 256
ROWS_PER_BLOCK = BLOCK // 32  # kernels with one warp per row
NORM_BLOCKS = 512  # fixed, so that the grad norm is the same on every GPU
CLASSIFIER_BLOCK = 1024  # threads per block of the classifier kernels
_KERNELS = {}


def kernel(module: str, name: str, signature: str, directory: Path | None = None):
    """The prepared kernel `name` of kernels/<module>.cu (or <directory>/<module>.cu), compiled once."""
    key = (directory, module, name)
    if key not in _KERNELS:
        _KERNELS[key] = runtime().kernel(module, name, signature, directory)
    return _KERNELS[key]


def check(name: str, array: DeviceArray, shape, dtype=F32) -> None:
    """array is a DeviceArray of this shape and dtype, else a ValueError naming it."""
    if not isinstance(array, DeviceArray):
        raise ValueError(f"{name}: expected a DeviceArray, got {type(array).__name__}")
    if array.shape != tuple(shape) or array.dtype != dtype:
        raise ValueError(f"{name}: expected {dtype} {tuple(shape)}, got {array.dtype} {array.shape}")


def check_aligned(**arrays: DeviceArray) -> None:
    """Each array starts 16-byte aligned (the kernels move 16-byte vectors)."""
    for name, array in arrays.items():
        if array.ptr % 16:
            raise ValueError(f"{name}: must start 16-byte aligned, starts at {array.ptr:#x}")


def blocks(n: int, per_block: int = BLOCK) -> tuple[int]:
    """A 1D grid of enough blocks for n items, per_block items each."""
    return (max(1, math.ceil(n / per_block)),)


def multiprocessors() -> int:
    from pycuda.driver import device_attribute
    return runtime().device.get_attribute(device_attribute.MULTIPROCESSOR_COUNT)
