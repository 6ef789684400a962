"""The FP8 GEMM (version 6 with e4m3 operands, FP8_GEMM_VERSIONS) against the float64 product of the same FP8 values
times their scales: the operands are cast on the host by the numpy twin (llama/twins/fp8.py's quantize_fp8), so
this tests the GEMM alone. Every epilogue, shapes at and off the tiles, a weight gradient over 16384 tokens; outputs
NaN-poisoned first. The ladder's FP8 version 5 (split-K inside the kernel) runs these same tests from
dev/cuda/test_gemm_ladder.py, through the fixtures `gemm_fp8` and `fp8_version`.

Tolerances (‖out − ref‖ / ‖ref‖): the products of FP8 values are exact, but Hopper's FP8 wgmma adds them into
its fp32 accumulators with fewer bits kept (about 14, as DeepSeek-V3's report measured on H800): measured
1e-4 at K = 128, 5e-4 at K = 912, 1.6e-3 (split-K) to 3.2e-3 at K = 16384, against ~1e-6 for bf16's wgmma.
So 5e-3 for every output, fp32 or bf16 (whose one rounding adds 2^-9 per element). Small next to the casts'
own rounding (3.7%, tests/unit/test_fp8.py)."""

import numpy as np
import pytest

from llama.ops.fp8 import FP8_GEMM_VERSIONS
from llama.runtime.cuda import BF16
from llama.twins.fp8 import dequantize_fp8, quantize_fp8
from llama.twins.rope import rotate_pairs
from tests.gpu_helpers import check, dev, dev_bf16, poisoned

pytestmark = pytest.mark.gpu
rng = np.random.default_rng()
TOL = 5e-3


@pytest.fixture(scope="module")
def ops():
    from llama import ops
    from llama.runtime.cuda import runtime
    if runtime().device.compute_capability() != (9, 0):
        pytest.skip("FP8 GEMMs need sm_90a")
    return ops


@pytest.fixture(params=list(FP8_GEMM_VERSIONS))
def fp8_version(request):
    return request.param


@pytest.fixture
def gemm_fp8(ops):
    """The FP8 GEMM front the tests run their versions through."""
    return ops.gemm_fp8


def fp8_operand(rows, K, spread=8.0):
    """A random (rows, K) operand with rows of different magnitudes, cast by the twin: (FP8 device array,
    scales device array, the dequantized values in float64)."""
    from llama.runtime.cuda import to_device
    x = rng.standard_normal((rows, K)) * np.exp(rng.uniform(-spread, spread, (rows, 1)))
    q, scales = quantize_fp8(x.astype(np.float32))
    return to_device(q), dev(scales), dequantize_fp8(q, scales).astype(np.float64)


# (M, N, K): a tile and a k-block of 128 values exactly; odd M and N (rows of c a multiple of 8) and K not a
# multiple of 128; many tiles per persistent CTA; the head's width; a weight gradient over 16384 tokens
SHAPES = [(128, 256, 128), (17, 136, 80), (1000, 136, 784), (2000, 2056, 912), (33, 128256, 64), (768, 768, 16384)]


@pytest.mark.parametrize("M, N, K", SHAPES)
@pytest.mark.parametrize("out", ["bf16", "f32", "acc_f32"])
def test_gemm_fp8(gemm_fp8, fp8_version, M, N, K, out):
    (a, sa, a64), (b, sb, b64) = fp8_operand(M, K), fp8_operand(N, K)
    expected = 0.5 * a64 @ b64.T
    if out in ("bf16", "f32"):
        c = poisoned((M, N), BF16 if out == "bf16" else np.float32)
    else:
        start = rng.standard_normal((M, N))
        c, expected = dev(start), expected + start.astype(np.float32)
    gemm_fp8(c, a, sa, b, sb, alpha=0.5, accumulate=out == "acc_f32", version=fp8_version)
    check(f"gemm_fp8 {fp8_version} {out} {M}x{N}x{K}", c, expected, TOL)


def test_gemm_fp8_rope_epilogue(gemm_fp8, fp8_version):
    """The QKV projection's epilogue on FP8 operands: the scaled product, then RoPE on the first columns."""
    B, T, D, n_heads, rotated = 2, 40, 64, 5, 3  # 3 of 5 heads rotated (q and k), v plain
    M, N, K = B * T, n_heads * D, 192
    (a, sa, a64), (b, sb, b64) = fp8_operand(M, K), fp8_operand(N, K)
    angles = rng.uniform(0, 2 * np.pi, (T + 3, D // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    heads = (a64 @ b64.T).reshape(B, T, n_heads, D).transpose(0, 2, 1, 3)
    turned = rotate_pairs(heads[:, :rotated], cos[:T].astype(np.float64), sin[:T].astype(np.float64))
    expected = np.concatenate([turned, heads[:, rotated:]], axis=1).transpose(0, 2, 1, 3).reshape(M, N)
    c = poisoned((M, N), BF16)
    gemm_fp8(c, a, sa, b, sb, rope=(dev(cos), dev(sin), T, rotated * D), version=fp8_version)
    check(f"gemm_fp8 {fp8_version} rope", c, expected, TOL)


def test_gemm_fp8_is_deterministic(gemm_fp8, fp8_version):
    """A weight gradient (where a version splits K, its partials summed in a fixed order): the same bits twice."""
    (a, sa, _), (b, sb, _) = fp8_operand(256, 16384), fp8_operand(512, 16384)
    outputs = []
    for _ in range(2):
        c = dev(np.zeros((256, 512)))
        gemm_fp8(c, a, sa, b, sb, accumulate=True, version=fp8_version)
        outputs.append(c.download())
    np.testing.assert_array_equal(*outputs)


def test_gemm_fp8_rejects_bf16_operands_and_other_versions(ops):
    (a, sa, _), (b, sb, _) = fp8_operand(64, 64), fp8_operand(64, 64)
    c = poisoned((64, 64))
    with pytest.raises(ValueError, match="a: expected float8_e4m3fn"):
        ops.gemm_fp8(c, dev_bf16(np.zeros((64, 64))), sa, b, sb, version="wgmma6")
    with pytest.raises(ValueError, match="unknown version 'mma'"):
        ops.gemm_fp8(c, a, sa, b, sb, version="mma")
