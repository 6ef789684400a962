"""The random initialization's host twin (llama/twins/init.py, scaled per tensor by llama/params.py): Philox4x32-10 against Random123's known
answers, the float64 transform against libm, normals that depend only on (seed, offset), their
distribution, and each tensor's rule (std, scaled output projections, norms of 1, tied embeddings)."""

import math
import re

import numpy as np
import pytest

import llama.twins.init as twin
from llama.config import get_preset
from llama.runtime.kernel_build import kernel_dir
from llama.params import INIT_STD, ParameterLayout, init_parameters
from llama.twins.init import _cos_sin_of_uniform, _log_of_uniform, philox4x32_10, standard_normals

M = 0xFFFFFFFF


@pytest.mark.parametrize("counter, key, expected", [  # Random123's kat_vectors for philox4x32_10
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M, M, M, M), (M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == expected


def test_philox_over_arrays_is_philox_of_each_counter():
    counters = np.array([[0, 0, 0, 0], [M, M, M, M], [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [7, 1, 2, 3]])
    together = np.stack(philox4x32_10(counters.T, (0xA4093822, 0x299F31D0)), axis=1)
    for row, words in zip(counters, together):
        assert tuple(words) == philox4x32_10(tuple(row), (0xA4093822, 0x299F31D0))


def test_transform_matches_libm():
    words = np.concatenate([np.array([0, 1, 2, 1 << 29, (1 << 30) - 1, 1 << 30, 1 << 31, M - 1, M], np.uint64),
                            np.random.default_rng(0).integers(0, 1 << 32, 100_000, dtype=np.uint64)])
    u = (words.astype(np.float64) + 0.5) / 2.0 ** 32
    assert np.allclose(_log_of_uniform(words), np.log(u), rtol=2e-15, atol=0)
    angle = 2 * np.pi * words.astype(np.float64) / 2.0 ** 32
    cos, sin = _cos_sin_of_uniform(words)
    assert np.max(np.abs(cos - np.cos(angle))) < 2e-15 and np.max(np.abs(sin - np.sin(angle))) < 2e-15


@pytest.mark.parametrize("start, n", [(0, 1), (3, 1), (5, 11), (1 << 33, 9), (1001, 4096)])
def test_normals_depend_only_on_seed_and_offset(start, n):
    whole = standard_normals(7, start - start % 4, n + 8)
    assert np.array_equal(standard_normals(7, start, n), whole[start % 4:start % 4 + n])
    assert not np.array_equal(standard_normals(8, start, n), standard_normals(7, start, n))


def test_normals_are_standard_normal():
    z = standard_normals(0, 0, 1 << 20)
    n = z.size
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    assert abs(np.mean(z ** 3)) < 5 * math.sqrt(15 / n)
    assert abs(np.mean(z ** 4) - 3) < 5 * math.sqrt(96 / n)
    for k in (0.5, 1, 2, 3):  # the tails, each against erf within 5 standard errors
        p = math.erfc(k / math.sqrt(2))
        assert abs(np.mean(np.abs(z) > k) - p) < 5 * math.sqrt(p * (1 - p) / n)
    lanes = z.reshape(-1, 4)  # the 4 lanes of a Philox block, and neighbouring blocks, are uncorrelated
    for a, b in ((0, 1), (0, 2), (1, 3)):
        assert abs(np.corrcoef(lanes[:, a], lanes[:, b])[0, 1]) < 5 / math.sqrt(len(lanes))
    assert abs(np.corrcoef(lanes[:-1, 0], lanes[1:, 0])[0, 1]) < 5 / math.sqrt(len(lanes))


@pytest.mark.parametrize("preset", ["small", "tiny"])
def test_each_tensor_follows_its_rule(preset):
    config = get_preset(preset).replace(vocab_size=1000)
    layout = ParameterLayout(config)
    params = init_parameters(config, seed=3)
    assert params.dtype == np.float32
    residual_std = INIT_STD / math.sqrt(2 * config.n_layers)
    for name, view in layout.views(params).items():
        t = layout.tensors[name]
        if view.ndim == 1:
            assert np.all(view == 1.0), name
            continue
        std = residual_std if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
        expected = (standard_normals(3, t.offset, t.size) * std).astype(np.float32).reshape(t.shape)
        assert np.array_equal(view, expected), name
        assert abs(view.std() / std - 1) < 6 / math.sqrt(2 * view.size), name


def test_tied_embeddings_have_one_table_and_seeds_differ():
    config = get_preset("tiny").replace(vocab_size=500, tie_embeddings=True)
    params = init_parameters(config, seed=1)
    assert "output.weight" not in ParameterLayout(config).tensors and params.size == ParameterLayout(config).size
    assert np.array_equal(params, init_parameters(config, seed=1))
    assert not np.array_equal(params, init_parameters(config, seed=2))


def test_progress_counts_every_value():
    config = get_preset("tiny").replace(vocab_size=300)
    counted = []
    init_parameters(config, on_tensor=counted.append)
    assert sum(counted) == ParameterLayout(config).size


def test_kernel_has_the_twins_constants():
    source = (kernel_dir() / "init.cu").read_text()
    for name in ("LOG_SERIES", "SIN_SERIES", "COS_SERIES"):
        body = re.search(rf"{name}\[\d+\] = \{{([^}}]*)\}}", source).group(1)
        assert tuple(float(x) for x in body.split(",")) == getattr(twin, name), name
    for name in ("LN2", "SQRT_HALF", "ANGLE_UNIT"):
        assert float(re.search(rf"#define {name} (\S+)", source).group(1)) == getattr(twin, name), name
    assert int(re.search(r"#define INIT_STREAM (\w+)u", source).group(1), 16) == twin.INIT_STREAM
