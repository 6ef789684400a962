"""The fp32 path's matmul (kernels/matmul.cu, llama/ops/matmul.py) against the float64 product: every
layout, batched and not, shapes that are not multiples of the tiles, alpha and beta. The bf16 GEMM:
tests/gpu/test_gemm.py."""

import numpy as np
import pytest

from llama import ops
from tests.gpu_helpers import check, dev, poisoned, randn

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)


@pytest.mark.parametrize("M, N, K, batch", [(1, 1, 1, 1), (37, 129, 65, 1), (128, 128, 16, 1),
                                            (300, 257, 1000, 1), (70, 45, 33, 3), (8, 1030, 77, 2)])
@pytest.mark.parametrize("trans", ["nn", "nt", "tn"])
def test_matmul(M, N, K, batch, trans):
    ta, tb = trans[0] == "t", trans[1] == "t"
    a = randn(rng, batch, K, M) if ta else randn(rng, batch, M, K)
    b = randn(rng, batch, N, K) if tb else randn(rng, batch, K, N)
    opa, opb = (a.swapaxes(1, 2) if ta else a), (b.swapaxes(1, 2) if tb else b)
    squeeze = (lambda x: x[0]) if batch == 1 else (lambda x: x)
    c = poisoned((batch, M, N) if batch > 1 else (M, N))
    ops.matmul(c, dev(squeeze(a)), dev(squeeze(b)), trans_a=ta, trans_b=tb, alpha=0.5)
    check(f"matmul[{trans}]", c, squeeze(0.5 * opa @ opb))
    c0 = randn(rng, *c.shape)
    c = dev(c0)
    ops.matmul(c, dev(squeeze(a)), dev(squeeze(b)), trans_a=ta, trans_b=tb, alpha=1.0, beta=1.0)
    check(f"matmul_accumulate[{trans}]", c, c0 + squeeze(opa @ opb))


def test_matmul_rejects_bad_shapes():
    with pytest.raises(ValueError, match="b: expected float32 \\(5, 3\\)"):
        ops.matmul(poisoned((4, 3)), dev(randn(rng, 4, 5)), dev(randn(rng, 6, 3)))
