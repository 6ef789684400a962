"""CUDA graphs captured while host memory is page-locked in the background (issue 63 item 19): the one-GPU
trainer page-locks the checkpoint's snapshot from the model's build on, on a thread of its own, while the first
step captures its graphs. Every capture must succeed and replay right, and every piece must be pinned."""

import numpy as np
import pytest

from llama import ops
from llama.runtime.cuda import Graph
from llama.runtime.pinned import PinnedArrays
from tests.gpu_helpers import dev, poisoned, randn

pytestmark = pytest.mark.gpu


def test_graphs_captured_while_memory_is_page_locked_replay_right():
    rng = np.random.default_rng(19)
    x, y = randn(rng, 1 << 20), randn(rng, 1 << 20)
    dx, dy = dev(x), dev(y)
    expected = x.astype(np.float32) + y.astype(np.float32)
    ops.residual_forward(poisoned((1 << 20,)), dx, dy)  # the kernel loaded before any capture
    # 4 GiB in 64 MiB pieces: seconds of cuMemHostRegister calls, over which the captures below run
    snapshot = PinnedArrays({"state": ((1 << 30,), np.float32)})
    captures = 0
    while not snapshot.ready:
        out = poisoned((1 << 20,))
        graph = Graph(lambda: ops.residual_forward(out, dx, dy))
        graph.replay()
        assert np.array_equal(out.download(), expected)
        captures += 1
    snapshot.wait()
    assert snapshot.pinned_bytes == 1 << 32 and captures >= 1  # as many as the pinning's seconds allow
