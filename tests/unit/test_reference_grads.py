"""Finite-difference checks (float64) of every layer's backward (the numpy twins, llama/twins/) and of the
whole model."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.model.base import rope_cos_sin, rope_frequencies
from llama.model.reference import ReferenceModel
from llama.optim import AdamWConfig
from llama.twins.attention import attention_backward, attention_forward, attention_probabilities
from llama.twins.classifier import fused_classifier
from llama.twins.embedding import embedding_backward, embedding_forward
from llama.twins.flash_attention import flash_attention_backward, flash_attention_forward
from llama.twins.matmul import matmul_backward, matmul_forward
from llama.twins.rmsnorm import rmsnorm_backward, rmsnorm_forward, rmsnorm_residual_backward, rmsnorm_residual_forward
from llama.twins.rope import pack_qkv, rope_backward, rope_forward
from llama.twins.swiglu import swiglu_backward, swiglu_forward
from llama.run.plan import cpu_plan
from tests.gradcheck import model_gradient_errors, numerical_grad, rel_error

TOL = 1e-6


def weighted_sum(out, w):
    return float(np.sum(out * w))


def test_embedding_backward():
    rng = np.random.default_rng(0)
    wte = rng.standard_normal((11, 6))
    tokens = rng.integers(0, 11, (3, 5))
    tokens[0, :3] = 4  # repeated ids must accumulate
    w = rng.standard_normal((3, 5, 6))
    dwte = embedding_backward(w, tokens, 11)
    num = numerical_grad(lambda: weighted_sum(embedding_forward(tokens, wte), w), wte)
    assert rel_error(dwte, num) < TOL


def test_rmsnorm_backward():
    rng = np.random.default_rng(1)
    x, weight = rng.standard_normal((2, 3, 10)), rng.standard_normal(10)
    w = rng.standard_normal((2, 3, 10))
    out, rstd = rmsnorm_forward(x, weight, 1e-5)
    np.testing.assert_allclose(out, x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + 1e-5) * weight)
    dx, dweight = rmsnorm_backward(w, x, weight, rstd)
    loss = lambda: weighted_sum(rmsnorm_forward(x, weight, 1e-5)[0], w)
    assert rel_error(dx, numerical_grad(loss, x)) < TOL
    assert rel_error(dweight, numerical_grad(loss, weight)) < TOL


def test_rmsnorm_residual_backward():
    """The fused residual add + RMSNorm: the residual gradient (of h) passes through to x and branch."""
    rng = np.random.default_rng(11)
    x, branch, weight = rng.standard_normal((2, 3, 10)), rng.standard_normal((2, 3, 10)), rng.standard_normal(10)
    w_h, w_ln = rng.standard_normal((2, 3, 10)), rng.standard_normal((2, 3, 10))
    h, _, rstd = rmsnorm_residual_forward(x, branch, weight, 1e-5)
    dx, dweight = rmsnorm_residual_backward(w_h, w_ln, h, weight, rstd)

    def loss():
        h, ln, _ = rmsnorm_residual_forward(x, branch, weight, 1e-5)
        return weighted_sum(h, w_h) + weighted_sum(ln, w_ln)
    assert rel_error(dx, numerical_grad(loss, x)) < TOL
    assert rel_error(dx, numerical_grad(loss, branch)) < TOL
    assert rel_error(dweight, numerical_grad(loss, weight)) < TOL


def test_matmul_backward():
    rng = np.random.default_rng(2)
    x, weight = rng.standard_normal((2, 3, 7)), rng.standard_normal((5, 7))
    w = rng.standard_normal((2, 3, 5))
    dx, dweight = matmul_backward(w, x, weight)
    loss = lambda: weighted_sum(matmul_forward(x, weight), w)
    assert rel_error(dx, numerical_grad(loss, x)) < TOL
    assert rel_error(dweight, numerical_grad(loss, weight)) < TOL


@pytest.mark.parametrize("n_heads, n_kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_rope_backward(n_heads, n_kv_heads):
    rng = np.random.default_rng(3)
    B, T, D = 2, 5, 8
    config = get_preset("tiny").replace(dim=D * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads)
    cos, sin = rope_cos_sin(config, 7)
    qkv = rng.standard_normal((B, T, (n_heads + 2 * n_kv_heads) * D))
    wq, wk, wv = (rng.standard_normal(s) for s in [(B, n_heads, T, D), (B, n_kv_heads, T, D), (B, n_kv_heads, T, D)])
    dqkv = rope_backward(wq, wk, wv, cos, sin)
    loss = lambda: sum(weighted_sum(o, w) for o, w in zip(rope_forward(qkv, cos, sin, n_heads, n_kv_heads), (wq, wk, wv)))
    assert rel_error(dqkv, numerical_grad(loss, qkv)) < TOL


def test_rope_rotates_meta_pairs():
    """Position t rotates the pair (2i, 2i+1) as the complex number x[2i] + i x[2i+1] by t * freq_i."""
    config = get_preset("tiny")
    D = config.head_dim
    rng = np.random.default_rng(4)
    qkv = rng.standard_normal((1, 6, (config.n_heads + 2 * config.n_kv_heads) * D))
    cos, sin = rope_cos_sin(config, 6)
    q, k, v = rope_forward(qkv, cos, sin, config.n_heads, config.n_kv_heads)
    freqs = rope_frequencies(config)
    x = qkv[0, 4, :D]  # position 4, query head 0
    rotated = (x[0::2] + 1j * x[1::2]) * np.exp(1j * 4 * freqs)
    np.testing.assert_allclose(q[0, 0, 4, 0::2], rotated.real)
    np.testing.assert_allclose(q[0, 0, 4, 1::2], rotated.imag)
    np.testing.assert_array_equal(v[0, 0], qkv[0, :, (config.n_heads + config.n_kv_heads) * D:][:, :D])


@pytest.mark.parametrize("n_heads, n_kv_heads", [(2, 2), (4, 2), (4, 1), (8, 2)])
def test_attention_backward(n_heads, n_kv_heads):
    rng = np.random.default_rng(5)
    B, T, D = 2, 5, 4
    q = rng.standard_normal((B, n_heads, T, D))
    k, v = rng.standard_normal((2, B, n_kv_heads, T, D))
    w = rng.standard_normal((B, T, n_heads * D))
    out, lse = attention_forward(q, k, v)
    dq, dk, dv = attention_backward(w, q, k, v, out, lse)
    loss = lambda: weighted_sum(attention_forward(q, k, v)[0], w)
    assert rel_error(dq, numerical_grad(loss, q)) < TOL
    assert rel_error(dk, numerical_grad(loss, k)) < TOL
    assert rel_error(dv, numerical_grad(loss, v)) < TOL


def test_attention_is_causal_gqa():
    """Against a loop over heads: query head h attends to kv head h // n_rep, positions <= t."""
    rng = np.random.default_rng(6)
    B, H, KV, T, D = 1, 6, 2, 4, 3
    q, k, v = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, KV, T, D)), rng.standard_normal((B, KV, T, D))
    out, lse = attention_forward(q, k, v)
    probs = attention_probabilities(q, k, lse)
    for h in range(H):
        kh, vh = k[0, h // (H // KV)], v[0, h // (H // KV)]
        for t in range(T):
            s = kh[:t + 1] @ q[0, h, t] / np.sqrt(D)
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(out[0, t, h * D:(h + 1) * D], p @ vh[:t + 1])
            np.testing.assert_allclose(lse[0, h, t], np.log(np.sum(np.exp(s))))
            np.testing.assert_allclose(probs[0, h, t], np.concatenate([p, np.zeros(T - t - 1)]))


@pytest.mark.parametrize("rope", [False, True])
def test_flash_attention_backward(rope):
    """The packed-qkv twin of the flash kernels: dqkv is the gradient of the packed projection, taken
    before RoPE when cos/sin are given (rope_backward fused into the attention backward)."""
    rng = np.random.default_rng(9)
    B, T, H, KV, D = 2, 5, 4, 2, 4
    config = get_preset("tiny").replace(dim=H * D, n_heads=H, n_kv_heads=KV)
    cos, sin = rope_cos_sin(config, T + 2) if rope else (None, None)
    raw = rng.standard_normal((B, T, (H + 2 * KV) * D))
    w = rng.standard_normal((B, T, H * D))
    packed = lambda: pack_qkv(*rope_forward(raw, cos, sin, H, KV)) if rope else raw
    out, lse = flash_attention_forward(packed(), H, KV)
    dqkv = flash_attention_backward(w, out, lse, packed(), H, KV, cos, sin)
    loss = lambda: weighted_sum(flash_attention_forward(packed(), H, KV)[0], w)
    assert rel_error(dqkv, numerical_grad(loss, raw)) < TOL


def test_swiglu_backward():
    rng = np.random.default_rng(7)
    gate_up = rng.standard_normal((2, 3, 12))
    w = rng.standard_normal((2, 3, 6))
    dgu = swiglu_backward(w, gate_up)
    loss = lambda: weighted_sum(swiglu_forward(gate_up), w)
    assert rel_error(dgu, numerical_grad(loss, gate_up)) < TOL


def test_fused_classifier():
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((6, 9)) * 3
    targets = rng.integers(0, 9, 6)
    losses, dlogits = fused_classifier(logits, targets, 0.25)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(losses, -np.log(p[np.arange(6), targets]))
    loss = lambda: 0.25 * float(np.sum(fused_classifier(logits, targets, 1.0)[0]))
    assert rel_error(dlogits, numerical_grad(loss, logits)) < TOL


@pytest.mark.parametrize("tied", [False, True])
def test_model_gradients_every_tensor(tied):
    config = get_preset("tiny").replace(dim=16, n_heads=4, n_kv_heads=2, vocab_size=23, tie_embeddings=tied)
    model = ReferenceModel(config, cpu_plan(), dtype=np.float64, seed=1)
    model.params *= 5  # larger weights than init, so that every path matters
    model.params[model.decay_mask == 0] = 1 + 0.3 * np.random.default_rng(2).standard_normal(int((model.decay_mask == 0).sum()))
    rng = np.random.default_rng(3)
    tokens, targets = rng.integers(0, 23, (2, 6)), rng.integers(0, 23, (2, 6))
    errors = model_gradient_errors(model, tokens, targets, rng)
    assert max(errors.values()) < TOL, errors


def test_backward_accumulates_and_scales():
    config = get_preset("tiny")
    model = ReferenceModel(config, cpu_plan(), dtype=np.float64)
    rng = np.random.default_rng(4)
    tokens, targets = rng.integers(0, config.vocab_size, (2, 8)), rng.integers(0, config.vocab_size, (2, 8))
    model.forward(tokens, targets)
    model.backward()
    once = model.grads.copy()
    model.backward(loss_scale=0.5)
    np.testing.assert_allclose(model.grads, 1.5 * once, rtol=1e-12)
    model.zero_grad()
    assert not model.grads.any()


def test_float32_matches_float64():
    config = get_preset("tiny")
    rng = np.random.default_rng(5)
    tokens, targets = rng.integers(0, config.vocab_size, (2, 16)), rng.integers(0, config.vocab_size, (2, 16))
    m32, m64 = ReferenceModel(config, cpu_plan(), dtype=np.float32), ReferenceModel(config, cpu_plan(),
                                                                                    dtype=np.float64)
    assert abs(m32.forward(tokens, targets) - m64.forward(tokens, targets)) < 1e-5
    m32.backward()
    m64.backward()
    assert rel_error(m32.grads, m64.grads) < 1e-5


def test_training_lowers_loss():
    config = get_preset("tiny")
    model = ReferenceModel(config, cpu_plan())
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, config.vocab_size, (4, 17))
    losses = []
    for step in range(1, 21):
        model.zero_grad()
        losses.append(model.forward(tokens[:, :-1], tokens[:, 1:]))
        model.backward()
        model.optimizer_step(3e-3, step, AdamWConfig())
    assert losses[-1] < losses[0] - 1.0


def test_bad_batches_raise():
    model = ReferenceModel(get_preset("tiny"), cpu_plan())
    with pytest.raises(ValueError, match="outside"):
        model.forward(np.array([[1, 200]]))
    with pytest.raises(ValueError, match="t <= max_seq_len 64"):
        model.forward(np.zeros((1, 65), dtype=np.int64))
    with pytest.raises(RuntimeError, match="needs a forward"):
        model.backward()
