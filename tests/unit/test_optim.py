import numpy as np
import pytest

from llama.optim import AdamWConfig, adamw_update, clip_scale, global_norm, learning_rate


def test_first_adamw_step_is_sign_descent_plus_decay():
    """At step 1 the bias-corrected moments are g and g^2: the update is lr * (g / (|g| + eps) + wd * p)."""
    rng = np.random.default_rng(0)
    p, g = rng.standard_normal(50), rng.standard_normal(50)
    mask = (np.arange(50) % 3 != 0).astype(np.uint8)
    opt = AdamWConfig(eps=1e-8, weight_decay=0.1)
    expected = p - 0.01 * (g / (np.abs(g) + 1e-8) + 0.1 * mask * p)
    m, v = np.zeros(50), np.zeros(50)
    adamw_update(p, g, m, v, mask, 1, 0.01, opt)
    np.testing.assert_allclose(p, expected, rtol=1e-12)
    np.testing.assert_allclose(m, 0.1 * g)
    np.testing.assert_allclose(v, 0.05 * g * g)


def test_second_step_bias_correction_and_grad_scale():
    p = np.array([1.0, -2.0])
    m, v = np.array([0.1, 0.2]), np.array([0.01, 0.03])
    g = np.array([0.5, -1.0])
    opt = AdamWConfig(beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.0)
    m2 = 0.8 * m + 0.2 * (g * 0.5)
    v2 = 0.9 * v + 0.1 * (g * 0.5) ** 2
    expected = p - 0.1 * (m2 / (1 - 0.8 ** 2)) / (np.sqrt(v2 / (1 - 0.9 ** 2)) + 1e-6)
    adamw_update(p, g, m, v, np.ones(2, np.uint8), 2, 0.1, opt, grad_scale=0.5)
    np.testing.assert_allclose(p, expected, rtol=1e-12)


def test_global_norm_and_clipping():
    g = np.array([3.0, 4.0], dtype=np.float32)
    assert global_norm(g) == 5.0
    assert clip_scale(5.0, 1.0) == 0.2
    assert clip_scale(0.5, 1.0) == 1.0
    assert clip_scale(5.0, 0.0) == 1.0


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_schedules(schedule):
    lrs = [learning_rate(s, 100, 1.0, warmup_steps=10, schedule=schedule, final_lr_frac=0.1) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert max(lrs) == pytest.approx(1.0)
    assert all(a >= b - 1e-12 for a, b in zip(lrs[10:], lrs[11:]))  # never increases after warmup
    if schedule == "constant":
        assert lrs[100] == 1.0
    else:
        assert lrs[100] == pytest.approx(0.1)
    if schedule == "wsd":
        assert lrs[79] == 1.0 and lrs[90] < 1.0
    if schedule == "cosine":
        assert lrs[55] == pytest.approx(0.55)
    with pytest.raises(ValueError, match="unknown schedule"):
        learning_rate(0, 10, 1.0, schedule="step")
