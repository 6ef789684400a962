"""The fp32 path's residual add (kernels/residual.cu, llama/ops/residual.py)."""

import numpy as np
import pytest

from llama import ops
from tests.gpu_helpers import check, dev, poisoned, randn

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)


def test_residual():
    x, y = randn(rng, 1001), randn(rng, 1001)
    out = poisoned((1001,))
    ops.residual_forward(out, dev(x), dev(y))
    check("residual_forward", out, x + y)
