"""Every kernel against the float64 numpy reference: random inputs, NaN-poisoned outputs, shapes
that are not multiples of the tiles, GQA ratios 1, 2, 4 and 8."""

import math

import numpy as np
import pytest

from llama.twins.attention import attention_backward, attention_forward, attention_probabilities
from llama.twins.classifier import fused_classifier
from llama.twins.embedding import embedding_backward, embedding_forward
from llama.twins.rmsnorm import rmsnorm_backward, rmsnorm_forward
from llama.twins.rope import rope_backward, rope_forward
from llama.twins.swiglu import swiglu_backward, swiglu_forward
from llama.model.base import rope_cos_sin
from llama.config import get_preset
from llama.optim import AdamWConfig, adamw_update
from tests.gpu_helpers import ERRORS, check, dev, poisoned

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32).astype(np.float64)


@pytest.fixture(scope="module")
def ops():
    from llama import ops
    return ops


@pytest.mark.parametrize("M, N, K, batch", [(1, 1, 1, 1), (37, 129, 65, 1), (128, 128, 16, 1),
                                            (300, 257, 1000, 1), (70, 45, 33, 3), (8, 1030, 77, 2)])
@pytest.mark.parametrize("trans", ["nn", "nt", "tn"])
def test_matmul(ops, M, N, K, batch, trans):
    ta, tb = trans[0] == "t", trans[1] == "t"
    a = randn(batch, K, M) if ta else randn(batch, M, K)
    b = randn(batch, N, K) if tb else randn(batch, K, N)
    opa, opb = (a.swapaxes(1, 2) if ta else a), (b.swapaxes(1, 2) if tb else b)
    squeeze = (lambda x: x[0]) if batch == 1 else (lambda x: x)
    c = poisoned((batch, M, N) if batch > 1 else (M, N))
    ops.matmul(c, dev(squeeze(a)), dev(squeeze(b)), trans_a=ta, trans_b=tb, alpha=0.5)
    check(f"matmul[{trans}]", c, squeeze(0.5 * opa @ opb))
    c0 = randn(*c.shape)
    c = dev(c0)
    ops.matmul(c, dev(squeeze(a)), dev(squeeze(b)), trans_a=ta, trans_b=tb, alpha=1.0, beta=1.0)
    check(f"matmul_accumulate[{trans}]", c, c0 + squeeze(opa @ opb))


def test_matmul_rejects_bad_shapes(ops):
    with pytest.raises(ValueError, match="b: expected float32 \\(5, 3\\)"):
        ops.matmul(poisoned((4, 3)), dev(randn(4, 5)), dev(randn(6, 3)))
    with pytest.raises(ValueError, match="tokens"):
        ops.embedding_forward(poisoned((4, 8)), dev(randn(4)), dev(randn(10, 8)))


@pytest.mark.parametrize("N, C, V", [(1, 8, 5), (37, 100, 50), (512, 768, 1000)])
def test_embedding(ops, N, C, V):
    tokens = rng.integers(0, V, N)
    tokens[: N // 2] = tokens[0]  # many repeats of one token
    wte = randn(V, C)
    out = poisoned((N, C))
    ops.embedding_forward(out, dev(tokens), dev(wte))
    check("embedding_forward", out, embedding_forward(tokens, wte))
    dout, dwte0 = randn(N, C), randn(V, C)
    dwte = dev(dwte0)
    order, starts, unique = ops.sort_tokens(tokens)
    ops.embedding_backward(dwte, dev(dout), dev(order), dev(starts), dev(unique), len(unique))
    check("embedding_backward", dwte, dwte0 + embedding_backward(dout, tokens, V))


@pytest.mark.parametrize("N, C", [(1, 32), (37, 100), (300, 768), (1000, 48)])
def test_rmsnorm(ops, N, C):
    x, w = randn(N, C), randn(C)
    out, rstd = poisoned((N, C)), poisoned((N,))
    ops.rmsnorm_forward(out, rstd, dev(x), dev(w), 1e-5)
    ref_out, ref_rstd = rmsnorm_forward(x, w, 1e-5)
    check("rmsnorm_forward", out, ref_out)
    check("rmsnorm_forward_rstd", rstd, ref_rstd)
    dout, dinp0, dw0 = randn(N, C), randn(N, C), randn(C)
    dinp, dw = dev(dinp0), dev(dw0)
    ops.rmsnorm_backward(dinp, dw, poisoned((ops.RMSNORM_PARTS * C,)), dev(dout), dev(x), dev(w), rstd)
    ref_dx, ref_dw = rmsnorm_backward(dout, x, w, ref_rstd)
    check("rmsnorm_backward_dinp", dinp, dinp0 + ref_dx)
    check("rmsnorm_backward_dweight", dw, dw0 + ref_dw)


GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # ratios 1, 2, 4, 8


@pytest.mark.parametrize("H, KV", GQA)
@pytest.mark.parametrize("B, T, D", [(1, 5, 8), (2, 33, 64)])
def test_rope(ops, H, KV, B, T, D):
    config = get_preset("llama3.1-8b").replace(dim=H * D, n_heads=H, n_kv_heads=KV, rope_original_context=16)
    cos, sin = rope_cos_sin(config, T + 3)
    qkv = randn(B, T, (H + 2 * KV) * D)
    q, k, v = poisoned((B, H, T, D)), poisoned((B, KV, T, D)), poisoned((B, KV, T, D))
    cos_d, sin_d = dev(cos), dev(sin)
    ops.rope_forward(q, k, v, dev(qkv), cos_d, sin_d)
    rq, rk, rv = rope_forward(qkv, cos, sin, H, KV)
    for name, got, want in (("q", q, rq), ("k", k, rk), ("v", v, rv)):
        check(f"rope_forward_{name}", got, want)
    dq, dk, dv = randn(B, H, T, D), randn(B, KV, T, D), randn(B, KV, T, D)
    dqkv = poisoned((B, T, (H + 2 * KV) * D))
    ops.rope_backward(dqkv, dev(dq), dev(dk), dev(dv), cos_d, sin_d)
    check("rope_backward", dqkv, rope_backward(dq, dk, dv, cos, sin))


@pytest.mark.parametrize("H, KV", GQA)
@pytest.mark.parametrize("B, T, D", [(1, 1, 16), (2, 7, 16), (2, 65, 64), (1, 200, 32)])
def test_attention(ops, H, KV, B, T, D):
    q, k, v = randn(B, H, T, D), randn(B, KV, T, D), randn(B, KV, T, D)
    out, probs = poisoned((B, T, H * D)), poisoned((B, H, T, T))
    qd, kd, vd = dev(q), dev(k), dev(v)
    ops.attention_forward(out, probs, poisoned((B, H, T, D)), qd, kd, vd)
    ref_out, ref_lse = attention_forward(q, k, v)
    check("attention_forward", out, ref_out)
    check("attention_forward_probs", probs, attention_probabilities(q, k, ref_lse))
    dout = randn(B, T, H * D)
    dq, dk, dv = poisoned(q.shape), poisoned(k.shape), poisoned(v.shape)
    ops.attention_backward(dq, dk, dv, poisoned((B, H, T, T)), poisoned((B, H, T, D)), dev(dout), qd, kd, vd, probs)
    rdq, rdk, rdv = attention_backward(dout, q, k, v, ref_out, ref_lse)
    check("attention_backward_dv", dv, rdv)
    if T == 1:  # one key: dq and dk are zero in exact arithmetic, so only their size can be checked
        for grad in (dq, dk):
            value = grad.download()
            assert np.isfinite(value).all() and np.linalg.norm(value) <= 1e-6 * np.linalg.norm(rdv)
        return
    check("attention_backward_dq", dq, rdq)
    check("attention_backward_dk", dk, rdk)


@pytest.mark.parametrize("N, F", [(1, 1), (37, 100), (256, 2048)])
def test_swiglu(ops, N, F):
    gate_up, dout = randn(N, 2 * F), randn(N, F)
    out, dgu = poisoned((N, F)), poisoned((N, 2 * F))
    ops.swiglu_forward(out, dev(gate_up))
    check("swiglu_forward", out, swiglu_forward(gate_up))
    ops.swiglu_backward(dgu, dev(dout), dev(gate_up))
    check("swiglu_backward", dgu, swiglu_backward(dout, gate_up))


def test_residual(ops):
    x, y = randn(1001), randn(1001)
    out = poisoned((1001,))
    ops.residual_forward(out, dev(x), dev(y))
    check("residual_forward", out, x + y)


@pytest.mark.parametrize("N, V", [(1, 5), (33, 258), (16, 5000), (9, 128256)])
def test_fused_classifier(ops, N, V):
    logits, targets = randn(N, V) * 4, rng.integers(0, V, N)
    d_logits, losses = dev(logits), poisoned((N,))
    ops.fused_classifier(d_logits, losses, dev(targets), 1.0 / N)
    ref_losses, ref_dlogits = fused_classifier(logits, targets, 1.0 / N)
    check("fused_classifier_losses", losses, ref_losses)
    check("fused_classifier_dlogits", d_logits, ref_dlogits)


@pytest.mark.parametrize("n", [1, 1000, 1_000_003])
def test_global_norm(ops, n):
    x = randn(n)
    out = poisoned((1,))
    ops.global_norm_squared(out, poisoned((ops.NORM_BLOCKS,)), dev(x))
    check("global_norm_squared", out, np.array([x @ x]))
    first = out.download()
    ops.global_norm_squared(out, poisoned((ops.NORM_BLOCKS,)), dev(x))
    assert out.download() == first  # deterministic


@pytest.mark.parametrize("grad_clip, step", [(0.0, 1), (1.0, 3), (1e9, 7)])
def test_adamw(ops, grad_clip, step):
    n = 10_001
    p, g, m, v = randn(n), randn(n), randn(n) * 0.1, np.abs(randn(n)) * 0.01
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    opt = AdamWConfig(weight_decay=0.1, grad_clip=grad_clip)
    norm = math.sqrt(g @ g)
    dp, dm, dv = dev(p), dev(m), dev(v)
    from llama.cuda import to_device
    # a large lr, so that the update (measured as p_new - p) stands far above p's float32 rounding
    ops.adamw_update(dp, dev(g), dm, dv, to_device(mask), dev(np.array([norm * norm])), step, 0.1, opt)
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    scale = grad_clip / norm if 0 < grad_clip < norm else 1.0
    adamw_update(rp, g, rm, rv, mask, step, 0.1, opt, grad_scale=scale)
    got = dp.download().astype(np.float64)
    err = np.linalg.norm((got - p) - (rp - p)) / np.linalg.norm(rp - p)  # the update itself
    ERRORS.append(("adamw_update", err))
    assert err < 1e-5, err
    check("adamw_m", dm, rm)
    check("adamw_v", dv, rv)
