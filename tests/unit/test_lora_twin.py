"""The LoRA layer's twin (llama/twins/lora.py): its backward against float64 finite differences (with and without
dropout, on a batch of sequences), its forward against the merged weight, PEFT's scalings and initialization."""

import math

import numpy as np
import pytest

from llama.twins import lora
from tests.gradcheck import numerical_grad, rel_error

IC, OC, R = 12, 10, 4


def layer(seed: int, shape=(2, 3)):
    """x (*shape, IC), W, A, B (B not zero, so that every gradient flows), dout, in float64."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*shape, IC)), rng.standard_normal((OC, IC)), rng.standard_normal((R, IC)),
            rng.standard_normal((OC, R)), rng.standard_normal((*shape, OC)))


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_gradients_against_finite_differences(p, use_rslora):
    x, w, a, b, dout = layer(1)
    scale = lora.lora_scale(R, 16, use_rslora)
    keep = np.random.default_rng(2).random(x.shape) >= p
    dropout = lora.dropout_multiplier(keep, p) if p else None
    loss = lambda: float(np.sum(lora.lora_forward(x, w, a, b, scale, dropout)[0] * dout))  # noqa: E731
    _, xa = lora.lora_forward(x, w, a, b, scale, dropout)
    dx, da, db = lora.lora_backward(dout, x, xa, w, a, b, scale, dropout)
    for name, grad, array in (("dx", dx, x), ("dA", da, a), ("dB", db, b)):
        assert grad.shape == array.shape
        assert rel_error(grad, numerical_grad(loss, array)) < 1e-8, name


def test_the_forward_is_the_merged_weights_and_dropout_only_touches_the_adapter():
    x, w, a, b, _ = layer(3)
    scale = lora.lora_scale(R, 32)
    out, xa = lora.lora_forward(x, w, a, b, scale)
    np.testing.assert_allclose(out, x @ (w + lora.lora_delta(a, b, scale)).T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(xa, x @ a.T)
    keep = np.zeros(x.shape)
    dropped, xa_dropped = lora.lora_forward(x, w, a, b, scale, lora.dropout_multiplier(keep, 0.5))
    np.testing.assert_allclose(dropped, x @ w.T)
    np.testing.assert_array_equal(xa_dropped, 0)


def test_the_scales_are_peft_s():
    assert lora.lora_scale(16, 32) == 2.0 and lora.lora_scale(8, 16, use_rslora=True) == 16 / math.sqrt(8)


def test_a_fresh_adapter_leaves_the_layer_as_it_was_and_its_gradient_is_da_zero():
    """B = 0: the output is the base's, dA is 0 (it flows through B) and dB is not."""
    x, w, _, _, dout = layer(4)
    a, b = lora.lora_init(seed=5, start=0, rank=R, in_features=IC, out_features=OC)
    out, xa = lora.lora_forward(x, w, a.astype(np.float64), b.astype(np.float64), 2.0)
    np.testing.assert_array_equal(out, x @ w.T)
    dx, da, db = lora.lora_backward(dout, x, xa, w, a.astype(np.float64), b.astype(np.float64), 2.0)
    np.testing.assert_array_equal(dx, dout @ w)
    assert not da.any() and np.abs(db).max() > 0


def test_the_initialization():
    """PEFT's kaiming_uniform_(a=sqrt(5)): uniform within 1/sqrt(in), mean 0, variance bound^2 / 3; the same bits
    from the same seed and offset, any slice drawn alone, and other seeds or offsets other values."""
    rank, fan_in = 16, 4096
    a, b = lora.lora_init(seed=7, start=1000, rank=rank, in_features=fan_in, out_features=1024)
    assert a.dtype == b.dtype == np.float32 and a.shape == (rank, fan_in) and b.shape == (1024, rank)
    assert not b.any()
    bound = 1 / math.sqrt(fan_in)
    assert np.abs(a).max() < bound and abs(a.mean()) < 0.01 * bound
    assert abs(a.var() / (bound ** 2 / 3) - 1) < 0.02
    again, _ = lora.lora_init(seed=7, start=1000, rank=rank, in_features=fan_in, out_features=1024)
    assert again.tobytes() == a.tobytes()
    part = (lora.uniforms(7, 1000 + 4099, 77) * bound).astype(np.float32)
    np.testing.assert_array_equal(part, a.reshape(-1)[4099:4099 + 77])
    other, _ = lora.lora_init(seed=8, start=1000, rank=rank, in_features=fan_in, out_features=1024)
    shifted, _ = lora.lora_init(seed=7, start=1001, rank=rank, in_features=fan_in, out_features=1024)
    assert (other != a).mean() > 0.99 and (shifted.reshape(-1)[:-1] == a.reshape(-1)[1:]).all()
