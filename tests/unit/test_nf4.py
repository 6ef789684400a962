"""The NF4 twin (llama/twins/nf4.py): bitsandbytes' levels, decision thresholds, packing, dynamic map and
binary search; round-trip bounds; odd sizes; and, where tests/data/golden/nf4_bnb.* is recorded
(scripts/record_nf4_golden.py, on the GPU machine), bitsandbytes' CUDA kernels' own codes and values."""

import json
import math

import ml_dtypes
import numpy as np
import pytest

from llama.twins import nf4
from tests.hf_helpers import GOLDEN, fixture_paths, sha256
from tests.nf4_cases import NF4_CASES, NF4_GOLDEN, RECORD_NF4_COMMAND, nf4_case_weights

BF16 = ml_dtypes.bfloat16
# the constants of bitsandbytes' dQuantizeNF4 decision tree (csrc/kernels.cu), ascending
BNB_NF4_TREE = [-0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
                -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
                0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683, 0.5016634166240692,
                0.6427869200706482, 0.8614784181118011]


def test_the_levels_and_thresholds_are_bitsandbytes():
    levels = nf4.NF4_LEVELS
    assert levels.dtype == np.float32 and levels.shape == (16,) and np.all(np.diff(levels) > 0)
    assert levels[0] == -1 and levels[7] == 0 and levels[15] == 1
    np.testing.assert_array_equal(nf4.NF4_THRESHOLDS, np.float32(BNB_NF4_TREE))


def test_the_dynamic_map():
    """256 ascending levels: 0, 1 and per decade 10^-6 .. 10^0 2^(6 - e) levels on each side of zero, each within
    two float32 ulps of its value in exact arithmetic (the float32 linspace's roundings)."""
    levels = nf4.DYNAMIC_MAP
    assert levels.dtype == np.float32 and levels.shape == (256,) and np.all(np.diff(levels) > 0)
    assert levels[255] == 1 and levels[127] == 0 and np.float32(-0.99296875) == levels[0]
    exact = [0.0, 1.0]
    for i in range(7):
        bounds = np.linspace(0.1, 1.0, 2 ** i + 1)
        means = (bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)
        exact += list(means) + list(-means)
    exact = np.sort(exact)
    assert np.all(np.abs(levels - exact) <= 2 * np.spacing(np.abs(exact).astype(np.float32)))


def test_codes_are_the_nearest_level_and_a_midpoint_goes_down():
    """In a block whose absmax is 1, w / absmax is w: a threshold's value gets the lower level, the next float
    above it the upper one, and random values the nearest level."""
    t = nf4.NF4_THRESHOLDS
    w = np.concatenate([[1.0], t, np.nextafter(t, np.float32(2)), np.linspace(-1, 1, 40)]).astype(np.float32)
    codes = nf4.nf4_codes(w, nf4.block_absmax(w))
    np.testing.assert_array_equal(codes[1:16], np.arange(15))
    np.testing.assert_array_equal(codes[16:31], np.arange(1, 16))
    rest = w[31:]
    np.testing.assert_array_equal(codes[31:w.size], np.abs(rest[:, None] - nf4.NF4_LEVELS).argmin(axis=1))


def test_two_codes_a_byte_the_first_in_the_high_nibble():
    w = np.zeros(64, np.float32)
    w[:5] = [-1.0, 1.0, 0.0, 0.5626170039176941, -0.39491748809814453]
    q = nf4.quantize(w)
    assert q.codes.dtype == np.uint8 and q.codes.shape == (32,)
    assert list(q.codes[:3]) == [0x0F, 0x7D, 0x37]
    np.testing.assert_array_equal(nf4.unpack(q.codes, 64), nf4.nf4_codes(w, nf4.block_absmax(w)))
    np.testing.assert_array_equal(nf4.pack(nf4.unpack(q.codes, 64)), q.codes)


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 129, 2541, 64 * 256 + 3])
def test_odd_sizes(n):
    """Blocks of 64 with a short last one, (n + 1) // 2 bytes whose padding nibble is the code of 0 (7), the
    absmaxes' 256-blocks with a short last one, and the values back in the tensor's shape."""
    w = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    q = nf4.quantize(w)
    blocks = math.ceil(n / 64)
    assert q.codes.shape == ((n + 1) // 2,) and q.absmax_codes.shape == (blocks,)
    assert q.absmax_scales.shape == (math.ceil(blocks / 256),) and q.shape == (n,)
    if n % 2:
        assert q.codes[-1] & 0xF == 7
    np.testing.assert_array_equal(nf4.block_absmax(w)[-1], np.abs(w[(blocks - 1) * 64:]).max())
    assert nf4.dequantize(q).shape == (n,)


def test_a_block_of_zeros_and_one_of_subnormals():
    """bitsandbytes' kernels flush a subnormal absmax to 0 (and subnormal weights), and 0 * (1 / 0) is NaN: code
    0, level -1. Its absmax comes back from the double quantization as about 0, not 0, and so do its weights."""
    w = np.random.default_rng(0).standard_normal(64 * 3 + 1).astype(np.float32)
    w[:64] = 0
    w[64:128] = np.float32(1e-39)
    w[-1] = 0  # the last block holds one zero: absmax 0, and its padding nibble too
    q = nf4.quantize(w)
    absmax = nf4.block_absmax(w)
    assert absmax[0] == absmax[1] == absmax[3] == 0
    codes = nf4.unpack(q.codes, w.size + 1)
    assert not codes[:128].any() and not codes[-2:].any()
    back, back_absmax = nf4.dequantize(q), nf4.dequantize_absmax(q.absmax_codes, q.absmax_scales, q.offset)
    np.testing.assert_array_equal(back[:128], -np.repeat(back_absmax[:2], 64))
    assert back[-1] == -back_absmax[3] and np.abs(back_absmax[[0, 1, 3]]).max() < 0.01 * absmax.max()


def test_round_trip_error_bounds():
    """Each weight is off by at most half the widest gap between levels (0.139) times its block's absmax, plus
    the error of the absmax's own 8-bit code; each absmax by at most half the gap around its code's level
    times its scale (the dynamic map's nearest level), plus float32 rounding."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((200, 320)) * np.exp(rng.uniform(-4, 4, (200, 1)))).astype(BF16)
    q = nf4.quantize(w)
    absmax = nf4.block_absmax(w)
    back_absmax = nf4.dequantize_absmax(q.absmax_codes, q.absmax_scales, q.offset)
    gaps = np.diff(nf4.DYNAMIC_MAP.astype(np.float64))
    around = np.maximum(np.r_[gaps, 0][q.absmax_codes], np.r_[0, gaps][q.absmax_codes]) / 2
    scale = np.repeat(q.absmax_scales, 256)[:absmax.size].astype(np.float64)
    absmax_error = np.abs(back_absmax.astype(np.float64) - absmax)
    assert np.all(absmax_error <= around * scale + 4 * np.spacing(np.maximum(absmax, np.abs(q.offset))))
    half_gap = np.diff(nf4.NF4_LEVELS.astype(np.float64)).max() / 2
    error = np.abs(nf4.dequantize(q).astype(np.float64) - w.astype(np.float64)).reshape(-1, 64)
    bound = half_gap * absmax[:, None] + absmax_error[:, None] + 1e-6 * absmax[:, None]
    assert np.all(error <= bound)
    rel = np.linalg.norm(error) / np.linalg.norm(w.astype(np.float64))
    assert 0.05 < rel < 0.15, rel  # NF4 of normal weights: about 0.1


def test_dynamic_codes_is_the_nearest_level_ties_to_the_even_code():
    """bitsandbytes' binary search lands on an even level and keeps it on either midpoint beside it."""
    levels = nf4.DYNAMIC_MAP
    x = np.random.default_rng(2).uniform(-1, 1, 20000).astype(np.float32)
    nearest = np.abs(x[:, None].astype(np.float64) - levels).argmin(axis=1)
    np.testing.assert_array_equal(nf4.dynamic_codes(x), nearest)
    midpoints = ((levels[:-1] + levels[1:]) * np.float32(0.5)).astype(np.float32)
    codes = nf4.dynamic_codes(midpoints)
    even = np.arange(255) + np.arange(255) % 2  # midpoint k lies between levels k and k + 1
    np.testing.assert_array_equal(codes, even)
    np.testing.assert_array_equal(nf4.dynamic_codes(levels), np.arange(256))
    assert nf4.dynamic_codes(np.float32([np.nan, -1.0, 1.0])).tolist() == [0, 0, 255]


def test_the_absmax_mean():
    """Within an ulp of the exact mean, and the same bits whatever the values' magnitudes' order."""
    rng = np.random.default_rng(3)
    for n in (1, 255, 256, 257, 100_000):
        absmax = np.exp(rng.uniform(-8, 2, n)).astype(np.float32)
        mean = nf4.absmax_mean(absmax)
        assert mean.dtype == np.float32
        exact = math.fsum(absmax.astype(np.float64)) / n
        assert abs(float(mean) - exact) <= np.spacing(np.float32(exact))
        assert nf4.absmax_mean(absmax.copy()).tobytes() == mean.tobytes()


def test_bf16_codes_do_not_depend_on_the_last_bits_of_the_reciprocal():
    """bitsandbytes takes 1 / absmax with the GPU's approximate reciprocal, we with the exact one: for every
    bf16 absmax mantissa and every bf16 weight at or below it (exponents 0 to 6 apart; further apart all
    round to the middle level 7), the codes with the reciprocal moved 3 ulps either way are ours."""
    mantissas = np.arange(0x3F80, 0x4000, dtype=np.uint16).view(BF16).astype(np.float32)  # [1, 2)
    weights = np.concatenate([mantissas * np.float32(2.0 ** -d) for d in range(7)])
    weights = np.concatenate([weights, -weights])
    for absmax in mantissas:
        w = weights[np.abs(weights) <= absmax]
        reciprocal = np.float32(1) / absmax
        codes = np.searchsorted(nf4.NF4_THRESHOLDS, (w * reciprocal).astype(np.float32), side="left")
        for ulps in (-3, -2, -1, 1, 2, 3):
            moved = (np.asarray(reciprocal).view(np.int32) + ulps).view(np.float32)
            assert np.array_equal(np.searchsorted(nf4.NF4_THRESHOLDS, (w * moved).astype(np.float32)), codes)


# ---- the golden fixture: bitsandbytes' CUDA kernels


def golden() -> tuple[dict, dict]:
    facts_path, arrays_path = fixture_paths(NF4_GOLDEN)
    if not (facts_path.is_file() and arrays_path.is_file()):
        pytest.skip(f"the NF4 golden fixture is not recorded yet: record it on the GPU machine with bitsandbytes "
                    f"installed, from the repository root: {RECORD_NF4_COMMAND}")
    facts = json.loads(facts_path.read_text(encoding="utf-8"))
    assert facts["device"] == "cuda", f"{GOLDEN / NF4_GOLDEN} was recorded on {facts['device']}: re-record on CUDA"
    with np.load(arrays_path) as arrays:
        return facts, dict(arrays)


def within_reach(values: np.ndarray, scales: np.ndarray, block: int, codes_of, theirs: np.ndarray) -> np.ndarray:
    """Which of their codes ours give with the reciprocal of the scale moved up to 2 ulps: the places where
    bitsandbytes' approximate reciprocal may have taken the other side of a decision boundary."""
    reach = np.zeros(theirs.shape, bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        reciprocal = (np.float32(1) / scales).astype(np.float32)
    for ulps in range(-2, 3):
        moved = np.repeat((reciprocal.view(np.int32) + ulps).view(np.float32), block)[:values.size]
        reach |= codes_of((values * moved).astype(np.float32))[:theirs.size] == theirs
    return reach


def nf4_codes_of(scaled: np.ndarray) -> np.ndarray:
    return np.searchsorted(nf4.NF4_THRESHOLDS, scaled, side="left")


@pytest.mark.parametrize("case", NF4_CASES)
def test_bitsandbytes_cuda_codes_and_values(case):
    """Our twin against bitsandbytes' CUDA kernels: the maps, the absmaxes and the dequantized values bit for
    bit; the 4-bit codes of bf16 weights bit for bit, of float32 ones but where bitsandbytes' approximate
    reciprocal may have crossed a boundary; the absmaxes' 8-bit codes on their offset likewise, and our
    offset within 2 ulps of theirs."""
    facts, arrays = golden()
    w = nf4_case_weights(case)
    assert facts["cases"][case]["sha256"] == sha256(w.astype(np.float32)), f"the case {case} changed; re-record"
    get = lambda key: arrays[f"{case}.{key}"]  # noqa: E731
    np.testing.assert_array_equal(get("nf4_levels"), nf4.NF4_LEVELS)
    np.testing.assert_array_equal(get("dynamic_map").view(np.uint32), nf4.DYNAMIC_MAP.view(np.uint32))
    absmax = nf4.block_absmax(w)
    np.testing.assert_array_equal(get("absmax").view(np.uint32), absmax.view(np.uint32))

    theirs = nf4.unpack(get("codes"), w.size + w.size % 2)
    ours = nf4.unpack(nf4.quantize(w).codes, w.size + w.size % 2)
    if w.dtype == BF16:
        np.testing.assert_array_equal(ours, theirs)
    else:
        differ = ours != theirs
        assert differ.mean() < 1e-3
        assert within_reach(w.astype(np.float32).reshape(-1), absmax, 64, nf4_codes_of, theirs)[differ].all()

    offset = get("offset")[0]
    assert abs(int(nf4.absmax_mean(absmax).view(np.int32)) - int(offset.view(np.int32))) <= 2
    codes, scales = nf4.quantize_absmax(absmax, offset)
    np.testing.assert_array_equal(scales.view(np.uint32), get("absmax_scales").view(np.uint32))
    differ = codes != get("absmax_codes")
    assert differ.mean() < 1e-2
    centered = (absmax - offset).astype(np.float32)
    reach = within_reach(centered, scales, 256, nf4.dynamic_codes, get("absmax_codes"))
    assert reach[differ].all()

    state = nf4.NF4Tensor(get("codes"), get("absmax_codes"), get("absmax_scales"), offset, w.shape)
    back = nf4.dequantize(state).astype(w.dtype)
    np.testing.assert_array_equal(back.view(get("dequantized").dtype), get("dequantized"))
