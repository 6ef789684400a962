"""The document-masked causal attention's twins (llama/twins/attention.py) and ReferenceModel's doc_mask_bos:
finite differences in float64, and against the unmasked attention and model run on each document alone."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.model.reference import ReferenceModel
from llama.run.plan import cpu_plan
from llama.twins.attention import (attention_backward, attention_forward, document_attention_backward,
                                   document_attention_forward, document_bounds, document_ids)
from llama.twins.flash_attention import flash_attention_backward, flash_attention_forward
from tests.gradcheck import model_gradient_errors, numerical_grad, rel_error

BOS = 1
H, KV, D = 4, 2, 8


def packed_tokens(lengths: list[int], starts_mid: bool, vocab: int, rng) -> np.ndarray:
    """One row of documents of these lengths, each opening with BOS (the first one not, when starts_mid:
    it continues a document of the previous row); no other token is BOS."""
    row = rng.integers(BOS + 1, vocab, sum(lengths))
    starts = np.cumsum([0] + lengths[:-1])
    row[starts[1:] if starts_mid else starts] = BOS
    return row


def test_document_ids():
    tokens = np.array([[5, BOS, 3, 4, BOS, BOS, 7], [BOS, 2, 2, 2, 2, 2, BOS]])
    np.testing.assert_array_equal(document_ids(tokens, BOS), [[0, 1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 2]])


def test_document_bounds():
    tokens = np.array([[5, BOS, 3, 4, BOS, BOS, 7], [BOS, 2, 2, 2, 2, 2, BOS], [2, 2, 2, 2, 2, 2, 2]])
    doc_start, doc_end = document_bounds(tokens, BOS)
    np.testing.assert_array_equal(doc_start, [[0, 1, 1, 1, 4, 5, 5], [0, 0, 0, 0, 0, 0, 6], [0] * 7])
    np.testing.assert_array_equal(doc_end, [[1, 4, 4, 4, 5, 7, 7], [6, 6, 6, 6, 6, 6, 7], [7] * 7])
    assert doc_start.dtype == doc_end.dtype == np.int32
    for row in ([[BOS]], [[3]]):
        assert [x.tolist() for x in document_bounds(np.array(row), BOS)] == [[[0]], [[1]]]


@pytest.mark.parametrize("T", [1, 2, 37, 300])
def test_document_bounds_are_the_document_ids_mask(T):
    """doc_start[q] <= k <= q is the document_ids mask, and [doc_start[t], doc_end[t]) is t's document."""
    rng = np.random.default_rng(T)
    tokens = rng.choice([BOS, 2, 3, 4], size=(3, T), p=[0.1, 0.3, 0.3, 0.3])
    tokens[2] = 2  # a row without BOS
    doc_start, doc_end = document_bounds(tokens, BOS)
    ids = document_ids(tokens, BOS)
    positions = np.arange(T)
    visible = (doc_start[:, :, None] <= positions) & (positions <= positions[:, None])
    same_document = (ids[:, :, None] == ids[:, None, :]) & (positions <= positions[:, None])
    np.testing.assert_array_equal(visible, same_document)
    in_document = (doc_start[:, :, None] <= positions) & (positions < doc_end[:, :, None])
    np.testing.assert_array_equal(in_document, ids[:, :, None] == ids[:, None, :])


def test_flash_twin_with_one_document_per_row_is_the_causal_twin():
    rng = np.random.default_rng(6)
    B, T = 2, 9
    qkv, dout = rng.standard_normal((B, T, (H + 2 * KV) * D)), rng.standard_normal((B, T, H * D))
    one_document = document_ids(np.stack([packed_tokens([T], False, 9, rng), packed_tokens([T], True, 9, rng)]), BOS)
    out, lse = flash_attention_forward(qkv, H, KV)
    masked_out, masked_lse = flash_attention_forward(qkv, H, KV, one_document)
    np.testing.assert_array_equal(masked_out, out)
    np.testing.assert_array_equal(masked_lse, lse)
    np.testing.assert_array_equal(flash_attention_backward(dout, out, lse, qkv, H, KV, doc_ids=one_document),
                                  flash_attention_backward(dout, out, lse, qkv, H, KV))
    two_documents = document_ids(np.stack([packed_tokens([4, 5], False, 9, rng)] * 2), BOS)
    assert not np.allclose(flash_attention_forward(qkv, H, KV, two_documents)[0], out)


def test_document_attention_gradients():
    rng = np.random.default_rng(0)
    tokens = np.stack([packed_tokens([3, 1, 4, 2], True, 9, rng), packed_tokens([1, 1, 6, 2], False, 9, rng)])
    doc_ids = document_ids(tokens, BOS)
    q = rng.standard_normal((2, H, 10, D))
    k, v = rng.standard_normal((2, 2, KV, 10, D))
    w = rng.standard_normal((2, 10, H * D))
    out, lse = document_attention_forward(q, k, v, doc_ids)
    dq, dk, dv = document_attention_backward(w, q, k, v, out, lse, doc_ids)
    loss = lambda: float(np.sum(document_attention_forward(q, k, v, doc_ids)[0] * w))
    for grad, array in ((dq, q), (dk, k), (dv, v)):
        assert rel_error(grad, numerical_grad(loss, array)) < 1e-6


LAYOUTS = {  # row 0's document lengths and whether it starts mid-document; row 1 has them reversed, from a BOS
    "length_1_documents": ([1, 1, 5, 1, 1, 3], False),
    "shorter_and_longer_than_64": ([30, 100, 7, 23], False),
    "one_document_fills_the_row": ([160], False),
    "starts_mid_document": ([70, 1, 50, 39], True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_row_is_each_document_alone(layout):
    """Outputs, lse and gradients of the masked attention on packed rows equal the causal attention's on each
    document by itself."""
    lengths, starts_mid = LAYOUTS[layout]
    rng = np.random.default_rng(1)
    rows = [(lengths, starts_mid), (lengths[::-1], False)]
    tokens = np.stack([packed_tokens(lens, mid, 50, rng) for lens, mid in rows])
    T = tokens.shape[1]
    q = rng.standard_normal((2, H, T, D))
    k, v = rng.standard_normal((2, 2, KV, T, D))
    dout = rng.standard_normal((2, T, H * D))
    doc_ids = document_ids(tokens, BOS)
    out, lse = document_attention_forward(q, k, v, doc_ids)
    grads = document_attention_backward(dout, q, k, v, out, lse, doc_ids)
    for b, (lens, _) in enumerate(rows):
        assert len(np.unique(doc_ids[b])) == len(lens)
        for start, end in zip(np.cumsum([0] + lens[:-1]), np.cumsum(lens)):
            doc = slice(start, end)
            alone, alone_lse = attention_forward(q[b:b + 1, :, doc], k[b:b + 1, :, doc], v[b:b + 1, :, doc])
            np.testing.assert_allclose(out[b, doc], alone[0], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(lse[b, :, doc], alone_lse[0], rtol=1e-12, atol=1e-12)
            alone_grads = attention_backward(dout[b:b + 1, doc], q[b:b + 1, :, doc], k[b:b + 1, :, doc],
                                             v[b:b + 1, :, doc], alone, alone_lse)
            for grad, alone_grad in zip(grads, alone_grads):
                np.testing.assert_allclose(grad[b, :, doc], alone_grad[0], rtol=1e-10, atol=1e-12)


def tiny_model(**options) -> ReferenceModel:
    """The tiny reference in float64 with a CPU plan of these RunOptions."""
    config = get_preset("tiny").replace(dim=16, n_heads=4, n_kv_heads=2, vocab_size=23)
    model = ReferenceModel(config, cpu_plan(**options), dtype=np.float64, seed=1)
    model.params *= 5  # larger weights than init, so that every path matters
    return model


def test_one_document_per_row_is_the_unmasked_model():
    rng = np.random.default_rng(2)
    tokens = np.stack([packed_tokens([12], False, 23, rng), packed_tokens([12], True, 23, rng)])
    targets = rng.integers(0, 23, tokens.shape)
    plain, masked = tiny_model(), tiny_model(doc_mask="on", bos_id=BOS)
    assert plain.forward(tokens, targets) == masked.forward(tokens, targets)
    plain.backward()
    masked.backward()
    np.testing.assert_array_equal(plain.grads, masked.grads)


def test_masked_model_is_each_document_alone():
    """RoPE keeps the row's positions, and rotated scores depend only on t - s: each document's token losses
    on the packed row equal the unmasked model's on the document by itself."""
    rng = np.random.default_rng(3)
    lengths = [5, 1, 9, 3]
    tokens = packed_tokens(lengths, True, 23, rng)[None]
    targets = rng.integers(0, 23, tokens.shape)
    masked, plain = tiny_model(doc_mask="on", bos_id=BOS), tiny_model()
    masked.forward(tokens, targets)
    packed_losses = masked.token_losses()
    for start, end in zip(np.cumsum([0] + lengths[:-1]), np.cumsum(lengths)):
        plain.forward(tokens[:, start:end], targets[:, start:end])
        np.testing.assert_allclose(packed_losses[:, start:end], plain.token_losses(), rtol=1e-6)
    plain.forward(tokens, targets)
    assert not np.allclose(plain.token_losses(), packed_losses, rtol=1e-3)


def test_masked_model_gradients_every_tensor():
    rng = np.random.default_rng(4)
    tokens = np.stack([packed_tokens([2, 1, 3], True, 23, rng), packed_tokens([4, 2], False, 23, rng)])
    targets = rng.integers(0, 23, tokens.shape)
    errors = model_gradient_errors(tiny_model(doc_mask="on", bos_id=BOS), tokens, targets, rng)
    assert max(errors.values()) < 1e-6, errors


def test_full_recompute_keeps_the_mask():
    rng = np.random.default_rng(5)
    tokens = np.stack([packed_tokens([3, 5, 4], True, 23, rng), packed_tokens([7, 5], False, 23, rng)])
    targets = rng.integers(0, 23, tokens.shape)
    kept, recomputed = tiny_model(doc_mask="on", bos_id=BOS), tiny_model(doc_mask="on", bos_id=BOS, recompute="full")
    assert kept.forward(tokens, targets) == recomputed.forward(tokens, targets)
    kept.backward()
    recomputed.backward()
    np.testing.assert_array_equal(kept.grads, recomputed.grads)
