"""Host arrays page-locked by a background thread, piece by piece, while the caller goes on.

Page-locking is slow (about 2 GB/s: the kernel faults in and pins every page), so the 48 GB snapshot of an
8B model's checkpoint state took 23 s when the first checkpoint allocated it. PinnedArrays maps plain memory
at once and registers it with the driver (cuMemHostRegister, through ctypes, which lets go of the GIL during
the call) in PIN_PIECE pieces on a thread of its own, with the caller's CUDA context made current there:
training steps run meanwhile, and wait() blocks only for what is not pinned yet. A piece is never registered
while a CUDA graph is being captured (llama/runtime/cuda.py's CAPTURE_GATE): the first step's capture waits for the
piece in flight, and the pinning for the capture. A copy to or from the
arrays goes piece by piece (pieces()), each within one registration. The registrations end when the object
is collected (the memory itself when the last array on it goes).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import weakref
from typing import Callable

import numpy as np

from .cuda import CAPTURE_GATE, check_driver, driver
from .progress import phase

PIN_PIECE = 1 << 26  # bytes registered at once: the longest the driver may hold its lock for one call is short
CU_MEMHOSTREGISTER_PORTABLE = 1  # page-locked for every context


class DriverPinning:
    """cuMemHostRegister and cuMemHostUnregister of host memory for the CUDA context current where it is made."""

    def __init__(self):
        self.lib = driver()
        self.context = ctypes.c_void_p()
        check_driver(self.lib.cuCtxGetCurrent(ctypes.byref(self.context)), "cuCtxGetCurrent")

    def _in_context(self) -> None:
        """Make the context current in the calling thread (a thread starts with none)."""
        check_driver(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def pin(self, address: int, nbytes: int) -> None:
        with CAPTURE_GATE.registration():  # never while a CUDA graph is being captured (runtime/cuda.py)
            self._in_context()
            check_driver(self.lib.cuMemHostRegister_v2(ctypes.c_void_p(address), ctypes.c_size_t(nbytes),
                                                       ctypes.c_uint(CU_MEMHOSTREGISTER_PORTABLE)), "cuMemHostRegister")

    def unpin(self, address: int) -> None:
        with CAPTURE_GATE.registration():
            self._in_context()
            check_driver(self.lib.cuMemHostUnregister(ctypes.c_void_p(address)), "cuMemHostUnregister")


def piece_ranges(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of at most `piece` bytes that cover nbytes."""
    return [(start, min(start + piece, nbytes)) for start in range(0, nbytes, piece)]


def _unpin_all(unpin: Callable[[int], None], addresses: list[int], regions: list[mmap.mmap]) -> None:
    """Unregister what was pinned (regions: kept alive until then)."""
    for address in addresses:
        unpin(address)


class PinnedArrays:
    """Arrays of the given (shape, dtype) by name, each on memory of its own, page-locked in the background in
    pieces of `piece` bytes (PIN_PIECE by default). pinning: what registers the memory (by default DriverPinning,
    made in the calling thread, whose CUDA context the pinning thread takes)."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], np.dtype]], pinning=None, piece: int | None = None):
        self.pinning, piece = pinning or DriverPinning(), piece or PIN_PIECE
        self.arrays, self.regions, self.ranges = {}, [], {}
        for name, (shape, dtype) in specs.items():
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            # private anonymous memory, page-aligned, faulted in by the pinning: in huge pages where the kernel
            # allows, a 512th of the faults
            region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(AttributeError, OSError):  # a kernel without transparent huge pages
                region.madvise(mmap.MADV_HUGEPAGE)
            self.regions.append(region)
            self.arrays[name] = np.frombuffer(region, np.uint8, nbytes).view(dtype).reshape(shape)
            self.ranges[name] = piece_ranges(nbytes, piece)
        self.nbytes = sum(a.nbytes for a in self.arrays.values())
        self.pinned_bytes, self.error, self._addresses = 0, None, []
        self._finalizer = weakref.finalize(self, _unpin_all, self.pinning.unpin, self._addresses, self.regions)
        self._finalizer.atexit = False  # a process that ends frees its registrations anyway
        self._thread = threading.Thread(target=self._pin_all, name="page-locking", daemon=True)
        self._thread.start()

    def _pin_all(self) -> None:
        try:
            for name, array in self.arrays.items():
                base = array.ctypes.data
                for start, end in self.ranges[name]:
                    self.pinning.pin(base + start, end - start)
                    self._addresses.append(base + start)
                    self.pinned_bytes += end - start
        except BaseException as e:  # handed to the thread that waits
            self.error = e

    @property
    def ready(self) -> bool:
        return not self._thread.is_alive()

    def pieces(self, name: str) -> list[tuple[int, int]]:
        """[start, end) byte ranges of an array, each pinned at once: a copy must not cross from one to the next."""
        return self.ranges[name]

    def wait(self, why: str | None = None) -> dict[str, np.ndarray]:
        """The arrays once all are page-locked; while they are not, a progress phase says that `why` waits for them
        (none without it)."""
        if not self.ready and why is not None:
            with phase(f"{why}: waiting for its page-locked memory", total=self.nbytes, unit="B",
                       report_after=0.0) as progress:
                self._join(progress.update)
        self._join(lambda nbytes: None)
        if self.error is not None:
            raise RuntimeError(f"cannot page-lock {self.nbytes / 1e9:.1f} GB of host memory: {self.error}")
        return self.arrays

    def _join(self, on_pinned: Callable[[int], None]) -> None:
        """Wait for the pinning thread, telling on_pinned the bytes pinned since it last did; a join with a timeout,
        so that the main thread's signal handlers still run."""
        reported = self.pinned_bytes
        while self._thread.is_alive():
            self._thread.join(0.1)
            on_pinned(self.pinned_bytes - reported)
            reported = self.pinned_bytes
