"""The GPU sampler (kernels/sample.cu) against the numpy twin's distribution (sampling_probabilities):
greedy ids, draws that depend only on (seed, counter, row), frequencies over many rows, the exact draw
of a Philox4x32-10 twin where every kept id has the same weight, CUDA-graph replay, and the checks."""

import numpy as np
import pytest

from llama.model.sampling import sampling_probabilities
from tests.gpu_helpers import dev

pytestmark = pytest.mark.gpu


def counter(value: int):
    return dev(np.array([value], dtype=np.int32))


def draw(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
         position: int = 0) -> np.ndarray:
    """The ids the kernel draws from (B, V) logits, into an output poisoned with -1."""
    from llama.ops.sample import sample_tokens
    ids = dev(np.full(len(logits), -1, dtype=np.int32))
    sample_tokens(ids, dev(np.asarray(logits, dtype=np.float32)), temperature, top_k, top_p, seed, counter(position))
    return ids.download()


def philox4x32_10(counter4, key2):
    """Philox4x32-10 (Random123's constants), the kernel's generator, in Python integers."""
    mask = 0xFFFFFFFF
    (c0, c1, c2, c3), (k0, k1) = counter4, key2
    for round_ in range(10):
        if round_:
            k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & mask, p1 & mask, ((p0 >> 32) ^ c3 ^ k1) & mask, p0 & mask
    return c0, c1, c2, c3


def uniform_bits(seed: int, position: int, row: int) -> int:
    """The kernel's 64 random bits of a row: u = bits / 2**64."""
    r = philox4x32_10((position & 0xFFFFFFFF, row, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))
    return (r[1] << 32) | r[0]


def test_philox_twin_known_answers():  # Random123's kat_vectors
    m = 0xFFFFFFFF
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((m, m, m, m), (m, m)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


@pytest.mark.parametrize("B, V", [(1, 1), (3, 1000), (4, 1024), (2, 50257), (5, 128256), (64, 3000), (2, 262144)])
def test_greedy_is_the_argmax(B, V):
    rng = np.random.default_rng(V)
    logits = (3 * rng.standard_normal((B, V))).astype(np.float32)
    if V > 1:  # a tie for the largest logit: the smaller index wins, as in np.argmax
        first, second = np.sort(rng.choice(V, 2, replace=False))
        logits[0, second] = logits[0, first] = logits[0].max() + 1
    expected = np.argmax(logits, axis=1)
    assert (draw(logits, 0.0) == expected).all()
    assert (draw(logits, 0.0, top_k=3, top_p=0.5, seed=9) == expected).all()  # temperature 0 ignores the rest
    assert (draw(logits, 1.0, top_p=0.0, seed=5, position=3) == expected).all()  # top_p 0 is greedy


@pytest.mark.parametrize("V", [7, 1000, 50257, 128256])
def test_top_k_1_and_tiny_top_p_give_the_argmax(V):
    rng = np.random.default_rng(V + 1)
    logits = rng.standard_normal((16, V)).astype(np.float32)  # no ties: the largest logit is alone
    expected = np.argmax(logits, axis=1)
    assert (draw(logits, 1.0, top_k=1, seed=1) == expected).all()
    assert (draw(logits, 2.0, top_p=1e-7, seed=2) == expected).all()
    assert (draw(logits, 1.0, top_k=1, top_p=0.5, seed=3) == expected).all()


def test_the_same_seed_and_counter_give_the_same_ids():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((64, 50257)).astype(np.float32)
    for settings in [dict(temperature=1.0), dict(temperature=0.8, top_k=50), dict(temperature=1.2, top_p=0.9),
                     dict(temperature=1.0, top_k=1000, top_p=0.95)]:
        first = draw(logits, seed=123, position=17, **settings)
        assert ((0 <= first) & (first < 50257)).all()
        assert (draw(logits, seed=123, position=17, **settings) == first).all()
        assert (draw(logits, seed=124, position=17, **settings) != first).mean() > 0.5
        assert (draw(logits, seed=123, position=18, **settings) != first).mean() > 0.5
        assert (draw(logits, seed=123 + 2 ** 40, position=17, **settings) != first).mean() > 0.5  # the high word
    same_rows = np.repeat(logits[:1], 64, axis=0)  # the row index is part of the counter
    assert len(set(draw(same_rows, 1.0, seed=1).tolist())) > 32


LOGITS_50 = (1.5 * np.random.default_rng(5).standard_normal(50)).astype(np.float32)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.9, 10, 0.8),
                                                       (1.5, 49, 0.95)])
def test_frequencies_follow_sampling_probabilities(temperature, top_k, top_p):
    n = 8192
    probs = sampling_probabilities(LOGITS_50, temperature, top_k, top_p)
    ids = draw(np.repeat(LOGITS_50[None], n, axis=0), temperature, top_k, top_p, seed=2024, position=11)
    assert ((0 <= ids) & (ids < 50)).all()
    assert set(ids.tolist()) <= set(np.flatnonzero(probs).tolist()), "an id outside the kept support"
    frequencies = np.bincount(ids, minlength=50) / n
    sigma = np.sqrt(probs * (1 - probs) / n)
    worst = np.max(np.abs(frequencies - probs) / (sigma + 1 / n))
    assert worst < 5, f"frequencies {worst:.1f} sigma off sampling_probabilities"
    chi2 = np.sum((frequencies - probs)[probs > 0] ** 2 / probs[probs > 0]) * n
    dof = np.count_nonzero(probs) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10, f"chi-square {chi2:.1f} with {dof} degrees of freedom"


LOGITS_LARGE = (2 * np.random.default_rng(6).standard_normal(128256)).astype(np.float32)


def test_the_nucleus_boundaries_of_these_tests_are_clear():
    """The top_p cases here are not decided by rounding: every partial sum of the sorted probabilities
    is far from top_p, compared with the float32 error of the kernel's sums (about 1e-7)."""
    for logits, temperature, top_k, top_p, margin in [(LOGITS_50, 1.0, 0, 0.8, 1e-3), (LOGITS_50, 0.9, 10, 0.8, 1e-3),
                                                      (LOGITS_50, 1.5, 49, 0.95, 1e-3),
                                                      (LOGITS_LARGE, 1.0, 0, 0.3, 3e-5),
                                                      (LOGITS_LARGE, 1.0, 40, 0.9, 1e-3)]:
        probs = np.sort(sampling_probabilities(logits, temperature, top_k))[::-1]
        assert np.min(np.abs(np.cumsum(probs) - top_p)) > margin


def test_large_vocabulary_stays_in_the_support():
    V, n, logits = 128256, 256, LOGITS_LARGE
    for top_k, top_p in [(5, 1.0), (0, 0.3), (40, 0.9)]:
        probs = sampling_probabilities(logits, 1.0, top_k, top_p)
        ids = draw(np.repeat(logits[None], n, axis=0), 1.0, top_k, top_p, seed=3)
        assert set(ids.tolist()) <= set(np.flatnonzero(probs).tolist())
        frequencies = np.bincount(ids, minlength=V) / n
        assert np.max(np.abs(frequencies - probs) / (np.sqrt(probs * (1 - probs) / n) + 1 / n)) < 5


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.3), (3, 0.01)])
def test_equal_weights_draw_exactly_the_philox_twins_id(top_k, top_p):
    """Kept ids of equal logits have weight 1 each: the kernel draws kept[floor(u * count)] in index
    order, u from Philox4x32-10. Ties at the top-k cutoff are kept, and so are ties at the top-p
    threshold (all of them, where numpy's stable sort would keep only the first ones)."""
    V, B, seed, position = 50257, 64, 0x1234_5678_9ABC_DEF0, 1000
    rng = np.random.default_rng(7)
    kept = np.sort(rng.choice(V, 37, replace=False))
    logits = np.full(V, -60.0, dtype=np.float32)  # weight exp(-63 / 1) rounds to a mass of 0
    logits[rng.choice(V, 1000, replace=False)] = -np.inf
    logits[kept] = 3.0
    ids = draw(np.repeat(logits[None], B, axis=0), 1.0, top_k, top_p, seed=seed, position=position)
    expected = [kept[(uniform_bits(seed, position, b) * len(kept)) >> 64] for b in range(B)]
    assert ids.tolist() == [int(i) for i in expected]


def test_graph_replay_reads_the_counter_from_the_device():
    from llama.runtime.cuda import Graph
    from llama.ops.sample import sample_tokens
    rng = np.random.default_rng(8)
    logits = dev(rng.standard_normal((8, 32000)).astype(np.float32))
    ids, position = dev(np.full(8, -1, dtype=np.int32)), counter(0)
    sample_tokens(ids, logits, 1.0, 40, 0.9, 77, position)  # compiled before the capture
    graph = Graph(lambda: sample_tokens(ids, logits, 1.0, 40, 0.9, 77, position))
    for step in [5, 6, 5]:
        position.upload(np.array([step], dtype=np.int32))
        graph.replay()
        expected = dev(np.full(8, -1, dtype=np.int32))
        sample_tokens(expected, logits, 1.0, 40, 0.9, 77, counter(step))
        assert (ids.download() == expected.download()).all()


def test_bad_inputs():
    from llama.runtime.cuda import BF16, to_device
    from llama.ops.sample import sample_tokens
    logits, ids, position = dev(np.zeros((2, 10))), dev(np.zeros(2, dtype=np.int32)), counter(0)
    good = dict(temperature=1.0, top_k=0, top_p=1.0, seed=0)

    def call(ids=ids, logits=logits, counter=position, **settings):
        sample_tokens(ids, logits, counter=counter, **{**good, **settings})

    call()
    for message, kwargs in [
        ("logits", dict(logits=np.zeros((2, 10), dtype=np.float32))),
        ("logits", dict(logits=dev(np.zeros(10)))),
        ("logits", dict(logits=to_device(np.zeros((2, 10), dtype=BF16)))),
        ("ids", dict(ids=dev(np.zeros(3, dtype=np.int32)))),
        ("ids", dict(ids=dev(np.zeros(2, dtype=np.float32)))),
        ("counter", dict(counter=dev(np.zeros(2, dtype=np.int32)))),
        ("counter", dict(counter=dev(np.zeros(1, dtype=np.float32)))),
        ("temperature", dict(temperature=-0.5)),
        ("temperature", dict(temperature=float("nan"))),
        ("temperature", dict(temperature=float("inf"))),
        ("top_k", dict(top_k=-1)),
        ("top_k", dict(top_k=2.5)),
        ("top_p", dict(top_p=1.5)),
        ("top_p", dict(top_p=-0.1)),
        ("top_p", dict(top_p=float("nan"))),
        ("seed", dict(seed=-1)),
        ("seed", dict(seed=2 ** 64)),
        ("seed", dict(seed=1.0)),
    ]:
        with pytest.raises(ValueError, match=message):
            call(**kwargs)
