"""The token embedding's kernels (kernels/embedding.cu, llama/ops/embedding.py) against their float64 twins
(llama/twins/embedding.py): fp32 lookup and scatter-add gradient; bf16 lookup (bit for bit) and the
deterministic segment sums of its gradient (reruns bit-identical, counters reset)."""

import numpy as np
import pytest

from llama import ops
from llama.runtime.cuda import BF16
from llama.twins.embedding import embedding_backward, embedding_forward
from tests.gpu_helpers import (ERRORS, bits, check, check_increment, dev, dev_bf16, poisoned, poisoned_bf16, randn,
                               randn_bf16)

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)

# ||out - twin|| / ||twin|| allowed per output, the twin in float64 from the same rounded inputs: a bf16
# output carries one rounding (relative 2^-9 = 2e-3 per element) on top of fp32 math; an fp32 output of
# exact inputs only the fp32 arithmetic. The fp32 kernels' outputs: 1e-5 (tests.gpu_helpers.check).
TOL = {
    "embedding_backward": 1e-5,            # fp32 sums of bf16 rows
}


@pytest.mark.parametrize("N, C, V", [(1, 8, 5), (37, 100, 50), (512, 768, 1000)])
def test_embedding(N, C, V):
    tokens = rng.integers(0, V, N)
    tokens[: N // 2] = tokens[0]  # many repeats of one token
    wte = randn(rng, V, C)
    out = poisoned((N, C))
    ops.embedding_forward(out, dev(tokens), dev(wte))
    check("embedding_forward", out, embedding_forward(tokens, wte))
    dout, dwte0 = randn(rng, N, C), randn(rng, V, C)
    dwte = dev(dwte0)
    order, starts, unique = ops.sort_tokens(tokens)
    ops.embedding_backward(dwte, dev(dout), dev(order), dev(starts), dev(unique), len(unique))
    check("embedding_backward", dwte, dwte0 + embedding_backward(dout, tokens, V))


def test_embedding_rejects_bad_tokens():
    with pytest.raises(ValueError, match="tokens"):
        ops.embedding_forward(poisoned((4, 8)), dev(randn(rng, 4)), dev(randn(rng, 10, 8)))


@pytest.mark.parametrize("N, C, V", [(1, 8, 5), (40, 16, 3), (37, 104, 50), (1000, 768, 1000), (4099, 64, 30000)])
def test_embedding_bf16(N, C, V):
    from llama.runtime.cuda import to_device, zeros
    tokens = rng.integers(0, V, N)
    tokens[: N // 2] = tokens[0]  # one token with many segments
    wte = randn_bf16(rng, V, C)
    out = poisoned_bf16((N, C))
    ops.embedding_forward_bf16(out, dev(tokens), dev_bf16(wte))
    assert np.array_equal(bits(out), embedding_forward(tokens, wte).astype(BF16).view(np.uint16))
    ERRORS.append(("embedding_forward_bf16", 0.0))

    dout, dwte0 = randn_bf16(rng, N, C), rng.standard_normal((V, C)).astype(np.float32)
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
