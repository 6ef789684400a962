"""What every launcher shares: compiled kernels by name, the kernels' own constants (tile and block sizes,
read from their source so that each is defined once, in the .cu file), argument checks, grid sizes.

A launcher checks the shapes and dtypes of its device arrays, raises ValueError on a mismatch,
and launches asynchronously on the runtime's stream (llama/runtime/cuda.py). Outputs come first in the
argument list, as in llm.c. Gradient outputs of parameters (dweight) are accumulated (+=),
activations' gradients are overwritten except where a docstring says `+=`.
"""

from __future__ import annotations

import ast
import functools
import math
import re
from pathlib import Path

import numpy as np

from ..runtime.cuda import DeviceArray, kernel_dir, runtime

F32, F64, I32, U8 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.uint8)
U32 = np.dtype(np.uint32)
BLOCK = 256
ROWS_PER_BLOCK = BLOCK // 32  # kernels with one warp per row
VECTOR = 8  # bf16 elements per 16-byte vector: rows of the bf16 kernels hold a multiple of this
_KERNELS = {}


def kernel(module: str, name: str, signature: str, directory: Path | None = None):
    """The prepared kernel `name` of kernels/<module>.cu (or <directory>/<module>.cu), compiled once."""
    key = (directory, module, name)
    if key not in _KERNELS:
        _KERNELS[key] = runtime().kernel(module, name, signature, directory)
    return _KERNELS[key]


@functools.cache
def _definitions(module: str, directory: Path | None) -> dict[str, str]:
    """The integer constants that kernels/<module>.cu (or <directory>/<module>.cu) defines outside functions (at the
    start of a line), by name: the expression text of each `#define NAME expr` and `constexpr int NAME = expr`
    (comma-separated lists too)."""
    source = ((directory or kernel_dir()) / f"{module}.cu").read_text()
    source = re.sub(r"//[^\n]*", "", source)
    found = {name: expr.strip() for name, expr in re.findall(r"^#define\s+(\w+)[ \t]+([^\n]+)$", source, re.M)}
    for declarations in re.findall(r"^constexpr int ([^;]+);", source, re.M):
        for declaration in re.split(r",\s*(?=\w+\s*=)", declarations):
            name, expr = declaration.split("=", 1)
            found[name.strip()] = expr.strip()
    return found


def kernel_constant(module: str, name: str, directory: Path | None = None) -> int:
    """The value of the integer constant `name` of kernels/<module>.cu (or <directory>/<module>.cu: a number, or
    arithmetic on numbers and the file's other constants), so that a launcher's sizes are the kernel's own, not a
    copy."""
    definitions = _definitions(module, directory)
    if name not in definitions:
        raise KeyError(f"{directory or 'kernels'}/{module}.cu defines no integer constant {name}")
    return _evaluate(ast.parse(definitions[name], mode="eval").body, module, directory)


_OPERATORS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.Div: int.__floordiv__,
              ast.LShift: int.__lshift__}


def _evaluate(node: ast.AST, module: str, directory: Path | None) -> int:
    """A constant's expression: integers, + - * / << and the names of the module's other constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return kernel_constant(module, node.id, directory)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left, module, directory),
                                         _evaluate(node.right, module, directory))
    raise ValueError(f"{directory or 'kernels'}/{module}.cu: {ast.unparse(node)!r} is not an integer expression")


def kernel_entries(module: str, macro: str, directory: Path | None = None) -> list[list[str]]:
    """The arguments of every line of kernels/<module>.cu (or <directory>/<module>.cu) that invokes `macro` to define
    an entry point, e.g. kernel_entries("gemm_mma", "GEMM_MMA_ENTRY")[0] == ["gemm_mma_nt_128x128", "128", ...]."""
    source = ((directory or kernel_dir()) / f"{module}.cu").read_text()
    return [[argument.strip() for argument in arguments.split(",")]
            for arguments in re.findall(rf"^{macro}\(([^)]*)\)\s*$", source, re.M)]


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


def check_vectors(row: int, **arrays: DeviceArray) -> None:
    """Rows of a multiple of 8 elements and 16-byte aligned arrays, for 16-byte vector accesses."""
    if row % VECTOR:
        raise ValueError(f"bf16 kernels need rows of a multiple of {VECTOR} elements, got {row}")
    check_aligned(**arrays)


def blocks(n: int, per_block: int = BLOCK) -> tuple[int]:
    """A 1D grid of enough blocks for n items, per_block items each."""
    return (max(1, math.ceil(n / per_block)),)


def multiprocessors() -> int:
    from pycuda.driver import device_attribute
    return runtime().device.get_attribute(device_attribute.MULTIPROCESSOR_COUNT)
