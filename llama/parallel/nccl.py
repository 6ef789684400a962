"""NCCL through ctypes: the collectives of data-parallel training, on a stream of their own.

libnccl.so.2 comes from the `nvidia-nccl-cu13` wheel (the `[cuda]` extra), or from the system
(LLAMA_NCCL_LIBRARY names another file). The calls take raw CUDA stream handles and device
pointers, so they are also captured by CUDA graphs (llama.runtime.cuda.Graph).

Communicator joins the ranks: rank 0 makes the NCCL unique id and hands it to the others over the
TCP rendezvous (llama.parallel.distributed), each process takes the GPU of its LOCAL_RANK, and the
collectives run on `comm.stream`, ordered against the compute stream (runtime().stream) with
events: `comm.fork()` before the collectives, `comm.join()` after them. The rendezvous sockets stay
open as a liveness channel, and a watchdog ends the process with a one-line error when a peer
disappears, NCCL reports an asynchronous error, or a step takes longer than the timeout.

NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 unless the environment says otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import glob
import os
import sys
import threading

import numpy as np

from ..runtime.cuda import BF16, DeviceArray, empty, runtime
from .distributed import DistributedEnv, Rendezvous, Watchdog, abort

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

NCCL_TYPES = {np.dtype(np.uint8): 1, np.dtype(np.float32): 7, np.dtype(np.float64): 8,
              BF16: 9}  # ncclUint8 (8-bit moments' codes), ncclFloat32, ncclFloat64, ncclBfloat16
NCCL_OPS = {"sum": 0, "max": 2, "min": 3, "avg": 4}  # ncclSum, ncclMax, ncclMin, ncclAvg
NCCL_IN_PROGRESS = 7
DESTROY_LIMIT = 30.0  # seconds


class NCCLError(RuntimeError):
    pass


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def library_path() -> str:
    """libnccl.so.2: LLAMA_NCCL_LIBRARY, else the nvidia-nccl wheel's copy, else the system's."""
    if os.environ.get("LLAMA_NCCL_LIBRARY"):
        return os.environ["LLAMA_NCCL_LIBRARY"]
    try:
        import nvidia
        for folder in nvidia.__path__:
            found = sorted(glob.glob(os.path.join(folder, "**", "libnccl.so.2"), recursive=True))
            if found:
                return found[0]
    except ImportError:
        pass
    return "libnccl.so.2"


@functools.cache
def _lib() -> ctypes.CDLL:
    path = library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise NCCLError(f"cannot load NCCL ({path}): {e}; install it with pip install nvidia-nccl-cu13 "
                        "(the [cuda] extra)") from None
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetLastError.restype = ctypes.c_char_p
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    pointers = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.ncclAllReduce.argtypes = pointers + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.ncclReduceScatter.argtypes = pointers + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.ncclAllGather.argtypes = pointers + [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _check(result: int, call: str, comm=None) -> None:
    if result != 0:
        lib = _lib()
        detail = lib.ncclGetLastError(comm).decode(errors="replace") if comm is not None else ""
        raise NCCLError(f"{call} failed: {lib.ncclGetErrorString(result).decode()}" + (f" ({detail})" if detail else ""))


def version() -> str:
    code = ctypes.c_int()
    _check(_lib().ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
    major, rest = divmod(code.value, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


def unique_id() -> bytes:
    uid = UniqueId()
    _check(_lib().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid.internal)


class Communicator:
    """One NCCL communicator over all ranks, its stream, and the process's liveness guards."""

    def __init__(self, env: DistributedEnv, timeout: float = 600.0):
        self.rank, self.world_size, self.env = env.rank, env.world_size, env
        self.rendezvous = Rendezvous(env, timeout=timeout)
        nccl_id = self.rendezvous.broadcast(unique_id() if env.is_main else None)
        self.rendezvous.watch(self._fail)
        self.rt = runtime()  # the GPU of LOCAL_RANK (set by select_device before)
        uid = UniqueId()
        ctypes.memmove(uid.internal, nccl_id, 128)
        self.comm = ctypes.c_void_p()
        _check(_lib().ncclCommInitRank(ctypes.byref(self.comm), self.world_size, uid, self.rank), "ncclCommInitRank")
        drv = self.rt.drv
        self.stream = drv.Stream()
        self._forked, self._joined = drv.Event(drv.event_flags.DISABLE_TIMING), drv.Event(drv.event_flags.DISABLE_TIMING)
        self._scalars = empty(8, np.float64)
        self.watchdog = Watchdog(timeout, self._fail, checks=[self.async_error])
        self.watchdog.start()

    # ---- ordering against the compute stream

    def fork(self) -> None:
        """The communication stream waits for everything launched so far on the compute stream."""
        self._forked.record(self.rt.stream)
        self.stream.wait_for_event(self._forked)

    def join(self) -> None:
        """The compute stream waits for every collective launched so far."""
        self._joined.record(self.stream)
        self.rt.stream.wait_for_event(self._joined)

    # ---- collectives on self.stream (call fork() first where they read the compute stream's results)

    def _handle(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.stream.handle)

    def reduce_scatter(self, out: DeviceArray, x: DeviceArray, average: bool = True) -> None:
        """out (n,) = this rank's n-slice of the sum (or mean) over ranks of x (world_size * n,)."""
        if x.size != out.size * self.world_size or x.dtype != out.dtype:
            raise ValueError(f"reduce_scatter of {x.size} {x.dtype} into {out.size} {out.dtype} on {self.world_size} ranks")
        _check(_lib().ncclReduceScatter(x.ptr, out.ptr, out.size, NCCL_TYPES[x.dtype], NCCL_OPS["avg" if average else "sum"],
                                        self.comm, self._handle()), "ncclReduceScatter", self.comm)

    def all_gather(self, out: DeviceArray, x: DeviceArray) -> None:
        """out (world_size * n,) = the n-slices x of every rank, in rank order."""
        if out.size != x.size * self.world_size or x.dtype != out.dtype:
            raise ValueError(f"all_gather of {x.size} {x.dtype} into {out.size} {out.dtype} on {self.world_size} ranks")
        _check(_lib().ncclAllGather(x.ptr, out.ptr, x.size, NCCL_TYPES[x.dtype], self.comm, self._handle()),
               "ncclAllGather", self.comm)

    def all_reduce(self, x: DeviceArray, op: str = "sum") -> None:
        """x = the sum (or max, min, mean: op as NCCL_OPS names them) of x over ranks, in place."""
        _check(_lib().ncclAllReduce(x.ptr, x.ptr, x.size, NCCL_TYPES[x.dtype], NCCL_OPS[op], self.comm, self._handle()),
               "ncclAllReduce", self.comm)

    def group(self):
        """Collectives issued inside `with comm.group():` go out as one NCCL launch."""
        return _Group()

    def host_reduce(self, values, op: str = "sum") -> np.ndarray:
        """The sum (or op as all_reduce takes it) over ranks of a few host numbers (float64), e.g. the step's loss
        and stop request, or the least free GPU memory."""
        values = np.asarray(values, dtype=np.float64).ravel()
        scalars = self._scalars.prefix(values.size)
        scalars.upload(values)
        self.fork()
        self.all_reduce(scalars, op)
        self.join()
        return scalars.download()

    # ---- faults

    def async_error(self) -> str | None:
        """NCCL's asynchronous error of this communicator (a failed peer, a network error), or None."""
        result = ctypes.c_int()
        if _lib().ncclCommGetAsyncError(self.comm, ctypes.byref(result)) != 0:
            return None
        if result.value in (0, NCCL_IN_PROGRESS):
            return None
        return f"NCCL reported an error: {_lib().ncclGetErrorString(result.value).decode()}"

    def _fail(self, message: str) -> None:
        """A peer is gone or stuck (called from a watcher thread): one error line, and the process
        ends at once. Aborting NCCL first would wake the main thread, whose own output could then
        bury that line, or end the interpreter before it is printed."""
        abort(f"rank {self.rank}: {message}; stopping")

    def _abort_nccl(self) -> None:
        if self.comm:
            _lib().ncclCommAbort(self.comm)

    def beat(self) -> None:
        """A step has completed: restart the watchdog's clock."""
        self.watchdog.beat()

    def close(self) -> None:
        """Orderly shutdown: every rank reaches this at the same step. NCCL releases a communicator
        only once the CUDA graphs that captured its collectives are gone: drop them first."""
        if self.comm:
            self.watchdog.stop()
            self.rt.synchronize()
            self.rendezvous.close()
            gc.collect()
            comm, self.comm = self.comm, ctypes.c_void_p()
            if not _bounded(lambda: _lib().ncclCommDestroy(comm), DESTROY_LIMIT):
                print(f"warning: rank {self.rank}: NCCL did not release its communicator within {DESTROY_LIMIT} s "
                      "(a CUDA graph still holds it); exiting anyway", file=sys.stderr)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # an error on this rank: the others would wait on it in their next collective. Close the
        # rendezvous without a goodbye, so that they stop with their own error line at once.
        self.watchdog.stop()
        self.rendezvous.close(goodbye=False)
        _bounded(self._abort_nccl, DESTROY_LIMIT)  # nothing of ours may wait on the peers: the exit would hang
        self.comm = ctypes.c_void_p()


def _bounded(fn, seconds: float) -> bool:
    """Run fn in a daemon thread for at most `seconds`; whether it finished."""
    worker = threading.Thread(target=fn, daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive()


class _Group:
    def __enter__(self):
        _check(_lib().ncclGroupStart(), "ncclGroupStart")

    def __exit__(self, *exc):
        _check(_lib().ncclGroupEnd(), "ncclGroupEnd")
