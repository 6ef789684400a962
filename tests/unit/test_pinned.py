"""Page-locked host arrays pinned in the background (llama/runtime/pinned.py), with the driver's registration replaced
by a recorder: every byte registered once, in pieces, while the caller goes on; a failure reaches the waiter;
the registrations end with the object."""

import gc
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from llama.runtime.pinned import PinnedArrays, piece_ranges


class RecordedPinning:
    """What DriverPinning does, recorded; each pin waits for `go` (the driver's slowness, held by the test)."""

    def __init__(self, fail_at: int | None = None):
        self.pinned, self.unpinned, self.go, self.fail_at = [], [], threading.Event(), fail_at

    def pin(self, address: int, nbytes: int) -> None:
        self.go.wait(10)
        if len(self.pinned) == self.fail_at:
            raise OSError("out of memory")
        self.pinned.append((address, nbytes))

    def unpin(self, address: int) -> None:
        self.unpinned.append(address)


SPECS = {"params": ((1000,), np.float32), "codes": ((3, 700), np.uint8), "empty": ((0,), np.float32)}


def test_piece_ranges_cover_the_bytes_in_order():
    assert piece_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert piece_ranges(8, 4) == [(0, 4), (4, 8)] and piece_ranges(0, 4) == []


def test_the_arrays_exist_at_once_and_are_pinned_piece_by_piece_in_the_background():
    pinning = RecordedPinning()
    pinned = PinnedArrays(SPECS, pinning, piece=1024)
    assert not pinned.ready and pinning.pinned == []  # the caller goes on while the pins wait
    assert {name: (a.shape, a.dtype) for name, a in pinned.arrays.items()} == {
        name: (shape, np.dtype(dtype)) for name, (shape, dtype) in SPECS.items()}
    pinning.go.set()
    arrays = pinned.wait("a test")
    assert pinned.ready and arrays is pinned.arrays and pinned.pinned_bytes == pinned.nbytes == 4000 + 2100
    expected = [(arrays[name].ctypes.data + start, end - start) for name in SPECS for start, end in pinned.pieces(name)]
    assert pinning.pinned == expected and pinned.pieces("params") == [(0, 1024), (1024, 2048), (2048, 3072),
                                                                       (3072, 4000)]
    arrays["params"][:] = 1.5  # plain writable memory
    assert arrays["params"].sum() == 1500.0


def test_waiting_says_why_and_what_is_pinned_and_only_when_asked(capsys):
    for why in ("the checkpoint's snapshot", None):
        pinning = RecordedPinning()
        pinned = PinnedArrays(SPECS, pinning, piece=1024)
        threading.Timer(0.3, pinning.go.set).start()
        assert pinned.wait(why) is pinned.arrays and pinned.pinned_bytes == pinned.nbytes
        err = capsys.readouterr().err
        if why is None:
            assert err == ""
        else:
            assert "the checkpoint's snapshot: waiting for its page-locked memory" in err and "done in" in err


def test_a_failed_pin_reaches_the_waiter_and_what_was_pinned_is_unpinned():
    pinning = RecordedPinning(fail_at=2)
    pinning.go.set()
    pinned = PinnedArrays(SPECS, pinning, piece=1024)
    with pytest.raises(RuntimeError, match="cannot page-lock 0.0 GB of host memory: out of memory"):
        pinned.wait("a test")
    addresses = [address for address, _ in pinning.pinned]
    del pinned
    gc.collect()
    assert len(addresses) == 2 and pinning.unpinned == addresses


def test_the_registrations_end_with_the_object_and_the_arrays_stay_usable():
    pinning = RecordedPinning()
    pinning.go.set()
    pinned = PinnedArrays(SPECS, pinning, piece=1024)
    arrays = pinned.wait("a test")
    del pinned
    gc.collect()
    assert sorted(pinning.unpinned) == sorted(address for address, _ in pinning.pinned)
    arrays["codes"][:] = 7
    assert int(arrays["codes"].sum()) == 7 * 2100


class FakeDriver:
    """libcuda's calls that DriverPinning and Graph make, recording the registrations and when the capture ran."""

    def __init__(self):
        self.events = []

    def cuCtxGetCurrent(self, out):
        return 0

    def cuCtxSetCurrent(self, context):
        return 0

    def cuMemHostRegister_v2(self, address, nbytes, flags):
        self.events.append("pin")
        time.sleep(0.01)
        return 0

    def cuMemHostUnregister(self, address):
        return 0

    def cuStreamBeginCapture_v2(self, stream, mode):
        self.events.append("begin capture")
        return 0

    def cuStreamEndCapture(self, stream, graph):
        self.events.append("end capture")
        return 0

    def cuGraphInstantiateWithFlags(self, executable, graph, flags):
        return 0


def test_no_memory_is_page_locked_while_a_graph_is_captured(monkeypatch):
    """Issue 63 item 19: the page-locking thread registers the checkpoint's snapshot from the model's build on,
    while the first step captures its graphs; a registration during a capture may fail or invalidate it (the
    one-GPU run that ended on its own before its first checkpoint). The capture waits for the piece in flight,
    and the pinning for the capture."""
    from llama.runtime import cuda
    from llama.runtime import pinned as pinned_module
    lib = FakeDriver()
    monkeypatch.setattr(cuda, "driver", lambda: lib)
    monkeypatch.setattr(pinned_module, "driver", lambda: lib)
    monkeypatch.setattr(cuda, "runtime", lambda: SimpleNamespace(stream=SimpleNamespace(handle=0)))
    monkeypatch.setattr(cuda.Graph, "__del__", lambda self: None)
    arrays = PinnedArrays({"state": ((64, 1024), np.float32)}, piece=4096)  # 64 pieces, 10 ms each
    while "pin" not in lib.events:
        time.sleep(0.001)
    cuda.Graph(lambda: (lib.events.append("captured launches"), time.sleep(0.1)))
    arrays.wait()
    begin = lib.events.index("begin capture")
    assert lib.events[begin:begin + 3] == ["begin capture", "captured launches", "end capture"]
    assert lib.events.count("pin") == 64 and begin > 0 and "pin" in lib.events[begin + 3:]
