"""The KV-cache kernels (kernels/decode.cu) against float64 references, and the GPU decoder against
the GPU model's full forward at every position (fp32 and bf16 caches)."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.cuda import BF16
from llama.generate import generate
from llama.params import ParameterLayout
from llama.model.base import rope_cos_sin
from llama.model import reference as ref
from tests.gpu_helpers import ERRORS, dev, poisoned
from tests.gradcheck import rel_error
from tests.runs import run

pytestmark = pytest.mark.gpu


def record(name: str, got: np.ndarray, expected: np.ndarray, tol: float) -> None:
    assert np.isfinite(got).all(), f"{name}: NaN/inf (unwritten elements?)"
    err = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
    ERRORS.append((name, err))
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"


def poisoned_cache(shape, dtype):
    from llama.cuda import to_device
    return to_device(np.full(shape, np.nan, dtype=np.float32).astype(dtype))


@pytest.mark.parametrize("cache_dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("B, n, H, KV, D, p0, T_max", [(2, 5, 4, 2, 16, 3, 12), (1, 1, 6, 2, 24, 40, 41),
                                                        (3, 37, 8, 8, 64, 0, 40)])
def test_rope_kv_write(cache_dtype, B, n, H, KV, D, p0, T_max):
    from llama.ops import rope_kv_write
    config = get_preset("tiny").replace(dim=H * D, n_heads=H, n_kv_heads=KV, rope_original_context=16)
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, n, (H + 2 * KV) * D)).astype(np.float32)
    cos, sin = rope_cos_sin(config, T_max)
    q_d, k_d, v_d = poisoned((B, H, n, D)), poisoned_cache((B, KV, T_max, D), cache_dtype), \
        poisoned_cache((B, KV, T_max, D), cache_dtype)
    rope_kv_write(q_d, k_d, v_d, dev(qkv), dev(cos), dev(sin), p0)
    q, k, v = ref.rope_forward(qkv.astype(np.float64), cos[p0:], sin[p0:], H, KV)
    tol = 1e-6 if cache_dtype == np.float32 else 1e-2  # the caches round to bf16
    record(f"rope_kv_write_q[{B},{n},{p0}]", q_d.download().astype(np.float64), q, 1e-6)
    for name, cache, expected in (("k", k_d, k), ("v", v_d, v)):
        got = cache.download().astype(np.float64)
        record(f"rope_kv_write_{name}[{np.dtype(cache_dtype).name}]", got[:, :, p0:p0 + n], expected, tol)
        assert np.isnan(np.delete(got, np.s_[p0:p0 + n], axis=2)).all(), "wrote outside positions p0..p0+n-1"


@pytest.mark.parametrize("cache_dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("B, n, H, KV, D, p0, T_max", [
    (2, 5, 4, 2, 16, 3, 12),      # several new queries in the middle of the cache
    (1, 1, 6, 2, 24, 300, 400),   # decode past one tile of keys, head_dim not a power of two
    (3, 37, 8, 8, 64, 0, 40),     # prefill, no grouping
    (1, 1, 8, 2, 128, 1000, 1100),
])
def test_decode_attention(cache_dtype, B, n, H, KV, D, p0, T_max):
    from llama.cuda import to_device
    from llama.ops import decode_attention
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, H, n, D)).astype(np.float32)
    k = rng.standard_normal((B, KV, T_max, D)).astype(cache_dtype)
    v = rng.standard_normal((B, KV, T_max, D)).astype(cache_dtype)
    k[:, :, p0 + n:] = np.nan  # positions past the new ones must not be read
    v[:, :, p0 + n:] = np.nan
    out = poisoned((B, n, H * D))
    decode_attention(out, dev(q), to_device(k), to_device(v), p0)
    expected = ref.decode_attention(q.astype(np.float64), k[:, :, :p0 + n].astype(np.float64),
                                v[:, :, :p0 + n].astype(np.float64), p0)
    record(f"decode_attention[{np.dtype(cache_dtype).name},n={n},p0={p0},D={D}]",
           out.download().astype(np.float64), expected, 1e-5)


CONFIG = get_preset("tiny").replace(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=300, max_seq_len=64,
                                    rope_original_context=16)


@pytest.mark.parametrize("cache_dtype, tol", [(np.float32, 1e-5), (BF16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("chunks", [[1] * 40, [7] + [1] * 33, [40]])
def test_decoder_matches_the_full_forward_at_every_position(cache_dtype, tol, chunks):
    from llama.model.gpu_decoder import GPUDecoder
    from llama.model.gpu_fp32 import GPUModelFP32
    rng = np.random.default_rng(2)
    params = (0.1 * rng.standard_normal(ParameterLayout(CONFIG).size)).astype(np.float32) + 0.02
    model = GPUModelFP32(CONFIG, B=2, T=40, params=params)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, 40))
    model.forward(tokens)
    full = model.read_logits()
    decoder = GPUDecoder(CONFIG, model.params, batch=2, max_len=40, chunk=16, cache_dtype=cache_dtype)
    worst, start = 0.0, 0
    for n in chunks:  # [40] runs as chunks of 16, 16 and 8
        logits = decoder.forward(tokens[:, start:start + n])
        start += n
        worst = max(worst, rel_error(logits, full[:, start - 1]))
    ERRORS.append((f"gpu_decoder_logits[{np.dtype(cache_dtype).name}]", worst))
    assert worst < tol


def test_greedy_decode_matches_full_forwards():
    from llama.model.gpu_decoder import GPUDecoder
    from llama.model.gpu_fp32 import GPUModelFP32
    rng = np.random.default_rng(3)
    params = (0.1 * rng.standard_normal(ParameterLayout(CONFIG).size)).astype(np.float32)
    model = GPUModelFP32(CONFIG, B=1, T=32, params=params)
    prompt = [5, 17, 123, 9]
    result = generate(GPUDecoder(CONFIG, model.params, max_len=32, cache_dtype=np.float32), prompt, 16,
                      np.random.default_rng(0), temperature=0)
    ids = list(prompt)
    for _ in range(16):
        model.forward(np.array([ids]))
        ids.append(int(np.argmax(model.read_logits(position=len(ids) - 1)[0])))
    assert result.tokens == ids[len(prompt):]


def test_bad_inputs():
    from llama.model.gpu_decoder import GPUDecoder
    from llama.ops import decode_attention
    from llama.model.gpu_fp32 import GPUModelFP32
    model = GPUModelFP32(CONFIG, B=1, T=8)
    decoder = GPUDecoder(CONFIG, model.params, BF16, batch=1, max_len=8)
    with pytest.raises(ValueError, match="do not fit"):
        decoder.forward(np.zeros((1, 9), dtype=np.int64))
    with pytest.raises(ValueError, match="outside"):
        decoder.forward(np.full((1, 2), 300))
    with pytest.raises(ValueError, match="float32 device array"):
        GPUDecoder(CONFIG, dev(np.zeros(10)), BF16)
    with pytest.raises(ValueError, match="do not fit the cache"):
        decode_attention(poisoned((1, 2, 64)), poisoned((1, 4, 2, 16)), decoder.k_cache[0], decoder.v_cache[0], 7)


def test_trainer_samples_through_the_gpu_decoder(corpus, capsys):
    assert run("-e", "tiny", "-b", "4", "-t", "32", "-s", "2", "-g", "8", "-v", "0", "-x", "3", *corpus, "-o", "out",
               device="cuda") == 0
    assert "--- sample at step 2 ---" in capsys.readouterr().out
