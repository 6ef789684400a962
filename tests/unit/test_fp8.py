"""The FP8 twins (llama/twins/fp8.py): float8 e4m3 casts with power-of-two scales per slice along a
GEMM's K axis, and the FP8 linear layer's forward and backward built from them. The kernels of --dtype fp8
are tested against these."""

import ml_dtypes
import numpy as np
import pytest

from llama.twins.fp8 import E4M3_MAX, dequantize_fp8, matmul_fp8_backward, matmul_fp8_forward, quantize_fp8
from llama.twins.matmul import matmul_backward, matmul_forward
from llama.run.plan import cpu_plan

E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
E4M3 = np.unique(E4M3[np.isfinite(E4M3)])  # every finite value, -448 .. 448
# e4m3 keeps 3 mantissa bits: a value rounds by at most 1/16 of its binade, so a product of two cast operands
# over random data comes out about 3.7% off the float64 one (measured 0.0371-0.0392 on the shapes below)
FP8_PRODUCT_TOLERANCE = 0.05


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("shape, axis", [((7, 300), -1), ((300, 7), 0), ((4, 5, 33), -1)])
def test_each_slice_gets_a_power_of_two_scale_and_the_nearest_e4m3_values(shape, axis):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-12, 12, shape[:-1] + (1,)))).astype(np.float32)
    q, scale = quantize_fp8(x, axis)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == x.shape and scale.dtype == np.float32
    assert scale.shape == tuple(n for i, n in enumerate(shape) if i != axis % len(shape))
    assert np.all(np.exp2(np.round(np.log2(scale))) == scale)  # powers of two
    top = np.max(np.abs(q.astype(np.float64)), axis=axis)
    assert np.all((224 <= top) & (top <= E4M3_MAX))  # the largest value of a slice lands in the top binade
    scaled = x.astype(np.float64) / np.expand_dims(scale, axis)  # exact: the scale is a power of two
    distance = np.abs(scaled[..., None] - E4M3).min(axis=-1)
    np.testing.assert_array_equal(np.abs(q.astype(np.float64) - scaled), distance)  # the nearest value


def test_the_scale_is_the_least_power_of_two_that_fits_even_at_the_boundaries():
    x = np.float32(448.0) * np.exp2(np.arange(-20, 20, dtype=np.float32))[:, None]  # amax exactly 448 * 2^k
    x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(0))], axis=1)
    for column, shift in ((0, 0), (1, 1), (2, 0)):  # at the boundary, just above it, just below it
        _, scale = quantize_fp8(x[:, column:column + 1])
        np.testing.assert_array_equal(scale, np.exp2(np.arange(-20, 20) + shift).astype(np.float32))


def test_zero_rows_tiny_values_and_ties():
    x = np.zeros((3, 16), np.float32)
    x[1] = [448 * 2.0 ** -20, 1e-30] + [0] * 14  # 1e-30 is far below the smallest e4m3 step of its row: 0
    x[2, :3] = [448.0, 464.0, 17.0]  # 464 needs scale 2; 232 and 8.5 are ties: to the even mantissa
    q, scale = quantize_fp8(x)
    assert scale[0] == 1 and not q[0].astype(np.float32).any()
    assert scale[1] == 2.0 ** -20 and q[1, 0] == 448 and q[1, 1] == 0
    assert scale[2] == 2 and list(q[2, :3].astype(np.float32)) == [224, 224, 8]
    np.testing.assert_array_equal(dequantize_fp8(q, scale)[2, :3], [448, 448, 16])


@pytest.mark.parametrize("shape, axis", [((7, 300), -1), ((300, 7), 0), ((4, 5, 33), -1)])
def test_tensor_wise_scaling_gives_every_slice_the_scale_of_the_whole_tensor(shape, axis):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-12, 12, shape[:-1] + (1,)))).astype(np.float32)
    q, scale = quantize_fp8(x, axis, "tensor")
    _, whole = quantize_fp8(x.reshape(1, -1))  # the one slice of all of x
    assert scale.shape == tuple(n for i, n in enumerate(shape) if i != axis % len(shape))
    assert np.all(scale == whole[0])
    scaled = x.astype(np.float64) / whole[0]
    distance = np.abs(scaled[..., None] - E4M3).min(axis=-1)
    np.testing.assert_array_equal(np.abs(q.astype(np.float64) - scaled), distance)  # the nearest value
    assert np.max(np.abs(q.astype(np.float64))) >= 224  # the largest value of x lands in the top binade
    with pytest.raises(ValueError, match="scaling 'column': choose from row, tensor"):
        quantize_fp8(x, axis, "column")


def test_tensor_wise_scaling_loses_the_rows_that_are_small():
    """Rows 2^-18 apart in magnitude: row-wise, each keeps FP8's few percent; tensor-wise, the small rows fall
    below e4m3's smallest step (2^-9 of the top's scale): almost all their values become zero."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((8, 64)) * np.exp2([[0], [-18]] * 4)).astype(np.float32)
    small = slice(1, None, 2)
    errors = {scaling: rel(dequantize_fp8(*quantize_fp8(x, -1, scaling))[small], x[small]) for scaling in ("row", "tensor")}
    assert errors["row"] < 0.05 and errors["tensor"] > 0.8, errors  # measured 0.027 and 0.93


@pytest.mark.parametrize("M, K, N", [(64, 256, 96), (33, 100, 17), (5, 1024, 48)])
def test_fp8_linear_layer_against_float64(M, K, N):
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (0.02 * rng.standard_normal((N, K))).astype(np.float32)
    dout = rng.standard_normal((M, N)).astype(np.float32)
    out = matmul_fp8_forward(x, w)
    dx, dw = matmul_fp8_backward(dout, x, w)
    exact = [x.astype(np.float64), w.astype(np.float64)]
    ref_dx, ref_dw = matmul_backward(dout.astype(np.float64), *exact)
    errors = rel(out, matmul_forward(*exact)), rel(dx, ref_dx), rel(dw, ref_dw)
    assert all(0.01 < e < FP8_PRODUCT_TOLERANCE for e in errors), errors  # FP8's rounding, no more
    xq = dequantize_fp8(*quantize_fp8(x)).astype(np.float64)
    wq = dequantize_fp8(*quantize_fp8(w)).astype(np.float64)
    np.testing.assert_allclose(out, xq @ wq.T, rtol=1e-12)  # exactly the product of the casts
    out_t = matmul_fp8_forward(x, w, "tensor")
    xq, wq = (dequantize_fp8(*quantize_fp8(a, -1, "tensor")).astype(np.float64) for a in (x, w))
    np.testing.assert_allclose(out_t, xq @ wq.T, rtol=1e-12)
    dx_t, dw_t = matmul_fp8_backward(dout, x, w, "tensor")
    tensor_errors = rel(out_t, matmul_forward(*exact)), rel(dx_t, ref_dx), rel(dw_t, ref_dw)
    assert all(0.01 < e < FP8_PRODUCT_TOLERANCE for e in tensor_errors), tensor_errors  # one magnitude: as good


def test_the_fp8_reference_model_casts_only_its_blocks_linear_layers():
    """The reference planned with dtype fp8 (row-wise scales), the twin of --dtype fp8: the same model as the plain one up to the casts' rounding;
    with the casts' values already exact (weights and activations that are FP8 values times their scales) it
    would be the plain model, so here the casts are what moves the loss and gradients, by a few percent."""
    from llama.config import get_preset
    from llama.model.reference import ReferenceModel
    config = get_preset("tiny").replace(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=96, max_seq_len=32)
    rng = np.random.default_rng(3)
    tokens, targets = rng.integers(0, 96, (2, 32)), rng.integers(0, 96, (2, 32))
    plain, fp8, tensor = (ReferenceModel(config, cpu_plan(**options), dtype=np.float64, seed=1)
                          for options in ({}, {"dtype": "fp8"}, {"dtype": "fp8", "fp8_scaling": "tensor"}))
    losses = [model.forward(tokens, targets) for model in (plain, fp8, tensor)]
    for model in (plain, fp8, tensor):
        model.backward()
    assert losses[0] != losses[1] and abs(losses[1] - losses[0]) < 1e-2 * losses[0]
    errors = {name: rel(fp8.grads[t.offset:t.offset + t.size], plain.grads[t.offset:t.offset + t.size])
              for name, t in plain.layout.tensors.items()}
    assert 0 < max(errors.values()) < 0.15, errors  # measured 0.082 (a norm weight), the matrices 0.05-0.074
    assert all(err > 0 for name, err in errors.items() if "layers" in name), errors  # every block's weights see FP8
    # tensor-wise: other casts (one scale per operand), as close to the plain model on these even magnitudes
    assert losses[2] not in losses[:2] and abs(losses[2] - losses[0]) < 1e-2 * losses[0]
    tensor_errors = {name: rel(tensor.grads[t.offset:t.offset + t.size], plain.grads[t.offset:t.offset + t.size])
                     for name, t in plain.layout.tensors.items()}
    assert 0 < max(tensor_errors.values()) < 0.15, tensor_errors
    assert not np.array_equal(tensor.grads, fp8.grads)
    with pytest.raises(ValueError, match="--fp8-scaling column: choose from row, tensor"):
        ReferenceModel(config, cpu_plan(dtype="fp8", fp8_scaling="column"))
