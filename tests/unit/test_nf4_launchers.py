"""NF4's launchers (llama/ops/nf4.py) without a GPU: they reject bad shapes, dtypes and alignment before launching,
launch the kernels over the whole tensor, and hand the kernels the twin's tables."""

import importlib

import numpy as np
import pytest

from llama import ops
from llama.runtime.cuda import BF16
from llama.twins import nf4
from tests.unit.test_bf16_launchers import fake

F32, U8 = np.float32, np.uint8
nf4_ops = importlib.import_module("llama.ops.nf4")


def state(shape, **changed):
    """The device arrays of an NF4 state of shape (descriptors only), with some replaced."""
    sizes = ops.nf4_sizes(shape)
    arrays = dict(codes=fake(sizes["codes"], U8), absmax_codes=fake(sizes["absmax"], U8),
                  absmax_scales=fake(sizes["absmax_scales"], F32), offset=fake((1,), F32),
                  tables=fake((nf4_ops.TABLE_SIZE,), F32))
    return arrays | changed


@pytest.mark.parametrize("shape, codes, absmaxes, scales", [((64, 128), 4096, 128, 1), ((77, 33), 1271, 40, 1),
                                                            ((1,), 1, 1, 1), ((4096, 4100), 8396800, 262400, 1025)])
def test_sizes(shape, codes, absmaxes, scales):
    assert ops.nf4_sizes(shape) == {"codes": (codes,), "absmax": (absmaxes,), "absmax_scales": (scales,)}
    q = nf4.quantize(np.ones(shape, np.float32)) if np.prod(shape) < 10 ** 5 else None
    if q is not None:
        assert (q.codes.shape, q.absmax_codes.shape, q.absmax_scales.shape) == ((codes,), (absmaxes,), (scales,))


def test_the_tables_are_the_twins():
    tables = ops.nf4_tables()
    assert tables.dtype == np.float32 and tables.shape == (nf4_ops.TABLE_SIZE,)
    np.testing.assert_array_equal(tables[:16], nf4.NF4_LEVELS)
    np.testing.assert_array_equal(tables[16:], nf4.DYNAMIC_MAP)


def test_quantize_rejects():
    shape = (77, 33)
    absmax = fake(ops.nf4_sizes(shape)["absmax"], F32)
    with pytest.raises(ValueError, match="weights: expected bfloat16 or float32, got float16"):
        ops.nf4_quantize(absmax=absmax, weights=fake(shape, np.float16), **state(shape))
    for name, bad, message in (("codes", fake((1272,), U8), r"codes: expected uint8 \(1271,\)"),
                               ("absmax_codes", fake((40,), F32), r"absmax_codes: expected uint8 \(40,\)"),
                               ("absmax_scales", fake((2,), F32), r"absmax_scales: expected float32 \(1,\)"),
                               ("offset", fake((), F32), r"offset: expected float32 \(1,\)"),
                               ("tables", fake((256,), F32), r"tables: expected float32 \(272,\)"),
                               ("codes", fake((1271,), U8, 4), "codes: must start 16-byte aligned")):
        with pytest.raises(ValueError, match=message):
            ops.nf4_quantize(absmax=absmax, weights=fake(shape), **state(shape, **{name: bad}))
    with pytest.raises(ValueError, match=r"absmax: expected float32 \(40,\)"):
        ops.nf4_quantize(absmax=fake((40,), BF16), weights=fake(shape), **state(shape))
    with pytest.raises(ValueError, match="weights: must start 16-byte aligned"):
        ops.nf4_quantize(absmax=absmax, weights=fake(shape, F32, 8), **state(shape))


def test_dequantize_rejects():
    shape = (300, 96)
    with pytest.raises(ValueError, match="out: expected bfloat16"):
        ops.nf4_dequantize_bf16(fake(shape, F32), **state(shape))
    with pytest.raises(ValueError, match=r"codes: expected uint8 \(14550,\), got uint8 \(14400,\)"):
        ops.nf4_dequantize_bf16(fake((300, 97)), **state(shape))
    with pytest.raises(ValueError, match="out: must start 16-byte aligned"):
        ops.nf4_dequantize_bf16(fake(shape, BF16, 2), **state(shape))


@pytest.mark.parametrize("dtype, entry", [(BF16, "nf4_quantize_bf16"), (F32, "nf4_quantize_f32")])
def test_the_launches_cover_the_tensor(monkeypatch, dtype, entry):
    """Quantize: a thread per 8 weights, one block for the mean, a block per 256 absmaxes; dequantize: a thread per
    32 weights; each given n (or the absmax count) and the arrays in the kernels' order."""
    launches = []
    monkeypatch.setattr(nf4_ops, "kernel", lambda module, name, signature: (
        lambda grid, block, *args: launches.append((module, name, signature, grid, block, args))))
    shape = (1000, 777)  # 777000 weights, 12141 absmaxes
    arrays = state(shape)
    absmax, weights = fake((12141,), F32), fake(shape, dtype)
    ops.nf4_quantize(absmax=absmax, weights=weights, **arrays)
    ops.nf4_dequantize_bf16(fake(shape), **arrays)
    (m1, name1, sig1, grid1, block1, args1), (_, name2, _, grid2, block2, args2), \
        (_, name3, _, grid3, block3, args3), (_, name4, _, grid4, block4, args4) = launches
    assert m1 == "nf4" and (name1, name2, name3, name4) == (entry, "nf4_absmax_mean", "nf4_quantize_absmax",
                                                             "nf4_dequantize_bf16")
    assert grid1 == (-(-777000 // 8 // 256),) and block1 == 256 and args1[-1] == 777000 and len(sig1) == len(args1)
    assert args1[:4] == (arrays["codes"].ptr, absmax.ptr, weights.ptr, arrays["tables"].ptr)
    assert grid2 == (1,) and args2 == (arrays["offset"].ptr, absmax.ptr, 12141)
    assert grid3 == (48,) and block3 == 256 and args3[-1] == 12141
    assert grid4 == (-(-777000 // 32 // 256),) and args4[-1] == 777000
