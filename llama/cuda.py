"""The small PyCUDA runtime: primary context, compile-and-cache of kernels/*.cu, device arrays.

Kernels are compiled once per process for the GPU's own architecture (sm_90a on Hopper, so that
Hopper-only instructions are available) and cached on disk by PyCUDA. Launches go through
prepared calls on the default stream; nothing here synchronizes except explicit downloads.
"""

from __future__ import annotations

import functools
from pathlib import Path

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)  # bf16 device arrays hold these; numpy computes them in float32
PACKAGE_DIR = Path(__file__).resolve().parent


def kernel_dir() -> Path:
    """kernels/ of a source checkout, or llama/kernels/ inside an installed wheel."""
    for candidate in (PACKAGE_DIR / "kernels", PACKAGE_DIR.parent / "kernels"):
        if (candidate / "common.cuh").exists():
            return candidate
    raise FileNotFoundError(f"CUDA kernel sources not found next to {PACKAGE_DIR}")


def gpu_target(compute_capability: tuple[int, int]) -> tuple[str, str]:
    """(arch, code) for nvcc: the 'a' variant on Hopper, the plain one elsewhere."""
    major, minor = compute_capability
    suffix = "a" if (major, minor) == (9, 0) else ""
    return f"compute_{major}{minor}{suffix}", f"sm_{major}{minor}{suffix}"


class Runtime:
    def __init__(self):
        import pycuda.autoprimaryctx  # noqa: F401  (retains and pushes the device's primary context)
        import pycuda.driver as drv

        self.drv = drv
        self.device = drv.Context.get_device()
        self.name = self.device.name()
        self.arch, self.code = gpu_target(self.device.compute_capability())
        self.modules = {}

    def module(self, name: str, directory: Path | None = None):
        """The compiled kernels/<name>.cu (or <directory>/<name>.cu, e.g. a dev/cuda version)."""
        path = (directory or kernel_dir()) / f"{name}.cu"
        if path not in self.modules:
            from pycuda.compiler import SourceModule
            self.modules[path] = SourceModule(path.read_text(), no_extern_c=True, arch=self.arch, code=self.code,
                                              include_dirs=[str(kernel_dir()), str(path.parent)],
                                              options=["-std=c++17"])
        return self.modules[path]

    def kernel(self, module: str, name: str, signature: str, directory: Path | None = None) -> "Kernel":
        """A prepared kernel; signature in PyCUDA's struct letters (P pointer, i int, q int64, f float)."""
        function = self.module(module, directory).get_function(name)
        function.prepare(signature)
        return Kernel(function)

    def synchronize(self) -> None:
        self.drv.Context.synchronize()


class Kernel:
    def __init__(self, function):
        self.function = function
        self.max_shared = 48 * 1024  # dynamic shared memory allowed without opting in

    def __call__(self, grid, block, *args, shared: int = 0):
        """Launch on the default stream; block is a thread count or a tuple; shared is the dynamic
        shared memory in bytes (above 48 KB the kernel is opted in once)."""
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        block = (block,) if isinstance(block, int) else tuple(block)
        block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        if shared > self.max_shared:
            from pycuda.driver import function_attribute
            self.function.set_attribute(function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, int(shared))
            self.max_shared = int(shared)
        self.function.prepared_async_call(grid, block, None, *args, shared_size=int(shared))


@functools.cache
def runtime() -> Runtime:
    return Runtime()


def cuda_unavailable() -> str | None:
    """None when a CUDA GPU is usable through pycuda, else why not (one line)."""
    try:
        runtime()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


class DeviceArray:
    """A typed, shaped view of device memory; `base` keeps the allocation alive."""

    def __init__(self, ptr: int, shape, dtype, base):
        self.ptr, self.shape, self.dtype, self.base = int(ptr), tuple(int(s) for s in shape), np.dtype(dtype), base

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def view(self, offset: int, shape) -> "DeviceArray":
        """Elements [offset, offset + prod(shape)) as a new shape."""
        size = int(np.prod(shape))
        if offset < 0 or offset + size > self.size:
            raise ValueError(f"view [{offset}, {offset + size}) outside an array of {self.size}")
        return DeviceArray(self.ptr + offset * self.dtype.itemsize, shape, self.dtype, self.base)

    def reshape(self, *shape) -> "DeviceArray":
        shape = list(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape[shape.index(-1)] = self.size // known if known else 0
        if int(np.prod(shape)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return DeviceArray(self.ptr, shape, self.dtype, self.base)

    def prefix(self, *shape) -> "DeviceArray":
        """The first prod(shape) elements as shape (activations of a smaller batch)."""
        return self.view(0, shape)

    def upload(self, host: np.ndarray) -> None:
        """Copy a host array in, converted to this array's dtype (float to bf16 rounds to nearest even)."""
        host = np.ascontiguousarray(host, dtype=self.dtype)
        if host.size != self.size:
            raise ValueError(f"upload of {host.size} values into an array of {self.size}")
        runtime().drv.memcpy_htod(self.ptr, _raw(host))

    def download(self) -> np.ndarray:
        host = np.empty(self.shape, dtype=self.dtype)
        runtime().drv.memcpy_dtoh(_raw(host), self.ptr)
        return host

    def fill_zero(self) -> None:
        runtime().drv.memset_d8(self.ptr, 0, self.nbytes)

    def __repr__(self):
        return f"DeviceArray({self.shape}, {self.dtype})"


def _raw(host: np.ndarray) -> np.ndarray:
    """The bytes of a host array as a type PyCUDA's buffer copies take (bf16 as uint16 bits)."""
    return host.view(np.uint16) if host.dtype == BF16 else host


def empty(shape, dtype=np.float32) -> DeviceArray:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    allocation = runtime().drv.mem_alloc(nbytes)
    return DeviceArray(int(allocation), shape, dtype, allocation)


def zeros(shape, dtype=np.float32) -> DeviceArray:
    array = empty(shape, dtype)
    array.fill_zero()
    return array


def to_device(host: np.ndarray) -> DeviceArray:
    array = empty(host.shape, host.dtype)
    array.upload(host)
    return array
