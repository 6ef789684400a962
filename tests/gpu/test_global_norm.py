"""The gradient norm's kernels (kernels/global_norm.cu, llama/ops/global_norm.py) against float64 sums:
fp32 and bf16 path, deterministic reruns (counters reset), and the optimizer-in-backward's clip
estimate against its twin (llama/optim.py's clip_norm_estimate)."""

import numpy as np
import pytest

from llama import ops
from llama.optim import clip_norm_estimate
from tests.gpu_helpers import bits, check, dev, poisoned, randn

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)

# ||out - twin|| / ||twin|| allowed per output, the twin in float64 from the same rounded inputs: a bf16
# output carries one rounding (relative 2^-9 = 2e-3 per element) on top of fp32 math; an fp32 output of
# exact inputs only the fp32 arithmetic. The fp32 kernels' outputs: 1e-5 (tests.gpu_helpers.check).
TOL = {
    "global_norm_squared_bf16": 1e-6,             # fp32 result, double sums
    "clip_norm_estimate": 1e-6,            # fp32 sums of a few dozen positive values
}


@pytest.mark.parametrize("n", [1, 1000, 1_000_003])
def test_global_norm(n):
    x = randn(rng, n)
    out = poisoned((1,))
    ops.global_norm_squared(out, poisoned((ops.NORM_BLOCKS,)), dev(x))
    check("global_norm_squared", out, np.array([x @ x]))
    first = out.download()
    ops.global_norm_squared(out, poisoned((ops.NORM_BLOCKS,)), dev(x))
    assert out.download() == first  # deterministic


@pytest.mark.parametrize("n", [1, 7, 1000, 1_000_003, 3 * 2 ** 22 + 5])
def test_global_norm_squared_bf16(n):
    from llama.runtime.cuda import zeros
    g = rng.standard_normal(n).astype(np.float32)
    g_d, scratch, results = dev(g), zeros(ops.NORM_BLOCKS + 1, np.float64), []
    for _ in range(2):  # the same scratch twice: its counter must be back at zero
        out = poisoned((1,))
        ops.global_norm_squared_bf16(out, scratch, g_d)
        results.append(bits(out))
    check("global_norm_squared_bf16", out, np.array([np.sum(g.astype(np.float64) ** 2)]),
          TOL["global_norm_squared_bf16"])
    assert np.array_equal(results[0], results[1])  # deterministic


@pytest.mark.parametrize("groups", [1, 3, 34])
def test_clip_norm_estimate(groups):
    """Against optim.clip_norm_estimate for every group: with a last step, and on the first (zeros)."""
    current = rng.uniform(0.1, 10.0, groups).astype(np.float32)
    for previous in (rng.uniform(0.1, 10.0, groups).astype(np.float32), np.zeros(groups, np.float32)):
        for g in range(groups):
            out = poisoned((1,))
            ops.clip_norm_estimate(out, dev(current), dev(previous), g)
            check("clip_norm_estimate", out, np.array([clip_norm_estimate(current.astype(np.float64),
                                                                          previous.astype(np.float64), g)]),
                  TOL["clip_norm_estimate"])
    with pytest.raises(ValueError, match=f"group {groups} outside the {groups} groups"):
        ops.clip_norm_estimate(out, dev(current), dev(previous), groups)
