"""The small PyCUDA runtime: primary context, kernels/*.cu's cubins loaded, device arrays.

Kernels are compiled for the GPU's own architecture (sm_90a on Hopper, so that Hopper-only
instructions are available) into a persistent cache (llama/runtime/kernel_build.py, which the trainer fills
ahead, in parallel); the runtime loads the cubin of the build unit holding each kernel asked for,
building it if missing. Launches go through prepared calls on the runtime's one stream (an ordinary
blocking stream, so it stays ordered with synchronous copies); nothing here synchronizes except
explicit downloads. CUDA graphs (Graph) capture that stream through the driver API by ctypes: PyCUDA
has no graph API.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import threading
import weakref
from pathlib import Path

import ml_dtypes
import numpy as np

from .kernel_build import cubin_of, kernel_dir, unit_of

BF16 = np.dtype(ml_dtypes.bfloat16)  # bf16 device arrays hold these; numpy computes them in float32
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)  # --dtype fp8's GEMM operands (llama/ops/fp8.py)


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
        self.code = gpu_target(self.device.compute_capability())[1]  # e.g. sm_90a, what the cubins are built for
        self.dependent_launches = self.device.compute_capability() >= (9, 0)  # programmatic, from sm_90
        self.modules, self.cubins, self.driver_modules = {}, {}, {}
        self.stream = drv.Stream()  # every launch goes here, so that a Graph can capture it

    @contextlib.contextmanager
    def launching_on(self, stream):
        """Within the block, launches go to stream (e.g. a communicator's) instead of the compute stream."""
        compute, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = compute

    def module(self, name: str, directory: Path | None = None, entry: str | None = None):
        """The loaded kernels/<name>.cu (or <directory>/<name>.cu, e.g. a dev/cuda version): the build unit
        holding entry where the file is built an entry point at a time, else the whole file."""
        unit = unit_of((directory or kernel_dir()) / f"{name}.cu", self.code, entry)
        if unit not in self.modules:
            self.cubins[unit] = cubin_of(unit)
            self.modules[unit] = self.drv.module_from_buffer(self.cubins[unit])
        return self.modules[unit]

    def function_handle(self, module: str, name: str, directory: Path | None = None) -> ctypes.c_void_p:
        """The driver's CUfunction of a kernel, from a second load of its module (PyCUDA does not give
        out its handles), for the launches PyCUDA cannot make (cuLaunchKernelEx)."""
        self.module(module, directory, name)
        unit = unit_of((directory or kernel_dir()) / f"{module}.cu", self.code, name)
        if unit not in self.driver_modules:
            handle = ctypes.c_void_p()
            check_driver(driver().cuModuleLoadData(ctypes.byref(handle), self.cubins[unit]), "cuModuleLoadData")
            self.driver_modules[unit] = handle
        function = ctypes.c_void_p()
        check_driver(driver().cuModuleGetFunction(ctypes.byref(function), self.driver_modules[unit],
                                                    name.encode()), f"cuModuleGetFunction({name})")
        return function

    def kernel(self, module: str, name: str, signature: str, directory: Path | None = None) -> "Kernel":
        """A prepared kernel; signature in PyCUDA's struct letters (P pointer, i int, q int64, f float)."""
        function = self.module(module, directory, name).get_function(name)
        function.prepare(signature)
        return Kernel(function, name, lambda: self.function_handle(module, name, directory))

    def synchronize(self) -> None:
        self.drv.Context.synchronize()


class Kernel:
    def __init__(self, function, name: str, find_handle):
        self.function, self.name, self.find_handle, self.handle = function, name, find_handle, None
        self.max_shared = 48 * 1024  # dynamic shared memory allowed without opting in

    def __call__(self, grid, block, *args, shared: int = 0, dependent: bool = False, cluster: tuple | None = None):
        """Launch on the runtime's stream; block is a thread count or a tuple; shared is the dynamic
        shared memory in bytes (above 48 KB the kernel is opted in once). dependent: a programmatic
        dependent launch (sm_90, see kernels/common.cuh), for kernels that call wait_for_previous_grid()
        before they read what earlier kernels wrote (an ordinary launch before sm_90 or with
        DEPENDENT_LAUNCHES off). cluster: the thread-block cluster's shape (sm_90), for kernels whose
        grid is whole clusters."""
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        block = (block,) if isinstance(block, int) else tuple(block)
        block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        if shared > self.max_shared:
            from pycuda.driver import function_attribute
            self.function.set_attribute(function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, int(shared))
            self.max_shared = int(shared)
            self.handle = None  # found again, with the new limit
        dependent = dependent and DEPENDENT_LAUNCHES["on"] and runtime().dependent_launches
        if dependent or cluster is not None:
            self._launch_ex(grid, block, args, int(shared), dependent, cluster)
        else:
            self.function.prepared_async_call(grid, block, runtime().stream, *args, shared_size=int(shared))

    def _launch_ex(self, grid, block, args, shared: int, dependent: bool, cluster: tuple | None) -> None:
        """cuLaunchKernelEx with the launch's attributes (PyCUDA has no such launch)."""
        from pycuda._pvt_struct import pack
        if self.handle is None:
            self.handle = self.find_handle()
            check_driver(driver().cuFuncSetAttribute(self.handle, _MAX_DYNAMIC_SHARED, self.max_shared),
                          "cuFuncSetAttribute")
        buffer = pack(self.function.arg_format, *args)
        size = ctypes.c_size_t(len(buffer))
        data = ctypes.create_string_buffer(buffer, len(buffer))
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(data), 2, ctypes.addressof(size), 0)  # BUFFER_POINTER, SIZE, END
        attributes = (_LaunchAttribute * 2)()
        count = 0
        if dependent:
            attributes[count].id, attributes[count].value[0] = _PROGRAMMATIC_STREAM_SERIALIZATION, 1
            count += 1
        if cluster is not None:
            attributes[count].id = _CLUSTER_DIMENSION
            attributes[count].value[0:3] = [int(c) for c in cluster]
            count += 1
        config = _LaunchConfig(*grid, *block, shared, runtime().stream.handle,
                               ctypes.cast(attributes, ctypes.POINTER(_LaunchAttribute)), count)
        check_driver(driver().cuLaunchKernelEx(ctypes.byref(config), self.handle, None, extra), "cuLaunchKernelEx")


DEPENDENT_LAUNCHES = {"on": True}  # off: every launch ordinary (to measure what the overlap gains)
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id and a 64-byte value
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_LaunchAttribute)),
                ("count", ctypes.c_uint)]


@functools.cache
def runtime() -> Runtime:
    return Runtime()


def select_device(index: int) -> None:
    """Run on GPU `index` (a rank's LOCAL_RANK); call before anything touches the GPU."""
    if runtime.cache_info().currsize and runtime().device.pci_bus_id() != runtime().drv.Device(index).pci_bus_id():
        raise RuntimeError(f"select_device({index}) after the runtime started on another GPU")
    os.environ["CUDA_DEVICE"] = str(index)  # read by pycuda's make_default_context


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
        """Zero the array, in order on the runtime's stream (capturable in a Graph)."""
        runtime().drv.memset_d8_async(self.ptr, 0, self.nbytes, runtime().stream)

    def copy_from(self, other: "DeviceArray") -> None:
        """This array = other (same dtype and size), in order on the runtime's stream (capturable)."""
        if other.dtype != self.dtype or other.size != self.size:
            raise ValueError(f"copy of {other!r} into {self!r}")
        runtime().drv.memcpy_dtod_async(self.ptr, other.ptr, self.nbytes, runtime().stream)

    def upload_async(self, pinned: np.ndarray) -> None:
        """Copy page-locked host memory in, in order on the runtime's stream; the host buffer must
        stay unchanged until the stream has run the copy."""
        if pinned.nbytes != self.nbytes:
            raise ValueError(f"upload of {pinned.nbytes} bytes into an array of {self.nbytes}")
        runtime().drv.memcpy_htod_async(self.ptr, _raw(pinned), runtime().stream)

    def __repr__(self):
        return f"DeviceArray({self.shape}, {self.dtype})"


def _raw(host: np.ndarray) -> np.ndarray:
    """The bytes of a host array as a type PyCUDA's buffer copies take (bf16 as uint16 bits, fp8 as uint8)."""
    return host.view(np.uint16) if host.dtype == BF16 else host.view(np.uint8) if host.dtype == FP8 else host


_ALLOCATED = {"bytes": 0}


def allocated_bytes() -> int:
    """Device memory held by the live allocations of empty() (every buffer of ours comes from it)."""
    return _ALLOCATED["bytes"]


def _release(nbytes: int) -> None:
    _ALLOCATED["bytes"] -= nbytes


def empty(shape, dtype=np.float32) -> DeviceArray:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    allocation = runtime().drv.mem_alloc(nbytes)
    _ALLOCATED["bytes"] += nbytes
    weakref.finalize(allocation, _release, nbytes)
    return DeviceArray(int(allocation), shape, dtype, allocation)


def zeros(shape, dtype=np.float32) -> DeviceArray:
    array = empty(shape, dtype)
    array.fill_zero()
    return array


def allocate(shapes: dict, zeroed: bool = False) -> dict[str, DeviceArray]:
    """A device array of each {name: (shape, dtype)}, allocated in order (zeroed: filled with zeros)."""
    return {name: (zeros if zeroed else empty)(shape, dtype) for name, (shape, dtype) in shapes.items()}


def to_device(host: np.ndarray) -> DeviceArray:
    array = empty(host.shape, host.dtype)
    array.upload(host)
    return array


def time_ms(fn, warmup: int = 3, repeats: int = 20, inner: int = 5) -> float:
    """Median device milliseconds of one fn() call: `repeats` timed batches of `inner` calls each,
    between CUDA events on the default stream, after `warmup` untimed calls."""
    drv = runtime().drv
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = drv.Event(), drv.Event()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(end.time_since(start) / inner)
    return float(np.median(times))


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver library (libcuda), loaded once, for the calls PyCUDA does not wrap."""
    return ctypes.CDLL("libcuda.so.1")


def check_driver(result: int, call: str) -> None:
    """Raise, naming the call, when a driver call returned an error (a CUresult other than 0)."""
    if result != 0:
        raise RuntimeError(f"{call} failed with CUresult {result}")


class CaptureGate:
    """Keeps stream captures and host memory registrations apart: cuMemHostRegister while another thread captures
    may fail (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) or invalidate the capture, and the first step's capture runs
    while the page-locking thread (llama/runtime/pinned.py) registers the checkpoint's snapshot piece by piece.
    A capture goes first: it waits for the piece in flight only, and the next piece waits for the capture (a lock
    alone lets the thread that releases it take it again at once, so a capture could wait for every piece). The
    capturing thread's own registrations pass."""

    def __init__(self):
        self.lock = threading.RLock()
        self.changed = threading.Condition()
        self.captures = 0  # captures waiting for the lock or holding it
        self.capturing_thread = None

    @contextlib.contextmanager
    def capture(self):
        with self.changed:
            self.captures += 1
        try:
            with self.lock:
                self.capturing_thread = threading.get_ident()
                try:
                    yield
                finally:
                    self.capturing_thread = None
        finally:
            with self.changed:
                self.captures -= 1
                self.changed.notify_all()

    @contextlib.contextmanager
    def registration(self):
        if self.capturing_thread != threading.get_ident():
            with self.changed:
                self.changed.wait_for(lambda: self.captures == 0)
        with self.lock:
            yield


CAPTURE_GATE = CaptureGate()


class Graph:
    """The kernels that fn() launches on the runtime's stream, captured once and replayed by one
    launch. Arguments are frozen at capture: step-dependent values must live in device memory, and
    fn() must neither allocate, synchronize nor copy synchronously."""

    CAPTURE_THREAD_LOCAL = 1

    def __init__(self, fn):
        lib, stream = driver(), ctypes.c_void_p(runtime().stream.handle)
        # the cyclic garbage collector stays off while capturing: a device array it freed then would call
        # cuMemFree, which a capture does not allow (the capture fails with CUresult 901 at its end)
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        graph = ctypes.c_void_p()
        with CAPTURE_GATE.capture():  # no page-locking meanwhile: it waits for the end of the capture
            check_driver(lib.cuStreamBeginCapture_v2(stream, self.CAPTURE_THREAD_LOCAL), "cuStreamBeginCapture")
            try:
                fn()
            finally:
                ended = lib.cuStreamEndCapture(stream, ctypes.byref(graph))
                if collecting:
                    gc.enable()
        check_driver(ended, "cuStreamEndCapture")
        self.graph, self.executable = graph, ctypes.c_void_p()
        check_driver(lib.cuGraphInstantiateWithFlags(ctypes.byref(self.executable), graph, ctypes.c_ulonglong(0)),
                      "cuGraphInstantiate")

    def replay(self) -> None:
        check_driver(driver().cuGraphLaunch(self.executable, ctypes.c_void_p(runtime().stream.handle)),
                      "cuGraphLaunch")

    def __del__(self):
        if getattr(self, "executable", None):
            driver().cuGraphExecDestroy(self.executable)
            driver().cuGraphDestroy(self.graph)
