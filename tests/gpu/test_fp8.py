"""The FP8 casts (kernels/fp8.cu) against llama/twins/fp8.py's quantize_fp8 of the same bf16 inputs,
bit for bit (values and scales): both layouts, the row-wise cast in one pass and in two, shapes that are not
multiples of the tiles, rows and columns of wildly different magnitudes, of zeros and of denormals, amax at
the scales' boundaries, ties, NaN-poisoned outputs, a reused amax scratch, reruns and a CUDA-graph replay that
give the same bits; and the tensor-wise casts (one scale for all of x) the same way."""

import numpy as np
import pytest

from llama.runtime.cuda import BF16, FP8
from llama.twins.fp8 import quantize_fp8
from tests.gpu_helpers import dev, dev_bf16, poisoned

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(448)
E4M3 = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(FP8).astype(np.float64)))
E4M3 = E4M3[np.isfinite(E4M3)]  # 0 .. 448
TIES = (E4M3[1:] + E4M3[:-1]) / 2  # halfway between neighbours: to the even one


def outputs(R, C, rows=True, cols=True) -> dict:
    """NaN-poisoned outputs of a cast of x (R, C), as requested (0x7F is NaN in e4m3fn)."""
    return (dict(rows=poisoned((R, C), FP8), row_scales=poisoned((R,))) if rows else {}) | (
        dict(cols=poisoned((C, R), FP8), col_scales=poisoned((C,))) if cols else {})


def cast(x: np.ndarray, rows=True, cols=True, amax=None, scaling="row") -> dict:
    """ops.cast_fp8 of the bf16 x: each requested output downloaded."""
    from llama import ops
    out = outputs(*x.reshape(-1, x.shape[-1]).shape, rows, cols)
    ops.cast_fp8(dev_bf16(x), **out, amax=amax, scaling=scaling)
    return {name: array.download() for name, array in out.items()}


def bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 4: np.uint32}[a.dtype.itemsize])


def assert_twin(x: np.ndarray, got: dict, scaling="row") -> None:
    """got holds quantize_fp8's bits of x (bf16, taken as (rows, C)) for each layout it has."""
    exact = x.reshape(-1, x.shape[-1]).astype(np.float32)
    expected = {}
    if "rows" in got:
        expected["rows"], expected["row_scales"] = quantize_fp8(exact, -1, scaling)
    if "cols" in got:
        values, expected["col_scales"] = quantize_fp8(exact, 0, scaling)
        expected["cols"] = np.ascontiguousarray(values.T)
    for name, array in got.items():
        assert array.shape == expected[name].shape, name
        np.testing.assert_array_equal(bits(array), bits(expected[name]), err_msg=name)


def wild(R: int, C: int) -> np.ndarray:
    """Normal values with each row scaled by e^uniform(-30, 30) and each column by e^uniform(-10, 10),
    then one row and one column of zeros, in bf16."""
    x = rng.standard_normal((R, C)) * np.exp(rng.uniform(-30, 30, (R, 1))) * np.exp(rng.uniform(-10, 10, (1, C)))
    x[rng.integers(R)] = 0
    x[:, rng.integers(C)] = 0
    return x.astype(BF16)


@pytest.mark.parametrize("R, C, layouts", [
    (16, 16, "both"), (1000, 784, "rows"), (48, 8192, "both"), (16384, 768, "both"), (33 * 16, 48, "both"),
    (33 * 16, 48, "rows"), (33 * 16, 48, "cols"), (80, 24, "cols"), (64, 64, "both"), (130, 208, "rows"),
])
def test_cast_is_the_twin_bit_for_bit(R, C, layouts):
    x = wild(R, C)
    rows, cols = layouts in ("rows", "both"), layouts in ("cols", "both")
    got = cast(x, rows, cols)
    assert_twin(x, got)
    again = cast(x, rows, cols)
    for name in got:
        np.testing.assert_array_equal(bits(again[name]), bits(got[name]), err_msg=f"rerun {name}")



@pytest.mark.parametrize("R, C", [(3, 16), (37, 2048), (24, 2064), (9, 4096), (40, 4112), (17, 8192), (5, 14336),
                                  (6, 16384), (4, 16400)])
def test_one_pass_row_cast_is_the_two_pass_one_and_the_twin(R, C):
    """The row-wise cast alone runs in one pass (fp8_cast_rows_<V>, V = 1 up to 8 vectors a thread, each at the
    widest rows it takes and past them), or in two past 16,384 columns: the twin's bits, and the two passes'
    on the same x."""
    from llama.ops.fp8 import ROW_COLUMNS, ROW_VECTORS, cast_rows_one_pass, cast_two_passes
    x = wild(R, C)
    assert_twin(x, cast(x, cols=False))
    if C > ROW_VECTORS * ROW_COLUMNS:
        return
    one, two = outputs(R, C, cols=False), outputs(R, C, cols=False)
    cast_rows_one_pass(dev_bf16(x), **one)
    cast_two_passes(dev_bf16(x), **two, cols=None, col_scales=None, amax=None, scaling="row")
    for name in one:
        np.testing.assert_array_equal(bits(one[name].download()), bits(two[name].download()), err_msg=name)


@pytest.mark.parametrize("N, F, layouts", [(48, 104, "both"), (1008, 1032, "both"), (64, 256, "rows"), (80, 24, "cols")])
def test_cast_from_swiglu_backwards_amax_is_the_twin(N, F, layouts):
    """gate+up's gradient cast from the maxima SwiGLU's backward wrote with it (amax_ready: no amax pass) is
    the twin's cast of that gradient, bit for bit."""
    from llama import ops
    from llama.runtime.cuda import to_device
    gate_up = (rng.standard_normal((N, 2 * F)) * 2).astype(BF16)
    dout = wild(N, F)
    dgate_up, amax = dev_bf16(gate_up), to_device(np.full(N + 2 * F, 7, np.uint32))
    ops.swiglu_backward_bf16(dgate_up, dev_bf16(dout), dgate_up, amax=amax)
    rows, cols = layouts in ("rows", "both"), layouts in ("cols", "both")
    out = outputs(N, 2 * F, rows, cols)
    ops.cast_fp8(dgate_up, **out, amax=amax, amax_ready=True)
    assert_twin(dgate_up.download(), {name: array.download() for name, array in out.items()})

@pytest.mark.parametrize("R, C, layouts", [
    (16, 16, "both"), (1000, 784, "rows"), (16384, 768, "both"), (33 * 16, 48, "cols"), (130, 208, "rows"),
])
def test_tensor_wise_cast_is_the_twin_bit_for_bit(R, C, layouts):
    """Each amax of the scales' boundaries as the tensor's, then rows and columns of wild magnitudes (most of
    whose values underflow to zero or to e4m3's denormals under one scale), then all zeros."""
    rows, cols = layouts in ("rows", "both"), layouts in ("cols", "both")
    for amax in (448 * 2.0 ** -3, 450 * 2.0 ** 5, 2.0 ** -130):  # bf16-exact: a boundary, just above one, a denormal
        x = (rng.uniform(-1, 1, (R, C)) * amax).astype(BF16)
        x[rng.integers(R), rng.integers(C)] = amax
        assert_twin(x, cast(x, rows, cols, scaling="tensor"), "tensor")
    x = wild(R, C)
    got = cast(x, rows, cols, scaling="tensor")
    assert_twin(x, got, "tensor")
    for name in ("row_scales", "col_scales"):
        if name in got:
            assert len(set(got[name].tolist())) == 1, name
    zeros = np.zeros((R, C), BF16)
    assert_twin(zeros, cast(zeros, rows, cols, scaling="tensor"), "tensor")


def test_every_scale_boundary_and_denormals_in_both_layouts():
    """Slices whose amax (either sign) is each bf16 exponent with mantissa 1, 1.75 (448 * 2^k) and the
    bf16 values either side of both, the largest mantissa, denormals included; the rest of each slice
    is random below its amax."""
    exponents, mantissas = np.arange(255, dtype=np.uint16), np.uint16([0, 1, 0x5F, 0x60, 0x61, 0x7F])
    amax = ((exponents[:, None] << 7) | mantissas).ravel().view(BF16).astype(np.float64)
    amax = np.concatenate([amax[amax > 0], [0.0] * (-(amax > 0).sum() % 16)])  # whole 16s of slices
    x = rng.uniform(-1, 1, (amax.size, 64)) * amax[:, None]
    x[:, 0] = amax * rng.choice([-1, 1], amax.size)
    x = x.astype(BF16)
    assert_twin(x, cast(x, cols=False))
    xt = np.ascontiguousarray(x.T)
    assert_twin(xt, cast(xt, rows=False))


def test_ties_round_to_even_at_every_scale():
    """Every midpoint between neighbouring e4m3 values (either sign) beside 448, times 2^k: each slice's
    scale is 2^k and each value a tie."""
    row = np.concatenate([[448.0], TIES, -TIES])
    row = np.concatenate([row, np.zeros(-row.size % 16)])
    x = (row[None, :] * np.exp2(np.arange(-120, 120, 5))[:, None]).astype(BF16)
    assert (x.astype(np.float64) == row * np.exp2(np.arange(-120, 120, 5))[:, None]).all()  # exact in bf16
    assert_twin(x, cast(x, cols=False))
    xt = np.ascontiguousarray(x.T)
    assert_twin(xt, cast(xt, rows=False))


def test_a_reused_amax_scratch_starts_from_zero():
    big, small = (rng.standard_normal((64, 96)) * 1e6).astype(BF16), rng.standard_normal((64, 96)).astype(BF16)
    for amax in (None, dev(np.full(64 + 96 + 5, -1, dtype=np.int32))):  # the module's workspace, or a dirty one
        cast(big, amax=amax)
        assert_twin(small, cast(small, amax=amax))


def test_a_batch_of_sequences_is_cast_as_its_rows():
    x = wild(2 * 24, 48).reshape(2, 24, 48)
    assert_twin(x, cast(x))


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_graph_replay_casts_the_new_input(scaling):
    from llama import ops
    from llama.runtime.cuda import Graph
    R, C = 256, 320
    x, out = dev_bf16(wild(R, C)), outputs(R, C)
    ops.cast_fp8(x, **out, scaling=scaling)  # compiled and its workspace allocated before the capture
    graph = Graph(lambda: ops.cast_fp8(x, **out, scaling=scaling))
    for _ in range(2):
        host = wild(R, C)
        x.upload(host)
        graph.replay()
        assert_twin(host, {name: array.download() for name, array in out.items()}, scaling)
