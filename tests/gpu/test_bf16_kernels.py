"""The bf16 mixed-precision kernels against the float64 twins of llama/model/reference.py (a fused kernel
against the composition of the unfused twins), on the same bf16-rounded inputs: NaN-poisoned
outputs, shapes that are not multiples of the blocks, and bit-identical reruns of the deterministic
reductions (which also shows that their completion counters reset themselves)."""

import math

import numpy as np
import pytest

from llama.twins.classifier import fused_classifier
from llama.twins.embedding import embedding_backward, embedding_forward
from llama.twins.rmsnorm import rmsnorm_forward, rmsnorm_residual_backward, rmsnorm_residual_forward
from llama.twins.swiglu import swiglu_backward, swiglu_forward
from llama.cuda import BF16
from llama.optim import AdamWConfig, adamw_update, clip_norm_estimate
from tests.gpu_helpers import ERRORS, check, dev, poisoned

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(4321)

# ||out - ref|| / ||ref|| allowed per output, ref in float64 from the same bf16-rounded inputs.
# A bf16 output carries one rounding (relative 2^-9 = 2e-3 per element) on top of fp32 math; an fp32
# output of exact inputs only the fp32 arithmetic (sums of up to ~1e5 terms).
TOL = {
    "embedding_backward": 1e-5,            # fp32 sums of bf16 rows
    "rmsnorm_residual_forward_h": 1e-2,    # bf16 output
    "rmsnorm_residual_forward_ln": 1e-2,   # bf16 output
    "rmsnorm_residual_forward_rstd": 5e-3,  # fp32 of the stored (bf16-rounded) h; the twin's h is exact
    "rmsnorm_residual_forward_stored_h": 1e-5,  # the same rstd against the twin of the stored h
    "rmsnorm_forward_bf16_rstd": 1e-5,     # fp32 of exact inputs
    "rmsnorm_backward_bf16_dresidual": 1e-2,  # bf16 output
    "rmsnorm_backward_bf16_dweight": 1e-5,  # fp32 of exact inputs
    "swiglu_bf16": 1e-2,                   # bf16 outputs
    "fused_classifier_bf16_losses": 1e-5,  # fp32 (__expf: relative ~1e-6 per term)
    "fused_classifier_bf16_dlogits": 1e-2,  # bf16 output
    "confident_loss": 1e-4,                # one row's loss near 1e-11, relative
    "loss_accumulate_bf16": 1e-6,               # fp32 total, double sum
    "global_norm_squared_bf16": 1e-6,             # fp32 result, double sums
    "adamw_bf16": 1e-5,                    # fp32 update, m, v (as the fp32 kernel's test)
    "clip_norm_estimate": 1e-6,            # fp32 sums of a few dozen positive values
}


def randn(*shape, scale=1.0):
    """Normal values already rounded to bf16, as float64 (the twins' exact inputs)."""
    return (rng.standard_normal(shape) * scale).astype(BF16).astype(np.float64)


def dev_bf16(x):
    from llama.cuda import to_device
    return to_device(np.asarray(x).astype(BF16))


def poisoned_bf16(shape):
    from llama.cuda import to_device
    return to_device(np.full(shape, np.nan, dtype=BF16))


def bits(device_array) -> np.ndarray:
    host = device_array.download()
    return host.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[host.dtype.itemsize])


def check_increment(name, device_array, before, increment, tol):
    """An accumulated (+=) output: ‖(out − before) − increment‖ / ‖increment‖."""
    got = device_array.download().astype(np.float64)
    assert np.isfinite(got).all(), f"{name}: output has NaN/inf"
    err = float(np.linalg.norm((got - before) - increment) / max(np.linalg.norm(increment), 1e-300))
    ERRORS.append((name, err))
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"


@pytest.fixture(scope="module")
def ops():
    from llama import ops
    return ops


@pytest.mark.parametrize("N, C, V", [(1, 8, 5), (40, 16, 3), (37, 104, 50), (1000, 768, 1000), (4099, 64, 30000)])
def test_embedding_bf16(ops, N, C, V):
    from llama.cuda import to_device, zeros
    tokens = rng.integers(0, V, N)
    tokens[: N // 2] = tokens[0]  # one token with many segments
    wte = randn(V, C)
    out = poisoned_bf16((N, C))
    ops.embedding_forward_bf16(out, dev(tokens), dev_bf16(wte))
    assert np.array_equal(bits(out), embedding_forward(tokens, wte).astype(BF16).view(np.uint16))
    ERRORS.append(("embedding_forward_bf16", 0.0))

    dout, dwte0 = randn(N, C), rng.standard_normal((V, C)).astype(np.float32)
    order, segments = ops.token_segments(tokens)
    order_d, segments_d, dout_d = dev(order), to_device(segments), dev_bf16(dout)
    scratch = zeros(ops.embedding_bf16_scratch_size(N, C))
    results = []
    for _ in range(2):  # the same scratch twice: its counters must be back at zero
        dwte = dev(dwte0)
        ops.embedding_backward_bf16(dwte, dout_d, order_d, segments_d, scratch)
        results.append(bits(dwte))
    check_increment("embedding_backward_bf16", dwte, dwte0, embedding_backward(dout, tokens, V),
                    TOL["embedding_backward"])
    assert np.array_equal(results[0], results[1])  # deterministic


@pytest.mark.parametrize("N, C", [(1, 8), (37, 104), (300, 768), (1000, 48), (513, 2048), (3, 4096)])
def test_rmsnorm_residual_bf16(ops, N, C):
    from llama.cuda import zeros
    eps = 1e-5
    x, branch, w = randn(N, C), randn(N, C), randn(C)
    residual, ln, rstd = poisoned_bf16((N, C)), poisoned_bf16((N, C)), poisoned((N,))
    w_d = dev(w)  # the fp32 master weight
    ops.rmsnorm_residual_forward_bf16(residual, ln, rstd, dev_bf16(x), dev_bf16(branch), w_d, eps)
    ref_h, ref_ln, ref_rstd = rmsnorm_residual_forward(x, branch, w, eps)
    check("rmsnorm_residual_forward_h", residual, ref_h, TOL["rmsnorm_residual_forward_h"])
    check("rmsnorm_residual_forward_ln", ln, ref_ln, TOL["rmsnorm_residual_forward_ln"])
    check("rmsnorm_residual_forward_rstd", rstd, ref_rstd, TOL["rmsnorm_residual_forward_rstd"])
    h = residual.download().astype(np.float64)  # the norm of the stored h, exactly
    check("rmsnorm_residual_forward_stored_h", rstd, rmsnorm_forward(h, w, eps)[1],
          TOL["rmsnorm_residual_forward_stored_h"])

    x_d = dev_bf16(x)  # in place: the residual stream overwritten by x + branch
    ops.rmsnorm_residual_forward_bf16(x_d, poisoned_bf16((N, C)), poisoned((N,)), x_d, dev_bf16(branch), w_d, eps)
    assert np.array_equal(bits(x_d), bits(residual))

    # backward at the stored bf16 h and the kernel's rstd, the inputs it will have in the model
    rstd64 = rstd.download().astype(np.float64)
    dln, dres0, dw0 = randn(N, C), randn(N, C), rng.standard_normal(C).astype(np.float32)
    scratch = zeros(ops.rmsnorm_bf16_scratch_size(C))
    dln_d, results = dev_bf16(dln), []
    for _ in range(2):  # the same scratch twice: its counters must be back at zero
        dres, dw = dev_bf16(dres0), dev(dw0)
        ops.rmsnorm_backward_bf16(dres, dw, scratch, dln_d, residual, w_d, rstd)
        results.append((bits(dres), bits(dw)))
    ref_dres, ref_dw = rmsnorm_residual_backward(dres0, dln, h, w, rstd64)
    check("rmsnorm_backward_bf16_dresidual", dres, ref_dres, TOL["rmsnorm_backward_bf16_dresidual"])
    check_increment("rmsnorm_backward_bf16_dweight", dw, dw0, ref_dw, TOL["rmsnorm_backward_bf16_dweight"])
    assert all(np.array_equal(a, b) for a, b in zip(*results))  # deterministic


@pytest.mark.parametrize("N, C", [(1, 8), (37, 104), (300, 768)])
def test_rmsnorm_forward_bf16(ops, N, C):
    x, w = randn(N, C), randn(C)
    out, rstd = poisoned_bf16((N, C)), poisoned((N,))
    ops.rmsnorm_forward_bf16(out, rstd, dev_bf16(x), dev(w), 1e-5)
    ref_out, ref_rstd = rmsnorm_forward(x, w, 1e-5)
    check("rmsnorm_forward_bf16", out, ref_out, TOL["rmsnorm_residual_forward_ln"])
    check("rmsnorm_forward_bf16_rstd", rstd, ref_rstd, TOL["rmsnorm_forward_bf16_rstd"])


@pytest.mark.parametrize("N, F", [(1, 8), (37, 104), (256, 2048), (1001, 64)])
def test_swiglu_bf16(ops, N, F):
    gate_up, dout = randn(N, 2 * F, scale=2.0), randn(N, F)
    out, dgate_up = poisoned_bf16((N, F)), poisoned_bf16((N, 2 * F))
    gate_up_d = dev_bf16(gate_up)
    ops.swiglu_forward_bf16(out, gate_up_d)
    check("swiglu_forward_bf16", out, swiglu_forward(gate_up), TOL["swiglu_bf16"])
    ops.swiglu_backward_bf16(dgate_up, dev_bf16(dout), gate_up_d)
    check("swiglu_backward_bf16", dgate_up, swiglu_backward(dout, gate_up), TOL["swiglu_bf16"])
    ops.swiglu_backward_bf16(gate_up_d, dev_bf16(dout), gate_up_d)  # in place
    assert np.array_equal(bits(gate_up_d), bits(dgate_up))


# more rows than multiprocessors (blocks take several rows, prefetching the next one; odd V moves each
# row's 16-byte boundary), and rows longer than shared memory and registers keep (read twice)
@pytest.mark.parametrize("n, V", [(1, 5), (33, 50), (7, 1001), (4, 131), (16, 5000), (9, 128256),
                                  (300, 1001), (1000, 40), (140, 140001)])
def test_fused_classifier_bf16(ops, n, V):
    from llama.cuda import empty
    logits, targets = randn(n, V, scale=4.0), rng.integers(0, V, n)
    confident = sorted({0, n - 1}) if V >= 50 else []  # losses ~1e-11, which cancellation would lose
    logits[confident, targets[confident]] = 40.0
    # a view one element into its allocation, so that even row 0 starts off the 16-byte grid
    buffer = empty(n * V + 1, BF16)
    buffer.upload(np.concatenate([[0.0], logits.ravel()]))
    logits_d, losses = buffer.view(1, (n, V)), poisoned((n,))
    ops.fused_classifier_bf16(logits_d, losses, dev(targets), 1.0 / n)
    ref_losses, ref_dlogits = fused_classifier(logits, targets, 1.0 / n)
    check("fused_classifier_bf16_losses", losses, ref_losses, TOL["fused_classifier_bf16_losses"])
    check("fused_classifier_bf16_dlogits", logits_d, ref_dlogits, TOL["fused_classifier_bf16_dlogits"])
    for row in confident:  # log1p of the other probabilities' sum, which float64's log(sum) would round
        others = np.delete(logits[row], targets[row]) - logits[row, targets[row]]
        exact = np.log1p(np.sum(np.exp(others)))
        err = abs(float(losses.download()[row]) - exact) / exact
        ERRORS.append(("fused_classifier_bf16_confident_loss", err))
        assert err < TOL["confident_loss"], (row, err, exact)


@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_loss_accumulate_bf16(ops, n):
    losses = (rng.random(n) * 10).astype(np.float32)
    losses_d, results = dev(losses), []
    for _ in range(2):
        total = dev(np.array([3.0]))
        ops.loss_accumulate_bf16(total, losses_d, 0.25)
        results.append(bits(total))
    check("loss_accumulate_bf16", total, np.array([3.0 + 0.25 * np.sum(losses.astype(np.float64))]), TOL["loss_accumulate_bf16"])
    assert np.array_equal(results[0], results[1])  # deterministic


@pytest.mark.parametrize("n", [1, 7, 1000, 1_000_003, 3 * 2 ** 22 + 5])
def test_global_norm_squared_bf16(ops, n):
    from llama.cuda import zeros
    g = rng.standard_normal(n).astype(np.float32)
    g_d, scratch, results = dev(g), zeros(ops.NORM_BLOCKS + 1, np.float64), []
    for _ in range(2):  # the same scratch twice: its counter must be back at zero
        out = poisoned((1,))
        ops.global_norm_squared_bf16(out, scratch, g_d)
        results.append(bits(out))
    check("global_norm_squared_bf16", out, np.array([np.sum(g.astype(np.float64) ** 2)]), TOL["global_norm_squared_bf16"])
    assert np.array_equal(results[0], results[1])  # deterministic


@pytest.mark.parametrize("groups", [1, 3, 34])
def test_clip_norm_estimate(ops, groups):
    """Against optim.clip_norm_estimate for every group: with a last step, and on the first (zeros)."""
    current = rng.uniform(0.1, 10.0, groups).astype(np.float32)
    for previous in (rng.uniform(0.1, 10.0, groups).astype(np.float32), np.zeros(groups, np.float32)):
        for g in range(groups):
            out = poisoned((1,))
            ops.clip_norm_estimate(out, dev(current), dev(previous), g)
            check("clip_norm_estimate", out, np.array([clip_norm_estimate(current.astype(np.float64),
                                                                          previous.astype(np.float64), g)]),
                  TOL["clip_norm_estimate"])
    with pytest.raises(ValueError, match=f"group {groups} outside the {groups} groups"):
        ops.clip_norm_estimate(out, dev(current), dev(previous), groups)


@pytest.mark.parametrize("grad_clip, step, n", [(0.0, 1, 10_001), (1.0, 3, 8), (1e9, 7, 100_003), (1.0, 2, 5)])
def test_adamw_bf16(ops, grad_clip, step, n):
    from llama.cuda import to_device
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    p, g = f32(rng.standard_normal(n)), f32(rng.standard_normal(n))
    m, v = f32(rng.standard_normal(n) * 0.1), f32(np.abs(rng.standard_normal(n)) * 0.01)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    opt, lr = AdamWConfig(weight_decay=0.1, grad_clip=grad_clip), 0.1
    norm = math.sqrt(g @ g)
    dp, dm, dv, p16 = dev(p), dev(m), dev(v), poisoned_bf16((n,))
    # a large lr, so that the update (measured as p_new - p) stands far above p's float32 rounding
    ops.adamw_update_bf16(dp, p16, dev(g), dm, dv, to_device(mask), dev(np.array([norm * norm])),
                          to_device(ops.adamw_scalars(step, lr, opt)), opt)
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    adamw_update(rp, g, rm, rv, mask, step, lr, opt, grad_scale=grad_clip / norm if 0 < grad_clip < norm else 1.0)
    check_increment("adamw_bf16_update", dp, p, rp - p, TOL["adamw_bf16"])
    check("adamw_bf16_m", dm, rm, TOL["adamw_bf16"])
    check("adamw_bf16_v", dv, rv, TOL["adamw_bf16"])
    # the bf16 copy is the new fp32 params rounded to nearest even, bit for bit
    assert np.array_equal(bits(p16), dp.download().astype(BF16).view(np.uint16))


@pytest.mark.parametrize("n", [5, 256, 1000, 70_001])
@pytest.mark.parametrize("clipped", [False, True])
def test_adamw8bit_bf16_is_the_twin(ops, n, clipped):
    """Three steps of 8-bit AdamW from random moments: the kernel is the twin (llama/optim.py
    AdamW8bitState) bit for bit, params, the bf16 copy, every code and scale (clipped, the twin is given
    the kernel's float32 clip factor, max_norm / sqrt(norm^2) rounded once each)."""
    from llama.cuda import to_device
    from llama.optim import AdamW8bitState
    p = (rng.standard_normal(n)).astype(np.float32)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    twin = AdamW8bitState(n)
    twin.load(rng.standard_normal(n).astype(np.float32) * 0.1,
              np.abs(rng.standard_normal(n)).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, -1, n))
    opt = AdamWConfig(weight_decay=0.1, grad_clip=1.0 if clipped else 0.0)
    dp, p16 = to_device(p), poisoned_bf16((n,))
    buffers = {k: to_device(getattr(twin, k)) for k in ("m_codes", "m_scales", "v_codes", "v_scales")}
    maps, dmask, scalars = to_device(ops.quantization_maps()), to_device(mask), dev(np.zeros(3))
    expected = p.copy()
    for step in (1, 2, 3):
        g = (rng.standard_normal(n) * 0.3).astype(np.float32)
        g[rng.random(n) < 0.1] = 0.0  # values whose moments only decay
        norm_squared = np.float32(g.astype(np.float64) @ g)
        scale = np.float32(1) / np.sqrt(norm_squared) if clipped and np.sqrt(norm_squared) > 1 else 1.0
        scalars.upload(ops.adamw_scalars(step, 1e-2, opt))
        ops.adamw8bit_update_bf16(dp, p16, to_device(g), buffers["m_codes"], buffers["m_scales"], buffers["v_codes"],
                                  buffers["v_scales"], dmask, to_device(np.array([norm_squared])), scalars, maps, opt)
        twin.update(expected, g, mask, step, 1e-2, opt, grad_scale=float(scale))
    got = dp.download()
    assert np.array_equal(bits(p16), got.astype(BF16).view(np.uint16))
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    for name, array in buffers.items():
        assert np.array_equal(array.download().view(np.uint8), getattr(twin, name).view(np.uint8)), name


@pytest.mark.parametrize("n", [1, 255, 257, 100_003])
def test_round_to_bf16_and_widen_bf16(ops, n):
    """The conversions around a bf16 reduce-scatter: rounding to nearest even is ml_dtypes' bit for bit (ties,
    signed zeros, infinities; NaN stays NaN), and widening is exact, also when it adds into its output."""
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    x[:4] = [np.float32(1 + 2**-8), -0.0, np.inf, np.nan][:min(n, 4)]  # a tie rounds to even; specials stay
    rounded = poisoned_bf16((n,))
    ops.round_to_bf16(rounded, dev(x))
    number = ~np.isnan(x)
    assert np.array_equal(bits(rounded)[number], x.astype(BF16).view(np.uint16)[number])
    assert np.isnan(rounded.download().astype(np.float32)[~number]).all()
    widened = dev(np.full(n, np.nan, np.float32))
    ops.widen_bf16(widened, rounded)
    expected = rounded.download().astype(np.float32)
    assert np.array_equal(widened.download(), expected, equal_nan=True)
    base = (rng.standard_normal(n)).astype(np.float32)
    total = dev(base)
    ops.widen_bf16(total, rounded, accumulate=True)
    assert np.array_equal(total.download(), base + expected, equal_nan=True)
