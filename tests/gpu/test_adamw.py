"""AdamW's kernels (kernels/adamw.cu, llama/ops/adamw.py) against their twins (llama/optim.py): fp32 and
bf16 updates with and without clipping (the bf16 copy bit for bit), and the 8-bit moments' update bit for
bit over three steps. The kernels read the decay mask a bit a weight (ops.pack_decay_mask), the twins a byte."""

import math

import numpy as np
import pytest

from llama import ops
from llama.runtime.cuda import BF16
from llama.optim import AdamWConfig, adamw_update
from tests.gpu_helpers import ERRORS, bits, check, check_increment, dev, poisoned_bf16, randn

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)

# ||out - twin|| / ||twin|| allowed per output, the twin in float64 from the same rounded inputs: a bf16
# output carries one rounding (relative 2^-9 = 2e-3 per element) on top of fp32 math; an fp32 output of
# exact inputs only the fp32 arithmetic. The fp32 kernels' outputs: 1e-5 (tests.gpu_helpers.check).
TOL = {
    "adamw_bf16": 1e-5,                    # fp32 update, m, v (as the fp32 kernel's test)
}


@pytest.mark.parametrize("grad_clip, step", [(0.0, 1), (1.0, 3), (1e9, 7)])
def test_adamw(grad_clip, step):
    n = 10_001
    p, g, m, v = randn(rng, n), randn(rng, n), randn(rng, n) * 0.1, np.abs(randn(rng, n)) * 0.01
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    opt = AdamWConfig(weight_decay=0.1, grad_clip=grad_clip)
    norm = math.sqrt(g @ g)
    dp, dm, dv = dev(p), dev(m), dev(v)
    from llama.runtime.cuda import to_device
    # a large lr, so that the update (measured as p_new - p) stands far above p's float32 rounding
    ops.adamw_update(dp, dev(g), dm, dv, to_device(ops.pack_decay_mask(mask)), dev(np.array([norm * norm])), step,
                     0.1, opt)
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    scale = grad_clip / norm if 0 < grad_clip < norm else 1.0
    adamw_update(rp, g, rm, rv, mask, step, 0.1, opt, grad_scale=scale)
    got = dp.download().astype(np.float64)
    err = np.linalg.norm((got - p) - (rp - p)) / np.linalg.norm(rp - p)  # the update itself
    ERRORS.append(("adamw_update", err))
    assert err < 1e-5, err
    check("adamw_m", dm, rm)
    check("adamw_v", dv, rv)


@pytest.mark.parametrize("grad_clip, step, n", [(0.0, 1, 10_001), (1.0, 3, 8), (1e9, 7, 100_003), (1.0, 2, 5)])
def test_adamw_bf16(grad_clip, step, n):
    from llama.runtime.cuda import to_device
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    p, g = f32(rng.standard_normal(n)), f32(rng.standard_normal(n))
    m, v = f32(rng.standard_normal(n) * 0.1), f32(np.abs(rng.standard_normal(n)) * 0.01)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    opt, lr = AdamWConfig(weight_decay=0.1, grad_clip=grad_clip), 0.1
    norm = math.sqrt(g @ g)
    dp, dm, dv, p16 = dev(p), dev(m), dev(v), poisoned_bf16((n,))
    # a large lr, so that the update (measured as p_new - p) stands far above p's float32 rounding
    ops.adamw_update_bf16(dp, p16, dev(g), dm, dv, to_device(ops.pack_decay_mask(mask)), dev(np.array([norm * norm])),
                          to_device(ops.adamw_scalars(step, lr, opt)), opt)
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    adamw_update(rp, g, rm, rv, mask, step, lr, opt, grad_scale=grad_clip / norm if 0 < grad_clip < norm else 1.0)
    check_increment("adamw_bf16_update", dp, p, rp - p, TOL["adamw_bf16"])
    check("adamw_bf16_m", dm, rm, TOL["adamw_bf16"])
    check("adamw_bf16_v", dv, rv, TOL["adamw_bf16"])
    # the bf16 copy is the new fp32 params rounded to nearest even, bit for bit
    assert np.array_equal(bits(p16), dp.download().astype(BF16).view(np.uint16))


@pytest.mark.parametrize("start, n", [(16, 10_001), (4096, 4103)])
def test_adamw_bf16_on_a_range_reads_its_bits(start, n):
    """The optimizer in the backward's update of weights [start, n) (ops.decay_mask_range of the whole packed mask)
    is the twin's on that range, bit for bit against the whole buffers' update of the same values."""
    from llama.runtime.cuda import to_device
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    p, g = f32(rng.standard_normal(n)), f32(rng.standard_normal(n))
    m, v = f32(rng.standard_normal(n) * 0.1), f32(np.abs(rng.standard_normal(n)) * 0.01)
    mask = (rng.random(n) < 0.5).astype(np.uint8)
    opt, packed = AdamWConfig(weight_decay=0.1, grad_clip=0.0), to_device(ops.pack_decay_mask(mask))
    scalars, norm_squared = to_device(ops.adamw_scalars(2, 0.1, opt)), dev(np.zeros(1))
    whole = [dev(x) for x in (p, m, v)] + [poisoned_bf16((n,))]
    part = [dev(x) for x in (p, m, v)] + [poisoned_bf16((n,))]
    ops.adamw_update_bf16(whole[0], whole[3], dev(g), whole[1], whole[2], packed, norm_squared, scalars, opt)
    k = n - start
    ranged = [a.view(start, (k,)) for a in part]
    ops.adamw_update_bf16(ranged[0], ranged[3], dev(g[start:]), ranged[1], ranged[2],
                          ops.decay_mask_range(packed, start, k), norm_squared, scalars, opt)
    for a, b in zip(whole, part):  # params, m, v, the bf16 copy
        assert np.array_equal(bits(a)[start:], bits(b)[start:])
    rp = p.copy()
    adamw_update(rp, g, m.copy(), v.copy(), mask, 2, 0.1, opt)
    check_increment("adamw_bf16_range_update", ranged[0], p[start:], rp[start:] - p[start:], TOL["adamw_bf16"])


@pytest.mark.parametrize("n", [5, 256, 1000, 70_001])
@pytest.mark.parametrize("clipped", [False, True])
def test_adamw8bit_bf16_is_the_twin(n, clipped):
    """Three steps of 8-bit AdamW from random moments: the kernel is the twin (llama/optim.py
    AdamW8bitState) bit for bit, params, the bf16 copy, every code and scale (clipped, the twin is given
    the kernel's float32 clip factor, max_norm / sqrt(norm^2) rounded once each)."""
    from llama.runtime.cuda import to_device
    from llama.optim import AdamW8bitState
    p = (rng.standard_normal(n)).astype(np.float32)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    twin = AdamW8bitState(n)
    twin.load(rng.standard_normal(n).astype(np.float32) * 0.1,
              np.abs(rng.standard_normal(n)).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, -1, n))
    opt = AdamWConfig(weight_decay=0.1, grad_clip=1.0 if clipped else 0.0)
    dp, p16 = to_device(p), poisoned_bf16((n,))
    buffers = {k: to_device(getattr(twin, k)) for k in ("m_codes", "m_scales", "v_codes", "v_scales")}
    maps, dmask, scalars = to_device(ops.quantization_maps()), to_device(ops.pack_decay_mask(mask)), dev(np.zeros(3))
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
