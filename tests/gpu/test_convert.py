"""The precision conversions (kernels/convert.cu, llama/ops/convert.py): rounding to bf16 bit for bit
ml_dtypes', widening exact."""

import numpy as np
import pytest

from llama import ops
from llama.runtime.cuda import BF16
from tests.gpu_helpers import bits, dev, poisoned_bf16

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)


@pytest.mark.parametrize("n", [1, 255, 257, 100_003])
def test_round_to_bf16_and_widen_bf16(n):
    """The conversions around a bf16 reduce-scatter: rounding to nearest even is ml_dtypes' bit for bit (ties,
    signed zeros, infinities; NaN stays NaN), and widening is exact, also when it adds into its output."""
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    x[:4] = [np.float32(1 + 2**-8), -0.0, np.inf, np.nan][:min(n, 4)]  # a tie rounds to even; specials stay
    rounded = poisoned_bf16((n,))
    ops.round_to_bf16(rounded, dev(x))
    number = ~np.isnan(x)
    assert np.array_equal(bits(rounded)[number], x.astype(BF16).view(np.uint16)[number])
    assert np.isnan(rounded.download().astype(np.float32)[~number]).all()
    widened = dev(np.full(n, np.nan, np.float32))
    ops.widen_bf16(widened, rounded)
    expected = rounded.download().astype(np.float32)
    assert np.array_equal(widened.download(), expected, equal_nan=True)
    base = (rng.standard_normal(n)).astype(np.float32)
    total = dev(base)
    ops.widen_bf16(total, rounded, accumulate=True)
    assert np.array_equal(total.download(), base + expected, equal_nan=True)
