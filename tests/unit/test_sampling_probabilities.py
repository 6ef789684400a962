"""sampling_probabilities, the distribution sample_token draws from (and the GPU sampler's reference):
the supports and sums of the sampling rules, and sample_token drawing from it."""

import numpy as np
import pytest

from llama.model.sampling import sample_token, sampling_probabilities

PROBS = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
LOGITS = np.log(PROBS)


@pytest.mark.parametrize("settings, support", [
    (dict(), {0, 1, 2, 3, 4}),
    (dict(top_k=2), {1, 3}),
    (dict(top_p=0.5), {1, 3}),  # 0.4 < 0.5 <= 0.4 + 0.3
    (dict(top_p=0.4), {1}),
    (dict(top_p=0), {1}),  # the likeliest id always stays: greedy
    (dict(top_k=3, top_p=0.9), {1, 3, 4}),
    (dict(temperature=0), {1}),
    (dict(top_k=5), {0, 1, 2, 3, 4}),  # k >= V keeps every id
    (dict(top_k=9, top_p=1.0), {0, 1, 2, 3, 4}),
])
def test_support_and_sum(settings, support):
    probs = sampling_probabilities(LOGITS, **settings)
    assert probs.dtype == np.float64 and probs.shape == (5,)
    assert set(np.flatnonzero(probs).tolist()) == support
    assert probs.sum() == pytest.approx(1.0, abs=1e-12)
    kept = sorted(support)  # the kept ids keep their relative probabilities, renormalized
    np.testing.assert_allclose(probs[kept], PROBS[kept] / PROBS[kept].sum(), rtol=1e-12)


def test_temperature_sharpens_and_flattens():
    for temperature in [0.05, 0.5, 2.0]:
        expected = PROBS ** (1 / temperature) / np.sum(PROBS ** (1 / temperature))
        np.testing.assert_allclose(sampling_probabilities(LOGITS, temperature), expected, rtol=1e-10)
    assert sampling_probabilities(LOGITS, 0.05)[1] > 0.99
    np.testing.assert_array_equal(sampling_probabilities(LOGITS, -1.0), [0, 1, 0, 0, 0])


def test_ties():
    logits = np.array([0.0, 2.0, 1.0, 2.0, 1.0])
    np.testing.assert_array_equal(sampling_probabilities(logits, 0.0), [0, 1, 0, 0, 0])  # argmax: the first
    assert set(np.flatnonzero(sampling_probabilities(logits, top_k=1)).tolist()) == {1, 3}  # ties at the cutoff stay
    assert set(np.flatnonzero(sampling_probabilities(logits, top_k=3)).tolist()) == {1, 2, 3, 4}
    # top_p with ties at the threshold: the first in index order (the GPU sampler keeps them all)
    assert set(np.flatnonzero(sampling_probabilities(logits, top_p=0.3)).tolist()) == {1}
    assert set(np.flatnonzero(sampling_probabilities(logits, top_p=0.6)).tolist()) == {1, 3}


def test_sample_token_draws_from_sampling_probabilities():
    cases = [dict(), dict(temperature=0.7, top_k=3), dict(top_p=0.8), dict(temperature=1.3, top_k=4, top_p=0.9)]
    for settings in cases:
        probs = sampling_probabilities(LOGITS, **settings)
        rng, twin = np.random.default_rng(3), np.random.default_rng(3)
        drawn = [sample_token(LOGITS, rng, **settings) for _ in range(200)]
        assert drawn == [int(twin.choice(5, p=probs)) for _ in range(200)]
    assert sample_token(LOGITS, np.random.default_rng(0), temperature=0) == 1
