"""The document bounds kernel (kernels/document_mask.cu, llama/ops/document_mask.py) against its twin
(llama/twins/attention.py's document_bounds), bit for bit: rows without BOS, with BOS at 0, consecutive BOS,
T of 1, not a power of two, and 131072 (128 chunks of the block); outputs poisoned first."""

import numpy as np
import pytest

from llama import ops
from llama.twins.attention import document_bounds

pytestmark = pytest.mark.gpu
BOS = 128000


def rows(T: int, seed: int) -> np.ndarray:
    """Four rows of T tokens: no BOS, BOS at 0 and scattered, runs of consecutive BOS, BOS at the last position."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, (4, T)).astype(np.int32)
    tokens[1, 0] = BOS
    tokens[1, rng.random(T) < 0.01] = BOS
    tokens[2, rng.random(T) < 0.3] = BOS
    tokens[2, T // 2:T // 2 + 3] = BOS
    tokens[3, T - 1] = BOS
    return tokens


@pytest.mark.parametrize("T", [1, 2, 31, 1000, 1024, 1025, 4097, 131072])
def test_document_bounds(T):
    from llama.runtime.cuda import to_device
    tokens = rows(T, T)
    doc_start, doc_end = (to_device(np.full(tokens.shape, -7, dtype=np.int32)) for _ in range(2))
    ops.document_bounds(doc_start, doc_end, to_device(tokens), BOS)
    expected_start, expected_end = document_bounds(tokens, BOS)
    np.testing.assert_array_equal(doc_start.download(), expected_start)
    np.testing.assert_array_equal(doc_end.download(), expected_end)
