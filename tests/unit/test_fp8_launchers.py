"""The FP8 launchers' host side, without a GPU: the casts and the FP8 GEMM reject bad shapes, dtypes, alignment
and requests before launching anything (the arrays are descriptors of device memory that does not exist)."""

import numpy as np
import pytest

from llama import ops
from llama.runtime.cuda import BF16, FP8
from tests.unit.test_bf16_launchers import fake

F32, I32, U32 = np.float32, np.int32, np.uint32
R, C = 48, 32


def both(**changes):
    """Arguments of a cast to both layouts of x (R, C), with changes."""
    return dict(x=fake((R, C)), rows=fake((R, C), FP8), row_scales=fake((R,), F32), cols=fake((C, R), FP8),
                col_scales=fake((C,), F32), amax=fake((R + C,), U32)) | changes


@pytest.mark.parametrize("changes, message", [
    ({"x": fake((R, C), F32)}, "x: expected bfloat16 \\(48, 32\\)"),
    ({"x": fake((R * C,))}, "x: expected a 2D \\(R, C\\) or 3D"),
    ({"x": fake((0, C)), "rows": fake((0, C), FP8), "row_scales": fake((0,), F32), "cols": fake((C, 0), FP8)},
     "empty x"),
    ({"rows": None}, "give rows with row_scales"),
    ({"col_scales": None}, "give rows with row_scales and cols with col_scales"),
    ({"rows": None, "row_scales": None, "cols": None, "col_scales": None}, "no output requested"),
    ({"rows": fake((R, C))}, "rows: expected float8_e4m3fn \\(48, 32\\), got bfloat16"),
    ({"row_scales": fake((C,), F32)}, "row_scales: expected float32 \\(48,\\)"),
    ({"cols": fake((R, C), FP8)}, "cols: expected float8_e4m3fn \\(32, 48\\)"),
    ({"col_scales": fake((C,), BF16)}, "col_scales: expected float32"),
    ({"x": fake((R, C), offset=8)}, "x: must start 16-byte aligned"),
    ({"rows": fake((R, C), FP8, offset=8)}, "rows: must start 16-byte aligned"),
    ({"cols": fake((C, R), FP8, offset=4)}, "cols: must start 16-byte aligned"),
    ({"amax": fake((R + C - 1,), U32)}, "amax: needs 80 uint32 or int32, has 79"),
    ({"amax": fake((R + C,), F32)}, "amax: needs 80 uint32 or int32, has 80 float32"),
])
def test_cast_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        ops.cast_fp8(**both(**changes))


def test_a_ready_amax_must_be_given_and_row_wise():
    with pytest.raises(ValueError, match="amax_ready needs the amax it names and row-wise scaling"):
        ops.cast_fp8(**both(amax=None), amax_ready=True)
    with pytest.raises(ValueError, match="amax_ready needs the amax it names and row-wise scaling"):
        ops.cast_fp8(**both(), scaling="tensor", amax_ready=True)


def test_swiglu_backward_rejects_an_amax_too_small_or_not_uint32():
    grads = fake((R, 2 * C)), fake((R, C)), fake((R, 2 * C))
    with pytest.raises(ValueError, match="amax: needs 112 uint32, has 111 uint32"):
        ops.swiglu_backward_bf16(*grads, amax=fake((R + 2 * C - 1,), U32))
    with pytest.raises(ValueError, match="amax: needs 112 uint32, has 112 int32"):
        ops.swiglu_backward_bf16(*grads, amax=fake((R + 2 * C,), I32))


def test_cast_rejects_rows_that_vector_accesses_cannot_take():
    with pytest.raises(ValueError, match="x: needs C a multiple of 8"):
        ops.cast_fp8(fake((R, 20)), cols=fake((20, R), FP8), col_scales=fake((20,), F32), amax=fake((R + 20,), I32))
    with pytest.raises(ValueError, match="rows: needs C a multiple of 16 .*, got C = 24"):
        ops.cast_fp8(fake((R, 24)), fake((R, 24), FP8), fake((R,), F32), amax=fake((R + 24,), I32))
    with pytest.raises(ValueError, match="cols: needs R a multiple of 16 .*, got R = 40"):
        ops.cast_fp8(fake((40, C)), cols=fake((C, 40), FP8), col_scales=fake((C,), F32), amax=fake((40 + C,), I32))


def test_a_batch_of_sequences_is_cast_as_its_rows():
    """x (B, T, C) is cast as (B * T, C): the outputs are 2D."""
    with pytest.raises(ValueError, match="rows: expected float8_e4m3fn \\(48, 32\\), got .* \\(3, 16, 32\\)"):
        ops.cast_fp8(fake((3, 16, C)), fake((3, 16, C), FP8), fake((R,), F32))
    with pytest.raises(ValueError, match="col_scales: expected float32 \\(32,\\)"):
        ops.cast_fp8(fake((3, 16, C)), cols=fake((C, R), FP8), col_scales=fake((R,), F32))


@pytest.mark.parametrize("changes, message", [
    ({"a": fake((64, 48))}, "a: expected float8_e4m3fn \\(64, 48\\), got bfloat16"),
    ({"b": fake((48, 32), FP8)}, "b: expected float8_e4m3fn \\(32, 48\\)"),
    ({"a_scales": fake((32,), F32)}, "a_scales: expected float32 \\(64,\\)"),
    ({"b_scales": fake((32,), F32, offset=4)}, "b_scales: must start 16-byte aligned"),
    ({"a": fake((64, 40), FP8), "b": fake((32, 40), FP8)}, "a \\(64, 40\\) needs .* rows of a multiple of 16"),
    ({"c": fake((64, 32), FP8)}, "c must be bf16 or fp32"),
    ({"version": "mma"}, "unknown version 'mma' \\(wgmma6\\)"),
])
def test_gemm_fp8_rejects(changes, message):
    arguments = dict(c=fake((64, 32)), a=fake((64, 48), FP8), a_scales=fake((64,), F32), b=fake((32, 48), FP8),
                     b_scales=fake((32,), F32), version="wgmma6") | changes
    with pytest.raises(ValueError, match=message):
        ops.gemm_fp8(**arguments)
