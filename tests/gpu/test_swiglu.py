"""SwiGLU's kernels (kernels/swiglu.cu, llama/ops/swiglu.py) against their float64 twins
(llama/twins/swiglu.py): fp32 and bf16 forward and backward, the bf16 backward in place too, and with the amax
of its gradient (--dtype fp8) the same bits and the exact maxima."""

import numpy as np
import pytest

from llama import ops
from llama.twins.swiglu import swiglu_backward, swiglu_forward
from tests.gpu_helpers import bits, check, dev, dev_bf16, poisoned, poisoned_bf16, randn, randn_bf16

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)

# ||out - twin|| / ||twin|| allowed per output, the twin in float64 from the same rounded inputs: a bf16
# output carries one rounding (relative 2^-9 = 2e-3 per element) on top of fp32 math; an fp32 output of
# exact inputs only the fp32 arithmetic. The fp32 kernels' outputs: 1e-5 (tests.gpu_helpers.check).
TOL = {
    "swiglu_bf16": 1e-2,                   # bf16 outputs
}


@pytest.mark.parametrize("N, F", [(1, 1), (37, 100), (256, 2048)])
def test_swiglu(N, F):
    gate_up, dout = randn(rng, N, 2 * F), randn(rng, N, F)
    out, dgu = poisoned((N, F)), poisoned((N, 2 * F))
    ops.swiglu_forward(out, dev(gate_up))
    check("swiglu_forward", out, swiglu_forward(gate_up))
    ops.swiglu_backward(dgu, dev(dout), dev(gate_up))
    check("swiglu_backward", dgu, swiglu_backward(dout, gate_up))


@pytest.mark.parametrize("N, F", [(1, 8), (37, 104), (256, 2048), (1001, 64)])
def test_swiglu_bf16(N, F):
    gate_up, dout = randn_bf16(rng, N, 2 * F, scale=2.0), randn_bf16(rng, N, F)
    out, dgate_up = poisoned_bf16((N, F)), poisoned_bf16((N, 2 * F))
    gate_up_d = dev_bf16(gate_up)
    ops.swiglu_forward_bf16(out, gate_up_d)
    check("swiglu_forward_bf16", out, swiglu_forward(gate_up), TOL["swiglu_bf16"])
    ops.swiglu_backward_bf16(dgate_up, dev_bf16(dout), gate_up_d)
    check("swiglu_backward_bf16", dgate_up, swiglu_backward(dout, gate_up), TOL["swiglu_bf16"])
    ops.swiglu_backward_bf16(gate_up_d, dev_bf16(dout), gate_up_d)  # in place
    assert np.array_equal(bits(gate_up_d), bits(dgate_up))


@pytest.mark.parametrize("N, F", [(1, 8), (37, 104), (65, 256), (200, 2056), (1001, 64)])
def test_swiglu_backward_writes_the_amax_of_its_gradient(N, F):
    """With amax (a dirty one: the launcher zeroes it), the bf16 backward writes the same dgate_up bits, in place
    too, and the max |dgate_up| of each row then of each of its 2F columns as float bits: what fp8_amax leaves
    for the FP8 cast. Rows and columns of magnitudes e^-20 .. e^20 apart, shapes off the 64 x 256 tiles."""
    from llama.runtime.cuda import BF16, to_device
    scale = np.exp(rng.uniform(-20, 20, (N, 1))) * np.exp(rng.uniform(-5, 5, (1, F)))
    gate_up = randn_bf16(rng, N, 2 * F, scale=2.0)
    dout = (randn(rng, N, F) * scale).astype(BF16)
    gate_up_d, dout_d = dev_bf16(gate_up), dev_bf16(dout)
    plain, fused = poisoned_bf16((N, 2 * F)), poisoned_bf16((N, 2 * F))
    ops.swiglu_backward_bf16(plain, dout_d, gate_up_d)
    amax = to_device(np.full(N + 2 * F + 3, 0xFFFFFFFF, np.uint32))
    ops.swiglu_backward_bf16(fused, dout_d, gate_up_d, amax=amax)
    np.testing.assert_array_equal(bits(fused), bits(plain))
    magnitudes = np.abs(fused.download().astype(np.float32))
    expected = np.concatenate([magnitudes.max(axis=1), magnitudes.max(axis=0)]).view(np.uint32)
    np.testing.assert_array_equal(amax.download()[:N + 2 * F], expected)
    in_place = dev_bf16(gate_up)
    ops.swiglu_backward_bf16(in_place, dout_d, in_place, amax=amax)
    np.testing.assert_array_equal(bits(in_place), bits(plain))
    np.testing.assert_array_equal(amax.download()[:N + 2 * F], expected)
