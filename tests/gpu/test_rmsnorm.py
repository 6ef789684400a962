"""RMSNorm's kernels (kernels/rmsnorm.cu, llama/ops/rmsnorm.py) against their float64 twins
(llama/twins/rmsnorm.py): fp32 forward and backward; bf16 forward fused with the residual add (in place
too) and its deterministic backward (reruns bit-identical, counters reset)."""

import numpy as np
import pytest

from llama import ops
from llama.twins.rmsnorm import rmsnorm_backward, rmsnorm_forward, rmsnorm_residual_backward, rmsnorm_residual_forward
from tests.gpu_helpers import bits, check, check_increment, dev, dev_bf16, poisoned, poisoned_bf16, randn, randn_bf16

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)

# ||out - twin|| / ||twin|| allowed per output, the twin in float64 from the same rounded inputs: a bf16
# output carries one rounding (relative 2^-9 = 2e-3 per element) on top of fp32 math; an fp32 output of
# exact inputs only the fp32 arithmetic. The fp32 kernels' outputs: 1e-5 (tests.gpu_helpers.check).
TOL = {
    "rmsnorm_residual_forward_h": 1e-2,    # bf16 output
    "rmsnorm_residual_forward_ln": 1e-2,   # bf16 output
    "rmsnorm_residual_forward_rstd": 5e-3,  # fp32 of the stored (bf16-rounded) h; the twin's h is exact
    "rmsnorm_residual_forward_stored_h": 1e-5,  # the same rstd against the twin of the stored h
    "rmsnorm_forward_bf16_rstd": 1e-5,     # fp32 of exact inputs
    "rmsnorm_backward_bf16_dresidual": 1e-2,  # bf16 output
    "rmsnorm_backward_bf16_dweight": 1e-5,  # fp32 of exact inputs
}


@pytest.mark.parametrize("N, C", [(1, 32), (37, 100), (300, 768), (1000, 48)])
def test_rmsnorm(N, C):
    x, w = randn(rng, N, C), randn(rng, C)
    out, rstd = poisoned((N, C)), poisoned((N,))
    ops.rmsnorm_forward(out, rstd, dev(x), dev(w), 1e-5)
    ref_out, ref_rstd = rmsnorm_forward(x, w, 1e-5)
    check("rmsnorm_forward", out, ref_out)
    check("rmsnorm_forward_rstd", rstd, ref_rstd)
    dout, dinp0, dw0 = randn(rng, N, C), randn(rng, N, C), randn(rng, C)
    dinp, dw = dev(dinp0), dev(dw0)
    ops.rmsnorm_backward(dinp, dw, poisoned((ops.RMSNORM_PARTS * C,)), dev(dout), dev(x), dev(w), rstd)
    ref_dx, ref_dw = rmsnorm_backward(dout, x, w, ref_rstd)
    check("rmsnorm_backward_dinp", dinp, dinp0 + ref_dx)
    check("rmsnorm_backward_dweight", dw, dw0 + ref_dw)


@pytest.mark.parametrize("N, C", [(1, 8), (37, 104), (300, 768), (1000, 48), (513, 2048), (3, 4096)])
def test_rmsnorm_residual_bf16(N, C):
    from llama.runtime.cuda import zeros
    eps = 1e-5
    x, branch, w = randn_bf16(rng, N, C), randn_bf16(rng, N, C), randn_bf16(rng, C)
    residual, ln, rstd = poisoned_bf16((N, C)), poisoned_bf16((N, C)), poisoned((N,))
    w_d = dev(w)  # the fp32 master weight
    ops.rmsnorm_residual_forward_bf16(residual, ln, rstd, dev_bf16(x), dev_bf16(branch), w_d, eps)
    ref_h, ref_ln, ref_rstd = rmsnorm_residual_forward(x, branch, w, eps)
    check("rmsnorm_residual_forward_h", residual, ref_h, TOL["rmsnorm_residual_forward_h"])
    check("rmsnorm_residual_forward_ln", ln, ref_ln, TOL["rmsnorm_residual_forward_ln"])
    check("rmsnorm_residual_forward_rstd", rstd, ref_rstd, TOL["rmsnorm_residual_forward_rstd"])
    h = residual.download().astype(np.float64)  # the norm of the stored h, exactly
    check("rmsnorm_residual_forward_stored_h", rstd, rmsnorm_forward(h, w, eps)[1],
          TOL["rmsnorm_residual_forward_stored_h"])

    x_d = dev_bf16(x)  # in place: the residual stream overwritten by x + branch
    ops.rmsnorm_residual_forward_bf16(x_d, poisoned_bf16((N, C)), poisoned((N,)), x_d, dev_bf16(branch), w_d, eps)
    assert np.array_equal(bits(x_d), bits(residual))

    # backward at the stored bf16 h and the kernel's rstd, the inputs it will have in the model
    rstd64 = rstd.download().astype(np.float64)
    dln, dres0, dw0 = randn_bf16(rng, N, C), randn_bf16(rng, N, C), rng.standard_normal(C).astype(np.float32)
    scratch = zeros(ops.rmsnorm_bf16_scratch_size(C))
    dln_d, results = dev_bf16(dln), []
    for _ in range(2):  # the same scratch twice: its counters must be back at zero
        dres, dw = dev_bf16(dres0), dev(dw0)
        ops.rmsnorm_backward_bf16(dres, dw, scratch, dln_d, residual, w_d, rstd)
        results.append((bits(dres), bits(dw)))
    ref_dres, ref_dw = rmsnorm_residual_backward(dres0, dln, h, w, rstd64)
    check("rmsnorm_backward_bf16_dresidual", dres, ref_dres, TOL["rmsnorm_backward_bf16_dresidual"])
    check_increment("rmsnorm_backward_bf16_dweight", dw, dw0, ref_dw, TOL["rmsnorm_backward_bf16_dweight"])
    assert all(np.array_equal(a, b) for a, b in zip(*results))  # deterministic


@pytest.mark.parametrize("N, C", [(1, 8), (37, 104), (300, 768)])
def test_rmsnorm_forward_bf16(N, C):
    x, w = randn_bf16(rng, N, C), randn_bf16(rng, C)
    out, rstd = poisoned_bf16((N, C)), poisoned((N,))
    ops.rmsnorm_forward_bf16(out, rstd, dev_bf16(x), dev(w), 1e-5)
    ref_out, ref_rstd = rmsnorm_forward(x, w, 1e-5)
    check("rmsnorm_forward_bf16", out, ref_out, TOL["rmsnorm_residual_forward_ln"])
    check("rmsnorm_forward_bf16_rstd", rstd, ref_rstd, TOL["rmsnorm_forward_bf16_rstd"])
