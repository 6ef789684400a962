"""NF4's kernels (kernels/nf4.cu, llama/ops/nf4.py) against their twin (llama/twins/nf4.py): the codes, absmaxes,
offset, absmax codes and scales bit for bit (outputs poisoned twice, with different bytes, so that an unwritten
one fails), and the dequantized bf16 weights bit for bit, on shapes off the 64-weight blocks and the 256-absmax
blocks, with blocks of zeros and of subnormals; and, where torch and bitsandbytes are installed, against
bitsandbytes' own CUDA kernels."""

import ml_dtypes
import numpy as np
import pytest

from llama import ops
from llama.twins import nf4
from tests.gpu_helpers import ERRORS, bits, check, dev_bf16, poisoned_bf16

pytestmark = pytest.mark.gpu
SHAPES = [(1, 1), (1, 7), (3, 63), (64, 128), (77, 33), (300, 96), (257, 4100), (1024, 1024)]


def weights(shape, dtype, seed: int) -> np.ndarray:
    """Normal weights, rows scaled e^-6 .. e^6, a block of zeros and one of subnormals where there are 8 blocks."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (shape[0], 1)))
    flat = w.reshape(-1)
    if flat.size >= 8 * 64:
        flat[2 * 64:3 * 64] = 0.0
        flat[5 * 64:6 * 64] = rng.standard_normal(64) * 4e-39
    return w.astype(ml_dtypes.bfloat16 if dtype == "bf16" else np.float32)


def device_state(shape, poison: int):
    """Device outputs for an NF4 state of shape, every byte `poison`."""
    from llama.runtime.cuda import to_device
    sizes = ops.nf4_sizes(shape)
    fill = lambda size, dtype: to_device(np.full(size, poison, np.uint8).view(dtype))  # noqa: E731
    return dict(codes=fill(sizes["codes"][0], np.uint8), absmax=fill(4 * sizes["absmax"][0], np.float32),
                absmax_codes=fill(sizes["absmax"][0], np.uint8),
                absmax_scales=fill(4 * sizes["absmax_scales"][0], np.float32), offset=fill(4, np.float32))


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_gives_the_twins_bits(shape, dtype):
    from llama.runtime.cuda import to_device
    w = weights(shape, dtype, seed=shape[0] * 7 + shape[1])
    q = nf4.quantize(w)
    absmax = nf4.block_absmax(w)
    tables = to_device(ops.nf4_tables())
    w_dev = to_device(w)
    for poison in (0x5A, 0xA5):
        state = device_state(shape, poison)
        ops.nf4_quantize(weights=w_dev, tables=tables, **state)
        np.testing.assert_array_equal(bits(state["codes"]), q.codes)
        np.testing.assert_array_equal(bits(state["absmax"]), absmax.view(np.uint32))
        np.testing.assert_array_equal(bits(state["offset"]), np.float32(q.offset).reshape(1).view(np.uint32))
        np.testing.assert_array_equal(bits(state["absmax_codes"]), q.absmax_codes)
        np.testing.assert_array_equal(bits(state["absmax_scales"]), q.absmax_scales.view(np.uint32))


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_gives_the_twins_bits(shape):
    """Into a NaN-poisoned bf16 output: the twin's float32 values rounded to bf16, bit for bit; the error against
    the float64 twin is only that rounding."""
    from llama.runtime.cuda import to_device
    w = weights(shape, "bf16", seed=shape[0] * 5 + shape[1])
    q = nf4.quantize(w)
    expected = nf4.dequantize(q)
    out = poisoned_bf16(shape)
    ops.nf4_dequantize_bf16(out, to_device(q.codes), to_device(q.absmax_codes), to_device(q.absmax_scales),
                            to_device(np.float32(q.offset).reshape(1)), to_device(ops.nf4_tables()))
    np.testing.assert_array_equal(bits(out), expected.astype(ml_dtypes.bfloat16).view(np.uint16))
    check("nf4_dequantize_bf16", out, expected.astype(np.float64), tol=2 ** -8)


def test_a_quantized_layer_round_trips_on_the_device():
    """Quantize on the device, dequantize from its outputs: the twin's weights, and their error against the
    original weights is NF4's (about 0.1 of normal weights)."""
    w = weights((512, 2048), "bf16", seed=11)
    from llama.runtime.cuda import to_device
    tables, state = to_device(ops.nf4_tables()), device_state(w.shape, 0)
    ops.nf4_quantize(weights=dev_bf16(w), tables=tables, **state)
    out = poisoned_bf16(w.shape)
    ops.nf4_dequantize_bf16(out, state["codes"], state["absmax_codes"], state["absmax_scales"], state["offset"],
                            tables)
    expected = nf4.dequantize(nf4.quantize(w)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bits(out), expected.view(np.uint16))
    err = np.linalg.norm(out.download().astype(np.float64) - w.astype(np.float64)) / np.linalg.norm(w.astype(np.float64))
    ERRORS.append(("nf4 round trip vs the weights (quantization error)", float(err)))
    assert 0.05 < err < 0.15


@pytest.mark.parametrize("shape", [(64, 128), (77, 33), (300, 96), (1024, 1024), (4096, 4100)])
def test_bitsandbytes_cuda_kernels(shape):
    """Where torch and bitsandbytes are installed (a carried wheel): bitsandbytes' quantize_4bit (nf4, double
    quantization) of bf16 weights gives our kernel's codes and absmaxes bit for bit, its absmax codes ours on its
    offset but where its approximate reciprocal may cross a boundary (tests/unit/test_nf4.py's reach), and our
    dequantize kernel gives dequantize_4bit's bf16 weights bit for bit from its state."""
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    from llama.runtime.cuda import to_device
    from tests.unit.test_nf4 import within_reach

    w = weights(shape, "bf16", seed=3)
    t = torch.from_numpy(w.view(np.int16).copy()).view(torch.bfloat16).cuda()
    packed, qs = functional.quantize_4bit(t, blocksize=64, quant_type="nf4", compress_statistics=True)
    theirs = dict(codes=packed.cpu().numpy().reshape(-1), absmax_codes=qs.absmax.cpu().numpy(),
                  absmax_scales=qs.state2.absmax.cpu().numpy(), offset=np.float32(qs.offset.item()).reshape(1))
    tables, state = to_device(ops.nf4_tables()), device_state(shape, 0)
    ops.nf4_quantize(weights=dev_bf16(w), tables=tables, **state)
    np.testing.assert_array_equal(bits(state["codes"]), theirs["codes"])
    absmax = state["absmax"].download()
    codes, scales = nf4.quantize_absmax(absmax, theirs["offset"][0])
    np.testing.assert_array_equal(scales, theirs["absmax_scales"])
    differ = codes != theirs["absmax_codes"]
    centered = (absmax - theirs["offset"][0]).astype(np.float32)
    assert within_reach(centered, scales, 256, nf4.dynamic_codes, theirs["absmax_codes"])[differ].all()
    ERRORS.append(("nf4 absmax codes differing from bitsandbytes (fraction)", float(differ.mean())))
    out = poisoned_bf16(shape)
    ops.nf4_dequantize_bf16(out, *(to_device(theirs[k]) for k in ("codes", "absmax_codes", "absmax_scales", "offset")),
                            tables)
    expected = functional.dequantize_4bit(packed, qs).view(torch.int16).cpu().numpy().view(np.uint16)
    np.testing.assert_array_equal(bits(out), expected.reshape(shape))
