import numpy as np
import pytest

from llama.optim import (DYNAMIC_SIGNED, DYNAMIC_UNSIGNED, QUANT_BLOCK, AdamW8bitState, AdamWConfig, AdamWState,
                         adamw_update, clip_scale, dequantize_blocks, global_norm, learning_rate, quantize_blocks)


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


# ---- 8-bit moments


@pytest.mark.parametrize("levels", [DYNAMIC_SIGNED, DYNAMIC_UNSIGNED])
def test_dynamic_maps_are_ascending_to_one_and_only_the_signed_holds_zero(levels):
    assert levels.dtype == np.float32 and levels.size == 255 and np.all(np.diff(levels) > 0)
    signed = levels is DYNAMIC_SIGNED
    assert levels[-1] == 1 and (0 in levels) == signed and levels[0] == (-1 if signed else np.float32(1e-7))
    top = levels[levels >= 0.1]  # the top decade: two significant digits
    assert np.diff(top).max() <= 0.9 / (64 if levels is DYNAMIC_SIGNED else 128) + 1e-7


def _nearest(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """float64 brute force: each normalized value's nearest level."""
    return levels[np.abs(x[:, None].astype(np.float64) - levels[None, :]).argmin(axis=1)]


@pytest.mark.parametrize("levels, n", [(DYNAMIC_SIGNED, 3 * QUANT_BLOCK), (DYNAMIC_SIGNED, 1000),
                                       (DYNAMIC_UNSIGNED, 777)])
def test_quantize_takes_each_block_scale_and_the_nearest_level(levels, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 2, n))).astype(np.float32)  # magnitudes over 4 decades
    if levels is DYNAMIC_UNSIGNED:
        x = x * x
    codes, scales = quantize_blocks(x, levels)
    assert codes.dtype == np.uint8 and codes.shape == (n,) and scales.shape == (-(-n // QUANT_BLOCK),)
    blocks = np.arange(n) // QUANT_BLOCK
    np.testing.assert_array_equal(scales, [np.abs(x[blocks == b]).max() for b in range(scales.size)])
    normalized = x.astype(np.float64) / scales[blocks]
    np.testing.assert_array_equal(levels[codes], _nearest(normalized, levels))
    out = dequantize_blocks(codes, scales, levels)
    assert out.dtype == np.float32
    big = np.abs(normalized) >= 0.1  # the top decade holds every value to 0.7% (signed) of its block's largest
    assert np.abs(out - x)[big].max() <= (0.9 / 64 / 2 + 1e-6) * scales[blocks][big].max()


def test_zeros_stay_zero_and_an_outlier_only_coarsens_its_own_block():
    x = np.zeros(4 * QUANT_BLOCK, np.float32)
    x[QUANT_BLOCK:] = np.random.default_rng(0).standard_normal(3 * QUANT_BLOCK).astype(np.float32)
    x[QUANT_BLOCK + 5] = 0.0
    x[2 * QUANT_BLOCK + 7] = 1e4  # an outlier
    codes, scales = quantize_blocks(x, DYNAMIC_SIGNED)
    out = dequantize_blocks(codes, scales, DYNAMIC_SIGNED)
    assert scales[0] == 0 and np.all(out[:QUANT_BLOCK] == 0) and out[QUANT_BLOCK + 5] == 0  # zeros are exact
    assert out[2 * QUANT_BLOCK + 7] == 1e4  # the largest value of a block is its scale, exactly
    outlier_block = slice(2 * QUANT_BLOCK, 3 * QUANT_BLOCK)
    others = np.arange(2 * QUANT_BLOCK, 3 * QUANT_BLOCK) != 2 * QUANT_BLOCK + 7
    rest, kept = x[outlier_block][others], out[outlier_block][others]  # 1e-5 to 3e-4 of it: a rough magnitude
    assert np.all(np.abs(kept - rest) <= np.abs(rest)) and np.abs(kept - rest).max() > 0.1 * np.abs(rest).max()
    third = slice(3 * QUANT_BLOCK, None)  # the next block keeps its own precision
    assert np.abs(out[third] - x[third]).max() < 0.03 * np.abs(x[third]).max()


def test_a_second_moment_small_in_its_block_never_reads_back_as_zero():
    """The zero-point problem: v 1e-12 of its block's largest beside m 1e-5 of its own. Were v read back
    as 0, AdamW's step would be m / eps ~ 1e3; without zero in v's map it stays under sqrt(1e-5 / 1e-7)."""
    m, v = np.full(QUANT_BLOCK, 1e-5, np.float32), np.full(QUANT_BLOCK, 1e-12, np.float32)
    m[0], v[0] = 1.0, 1.0
    codes, scales = quantize_blocks(v, DYNAMIC_UNSIGNED)
    assert np.all(dequantize_blocks(codes, scales, DYNAMIC_UNSIGNED) >= np.float32(1e-7))
    state, params = AdamW8bitState(QUANT_BLOCK), np.zeros(QUANT_BLOCK, np.float32)
    state.load(m, v)
    state.update(params, np.zeros(QUANT_BLOCK, np.float32), np.zeros(QUANT_BLOCK, np.uint8), 1000, 1.0, AdamWConfig())
    assert np.abs(params[1:]).max() < 0.1  # measured 0.029 (with zero in the map: 900)
    zeros = AdamW8bitState(QUANT_BLOCK)  # an all-zero block is exact whatever the map
    assert all(np.all(x == 0) for x in zeros.moments())


@pytest.mark.parametrize("levels", [DYNAMIC_SIGNED, DYNAMIC_UNSIGNED])
def test_a_dequantized_state_quantizes_back_to_the_same_bits(levels):
    """What lets checkpoints keep fp32 moments: resume requantizes them to exactly the state it saved."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(5000) * np.exp(rng.uniform(-20, 5, 5000))).astype(np.float32)
    codes, scales = quantize_blocks(np.abs(x) if levels is DYNAMIC_UNSIGNED else x, levels)
    again = quantize_blocks(dequantize_blocks(codes, scales, levels), levels)
    np.testing.assert_array_equal(again[0], codes)
    np.testing.assert_array_equal(again[1], scales)


def _steps(state, steps: int = 30, n: int = 3000, chunk: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(2)
    params = rng.standard_normal(n).astype(np.float32)
    mask = (np.arange(n) % 7 != 0).astype(np.uint8)
    if chunk:
        state.CHUNK = chunk
    for step in range(1, steps + 1):
        grads = (rng.standard_normal(n) * np.linspace(1e-4, 1, n) + 0.3 * np.sin(np.arange(n) + step)).astype(np.float32)
        state.update(params, grads, mask, step, 1e-2, AdamWConfig(), grad_scale=0.5)
    return params


def test_adamw8bit_follows_adamw_and_its_chunks_do_not_matter():
    plain, eight = _steps(AdamWState(3000)), _steps(AdamW8bitState(3000))
    start = np.random.default_rng(2).standard_normal(3000).astype(np.float32)
    moved = np.abs(plain - start)
    assert np.abs(eight - plain).max() < 0.05 * moved.max()  # measured 0.024 after 30 steps of lr 1e-2
    assert np.linalg.norm(eight - plain) < 0.025 * np.linalg.norm(moved)  # measured 0.017
    np.testing.assert_array_equal(_steps(AdamW8bitState(3000), chunk=2 * QUANT_BLOCK), eight)


def test_adamw8bit_state_goes_through_fp32_moments_unchanged():
    state = AdamW8bitState(1000)
    _steps(state, steps=3, n=1000)
    m, v = state.moments()
    again = AdamW8bitState(1000)
    again.load(m, v)
    for name in ("m_codes", "m_scales", "v_codes", "v_scales"):
        np.testing.assert_array_equal(getattr(again, name), getattr(state, name))
    again.load(None, None)
    assert all(np.all(x == 0) for x in again.moments())


def test_adamw8bit_updates_whole_blocks_only():
    state, values = AdamW8bitState(1000), np.ones(1000, np.float32)
    mask = np.ones(1000, np.uint8)
    with pytest.raises(ValueError, match=r"whole blocks of 256: \[100, 1000\) cuts one"):
        state.update(values[100:], values[100:], mask[100:], 1, 1e-3, AdamWConfig(), start=100)
    with pytest.raises(ValueError, match=r"\[0, 300\) cuts one"):
        state.update(values[:300], values[:300], mask[:300], 1, 1e-3, AdamWConfig())
    state.update(values[512:], values[512:], mask[512:], 1, 1e-3, AdamWConfig(), start=512)  # up to the end: whole
    assert np.all(values[:512] == 1) and np.all(values[512:] < 1)


@pytest.mark.parametrize("levels", [DYNAMIC_SIGNED, DYNAMIC_UNSIGNED])
def test_the_code_lookup_counts_the_midpoints_as_a_binary_search_does(levels):
    """quantize_blocks finds codes by a 65536-bucket table of float32 order keys: the same as
    numpy.searchsorted(side="right") over the midpoints, at the midpoints, next to them, at +-0 and tiny values."""
    from llama.optim import CODE_TABLES, MIDPOINTS, _order_keys
    rng, mid = np.random.default_rng(3), MIDPOINTS[id(levels)]
    x = np.concatenate([rng.uniform(-1, 1, 100_000), rng.standard_normal(50_000) * np.exp(rng.uniform(-20, 0, 50_000)),
                        mid, np.nextafter(mid, np.float32(2)), np.nextafter(mid, np.float32(-2)), levels,
                        [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45]]).astype(np.float32)
    x = np.abs(x) if levels is DYNAMIC_UNSIGNED else x
    below, inside = CODE_TABLES[id(levels)]
    keys = _order_keys(x)
    np.testing.assert_array_equal(below[keys >> 16] + (keys >= inside[keys >> 16]),
                                  np.searchsorted(mid, x, side="right"))
