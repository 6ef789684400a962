"""The fp32 path's attention (kernels/attention.cu and the matmuls, llama/ops/attention.py) against its
float64 twins (llama/twins/attention.py) at GQA ratios 1, 2, 4 and 8, the probabilities included; and with the
document mask (doc_start, doc_end) against the document-masked twins."""

import numpy as np
import pytest

from llama import ops
from llama.twins.attention import (attention_backward, attention_forward, attention_probabilities,
                                   document_attention_backward, document_attention_forward, document_bounds,
                                   document_ids)
from tests.gpu_helpers import check, dev, poisoned, randn

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)


GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # ratios 1, 2, 4, 8


@pytest.mark.parametrize("H, KV", GQA)
@pytest.mark.parametrize("B, T, D", [(1, 1, 16), (2, 7, 16), (2, 65, 64), (1, 200, 32)])
def test_attention(H, KV, B, T, D):
    q, k, v = randn(rng, B, H, T, D), randn(rng, B, KV, T, D), randn(rng, B, KV, T, D)
    out, probs = poisoned((B, T, H * D)), poisoned((B, H, T, T))
    qd, kd, vd = dev(q), dev(k), dev(v)
    ops.attention_forward(out, probs, poisoned((B, H, T, D)), qd, kd, vd)
    ref_out, ref_lse = attention_forward(q, k, v)
    check("attention_forward", out, ref_out)
    check("attention_forward_probs", probs, attention_probabilities(q, k, ref_lse))
    dout = randn(rng, B, T, H * D)
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


BOS = 7
DOCUMENT_ROWS = {  # per batch row, where its BOS tokens are (T = 70): several layouts in one batch
    "mixed": [[0, 1, 2, 40, 41, 69], [], [5, 6, 7, 8, 33]],
    "one_document_per_row": [[0], [], [0]],
}


@pytest.mark.parametrize("H, KV", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", DOCUMENT_ROWS)
def test_attention_document_mask(layout, H, KV):
    B, T, D = len(DOCUMENT_ROWS[layout]), 70, 32
    tokens = np.zeros((B, T), dtype=np.int32)
    for b, starts in enumerate(DOCUMENT_ROWS[layout]):
        tokens[b, starts] = BOS
    doc_ids = document_ids(tokens, BOS)
    doc_start, doc_end = (dev(x) for x in document_bounds(tokens, BOS))
    q, k, v = randn(rng, B, H, T, D), randn(rng, B, KV, T, D), randn(rng, B, KV, T, D)
    out, probs = poisoned((B, T, H * D)), poisoned((B, H, T, T))
    qd, kd, vd = dev(q), dev(k), dev(v)
    ops.attention_forward(out, probs, poisoned((B, H, T, D)), qd, kd, vd, doc_start=doc_start, doc_end=doc_end)
    ref_out, ref_lse = document_attention_forward(q, k, v, doc_ids)
    check("attention_forward_document_mask", out, ref_out)
    check("attention_forward_document_mask_probs", probs, attention_probabilities(q, k, ref_lse, doc_ids))
    dout = randn(rng, B, T, H * D)
    dq, dk, dv = poisoned(q.shape), poisoned(k.shape), poisoned(v.shape)
    ops.attention_backward(dq, dk, dv, poisoned((B, H, T, T)), poisoned((B, H, T, D)), dev(dout), qd, kd, vd, probs,
                           doc_start=doc_start, doc_end=doc_end)
    for name, got, expected in zip(("dq", "dk", "dv"), (dq, dk, dv),
                                   document_attention_backward(dout, q, k, v, ref_out, ref_lse, doc_ids)):
        check(f"attention_backward_document_mask_{name}", got, expected)
