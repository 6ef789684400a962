"""The decoder's kernels against float64 references of the same bf16-rounded inputs (GEMVs with their
epilogues, flash-decoding attention, the cache write, the embedding and last residual), and the GPU
decoder against the bf16 training model's full forward: logits at every position, and greedy tokens
(ties aside) for 64 tokens on d12 and a random Llama 3.2 1B."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.runtime.cuda import BF16
from llama.model.generate import generate
from llama.model.sampling import Sampling
from llama.model import reference as ref
from llama.model.base import rope_cos_sin
from llama.params import ParameterLayout
from llama.twins.rope import rope_forward
from llama.twins.swiglu import swiglu_forward
from llama.options import RunOptions
from llama.run.plan import make_plan
from tests.gpu_helpers import ERRORS, bf16_round, check, dev, dev_bf16, poisoned
from tests.gradcheck import rel_error

pytestmark = pytest.mark.gpu

GEMV_SHAPES = [(1, 100, 72), (3, 257, 520), (8, 1000, 2048), (11, 64, 264), (16, 2048, 8192), (1, 50000, 768)]


def scratch(max_rows=4096, records=1 << 20):
    from llama.ops import DecodeScratch
    return DecodeScratch(max_rows, records)


def norm_inputs(rng, B, K):
    """The fp32 stream (B, K), an RMSNorm weight, the StreamNorm of them (the stream's squares as one
    slot per sequence) and the normalized stream in float64, which the kernel rounds to bf16."""
    from llama.ops import StreamNorm
    x = rng.standard_normal((B, K)).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    squares = np.sum(x.astype(np.float64) ** 2, axis=1)
    norm = StreamNorm(dev(weight), dev(squares), 1, 1e-5)
    return x, norm, x / np.sqrt(squares[:, None] / K + 1e-5) * weight


@pytest.mark.parametrize("B, N, K", GEMV_SHAPES)
def test_gemv_logits(B, N, K):
    from llama.ops import gemv_logits
    rng = np.random.default_rng(0)
    x, norm, normalized = norm_inputs(rng, B, K)
    w = rng.standard_normal((N, K)) / np.sqrt(K)
    out = poisoned((B, N))
    gemv_logits(out, dev(x), dev_bf16(w), norm)
    check(f"gemv_logits[{B},{N},{K}]", out, normalized @ bf16_round(w).T, 1e-2)


@pytest.mark.parametrize("B, N, K", [(1, 768, 2048), (5, 200, 520), (16, 2048, 8192), (2, 2048, 2048), (3, 64, 96)])
def test_gemv_residual_and_the_streams_squares(B, N, K):
    from llama.ops import gemv_residual
    rng = np.random.default_rng(1)
    stream = rng.standard_normal((B, N)).astype(np.float32)
    a, w = rng.standard_normal((B, K)), rng.standard_normal((N, K)) / np.sqrt(K)
    expected = stream + bf16_round(a) @ bf16_round(w).T
    stream_d, squares = dev(stream), poisoned(4096 * B)
    slots = gemv_residual(stream_d, squares, dev_bf16(a), dev_bf16(w))
    check(f"gemv_residual[{B},{N},{K}]", stream_d, expected, 1e-6)
    sums = squares.download()[:slots * B].reshape(slots, B).astype(np.float64).sum(axis=0)
    check(f"gemv_residual_squares[{B},{N},{K}]", dev(sums), np.sum(expected ** 2, axis=1), 1e-6)
    # the same inputs give the same bits
    first = stream_d.download()
    stream_d.upload(stream)
    gemv_residual(stream_d, squares, dev_bf16(a), dev_bf16(w))
    assert np.array_equal(stream_d.download(), first)


@pytest.mark.parametrize("B, F, K", [(1, 2048, 768), (4, 200, 136), (9, 8192, 2048), (16, 40, 64)])
def test_gemv_swiglu(B, F, K):
    from llama.ops import gemv_swiglu
    rng = np.random.default_rng(2)
    x, norm, normalized = norm_inputs(rng, B, K)
    w13 = rng.standard_normal((2 * F, K)) / np.sqrt(K)
    out = poisoned((B, F), BF16)
    gemv_swiglu(out, dev(x), dev_bf16(w13), norm)
    check(f"gemv_swiglu[{B},{F},{K}]", out, swiglu_forward(normalized @ bf16_round(w13).T), 1e-2)


@pytest.mark.parametrize("B, H, KV, D, K, p, T_max", [(1, 32, 8, 64, 2048, 0, 16), (3, 4, 2, 16, 72, 7, 9),
                                                       (16, 12, 4, 64, 768, 300, 400), (2, 8, 8, 128, 520, 5, 6)])
def test_gemv_qkv_rope_writes_the_cache_at_the_position(B, H, KV, D, K, p, T_max):
    from llama.ops import gemv_qkv_rope
    config = get_preset("tiny").replace(dim=H * D, n_heads=H, n_kv_heads=KV, rope_original_context=16)
    rng = np.random.default_rng(3)
    x, norm, normalized = norm_inputs(rng, B, K)
    w = rng.standard_normal(((H + 2 * KV) * D, K)) / np.sqrt(K)
    cos, sin = rope_cos_sin(config, T_max)
    q = poisoned((B, H, D))
    k_cache, v_cache = poisoned((B, KV, T_max, D), BF16), poisoned((B, KV, T_max, D), BF16)
    gemv_qkv_rope(q, k_cache, v_cache, dev(x), dev_bf16(w), norm, dev(cos), dev(sin), dev(np.array([p])))
    qkv = (normalized @ bf16_round(w).T)[:, None]  # (B, 1, (H + 2KV) D)
    q_ref, k_ref, v_ref = rope_forward(qkv, cos[p:], sin[p:], H, KV)
    check(f"gemv_qkv_rope_q[{B},{H},{KV},{D}]", q, q_ref[:, :, 0], 1e-2)
    for name, cache, expected in (("k", k_cache, k_ref), ("v", v_cache, v_ref)):
        got = cache.download().astype(np.float64)
        rel = rel_error(got[:, :, p], expected[:, :, 0])
        ERRORS.append((f"gemv_qkv_rope_{name}[{B},{H},{KV},{D}]", rel))
        assert rel < 1e-2
        assert np.isnan(np.delete(got, p, axis=2)).all(), "wrote outside position p"


@pytest.mark.parametrize("B, n, H, KV, D, p, T_max", [
    (1, 1, 32, 8, 64, 600, 1024),   # decode, split along the keys (3 of 4 ranges in use)
    (1, 1, 32, 8, 64, 100, 1024),   # decode, a cache short enough for one range of 4
    (2, 1, 6, 2, 24, 3000, 3100),   # many tiles per split, head_dim not a power of two
    (3, 37, 8, 8, 64, 0, 40),       # a prefill chunk from the start, no grouping
    (2, 5, 4, 2, 16, 3, 12),        # a chunk in the middle of the cache
    (1, 1, 8, 1, 128, 0, 4),        # the first position, 8 heads per kv head
])
@pytest.mark.parametrize("q_dtype", ["f32", "bf16"])
def test_decode_attention(B, n, H, KV, D, p, T_max, q_dtype):
    from llama.ops import decode_attention
    rng = np.random.default_rng(4)
    k = rng.standard_normal((B, KV, T_max, D))
    v = rng.standard_normal((B, KV, T_max, D))
    k[:, :, p + n:] = np.nan  # positions past the new ones must not be read
    v[:, :, p + n:] = np.nan
    qkv = rng.standard_normal((B, n, (H + 2 * KV) * D))
    q_heads = qkv[:, :, :H * D].reshape(B, n, H, D)
    q = dev(q_heads) if q_dtype == "f32" else dev_bf16(qkv)
    q_seen = q_heads if q_dtype == "f32" else bf16_round(q_heads)
    out = poisoned((B, n, H * D), BF16)
    decode_attention(out, q, dev_bf16(k), dev_bf16(v), dev(np.array([p])), scratch())
    expected = ref.decode_attention(q_seen.transpose(0, 2, 1, 3), bf16_round(k[:, :, :p + n]),
                                    bf16_round(v[:, :, :p + n]), p)
    check(f"decode_attention[{q_dtype},B={B},n={n},p={p},D={D}]", out, expected, 1e-2)


def test_cache_write_embedding_and_last_residual():
    from llama.ops import cache_write, embed_tokens, last_residual
    rng = np.random.default_rng(5)
    B, n, H, KV, D, T_max, p = 2, 3, 4, 2, 16, 10, 6
    qkv = rng.standard_normal((B, n, (H + 2 * KV) * D))
    k_cache, v_cache = poisoned((B, KV, T_max, D), BF16), poisoned((B, KV, T_max, D), BF16)
    cache_write(k_cache, v_cache, dev_bf16(qkv), H, dev(np.array([p])))
    heads = bf16_round(qkv).reshape(B, n, H + 2 * KV, D).transpose(0, 2, 1, 3)
    for cache, expected in ((k_cache, heads[:, H:H + KV]), (v_cache, heads[:, H + KV:])):
        got = cache.download().astype(np.float64)
        assert np.array_equal(got[:, :, p:p + n], expected)
        assert np.isnan(np.delete(got, np.s_[p:p + n], axis=2)).all()
    wte, tokens = rng.standard_normal((50, 40)), np.array([7, 49, 0])
    x, squares = poisoned((3, 40)), poisoned(3)
    embed_tokens(x, squares, dev(tokens), dev_bf16(wte))
    rows = bf16_round(wte)[tokens]
    check("embed_tokens", x, rows, 1e-7)
    check("embed_tokens_squares", squares, np.sum(rows ** 2, axis=1), 1e-6)
    h, branch = rng.standard_normal((3, 5, 40)), rng.standard_normal((3, 5, 40))
    last_residual(x, squares, dev_bf16(h), dev_bf16(branch))
    last = bf16_round(h)[:, -1] + bf16_round(branch)[:, -1]
    check("last_residual", x, last, 1e-7)
    check("last_residual_squares", squares, np.sum(last ** 2, axis=1), 1e-6)


CONFIG = get_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=512, max_seq_len=64,
                                    rope_original_context=16)


def bf16_model(config, B, T, params):
    from llama.model.gpu_bf16 import GPUModelBF16
    return GPUModelBF16(config, make_plan(config, RunOptions("cuda", "bf16")), (B, T), params=params)


def decoder_of(model, batch, max_len):
    from llama.model.gpu_decoder import GPUDecoder
    return GPUDecoder(model.config, model.plan, model.master_weights(), batch=batch, max_len=max_len,
                      weights=model.params_bf16)


@pytest.mark.parametrize("chunks", [[1] * 40, [7] + [1] * 33, [40], [16, 3, 21]])
def test_decoder_matches_the_full_forward_at_every_position(chunks):
    rng = np.random.default_rng(6)
    params = (0.1 * rng.standard_normal(ParameterLayout(CONFIG).size)).astype(np.float32) + 0.02
    model = bf16_model(CONFIG, 2, 40, params)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, 40))
    model.forward(tokens)
    full = model.read_logits()
    decoder = decoder_of(model, 2, 40)
    worst, start = 0.0, 0
    for n in chunks:  # one position after the first: the decode step's GEMVs; more: the prefill's kernels
        logits = decoder.forward(tokens[:, start:start + n])
        start += n
        worst = max(worst, rel_error(logits, full[:, start - 1]))
    ERRORS.append((f"gpu_decoder_logits[{'+'.join(map(str, chunks[:3]))}..]", worst))
    assert worst < 3e-2


def random_params(size: int, seed: int) -> np.ndarray:
    """N(0, 0.02) weights without drawing a billion normals: one random block, repeated; norms at 1."""
    block = (0.02 * np.random.default_rng(seed).standard_normal((1 << 20) + 7)).astype(np.float32)
    return np.resize(block, size)


@pytest.mark.parametrize("preset", ["d12", "llama3.2-1b"])
def test_greedy_decode_gives_the_full_forwards_tokens(preset):
    """64 greedy tokens from the graph-captured decoder; one bf16 training forward over the prompt and
    those tokens must pick the same token at every position, except where its top two logits are
    within `tie` (a different pick there is a tie, and the decoder's sequence goes on)."""
    config = get_preset(preset).replace(max_seq_len=128)
    layout = ParameterLayout(config)
    params = random_params(layout.size, 7)
    for name in layout.norm_names():
        t = layout.tensors[name]
        params[t.offset:t.offset + t.size] = 1.0
    prompt = list(np.random.default_rng(8).integers(0, config.vocab_size, 16))
    model = bf16_model(config, 1, len(prompt) + 64, params)
    result = generate(decoder_of(model, 1, len(prompt) + 64), prompt, 64, Sampling(temperature=0))
    assert len(result.tokens) == 64
    sequence = prompt + result.tokens
    model.forward(np.array([sequence[:-1]]))
    logits = model.read_logits()[0, len(prompt) - 1:].astype(np.float64)  # the 64 positions that drew a token
    top2 = np.sort(logits, axis=-1)[:, -2:]
    tie = 0.05
    decisive = top2[:, 1] - top2[:, 0] >= tie
    picks = np.argmax(logits, axis=-1)
    mismatched = [i for i in range(64) if picks[i] != result.tokens[i] and decisive[i]]
    assert not mismatched, f"positions {mismatched} differ with margins {(top2[:, 1] - top2[:, 0])[mismatched]}"
    assert decisive.sum() >= 32, f"only {decisive.sum()} of 64 positions have a top-2 margin of {tie}"


def test_sampled_generation_is_seeded():
    rng = np.random.default_rng(9)
    params = (0.1 * rng.standard_normal(ParameterLayout(CONFIG).size)).astype(np.float32)
    model = bf16_model(CONFIG, 1, 48, params)
    decoder = decoder_of(model, 1, 48)
    draw = lambda seed: generate(decoder, [5, 17, 123], 40, Sampling(temperature=1.0, top_p=0.95, seed=seed)).tokens
    first = draw(1)
    assert draw(1) == first  # the graph captured by the first call replays the same draws
    assert draw(2) != first
    assert len(set(first)) > 5


def test_bad_inputs():
    from llama.model.gpu_decoder import GPUDecoder
    from llama.ops import decode_attention
    model = bf16_model(CONFIG, 1, 8, None)
    decoder = decoder_of(model, 1, 8)
    with pytest.raises(ValueError, match="do not fit"):
        decoder.forward(np.zeros((1, 9), dtype=np.int64))
    with pytest.raises(ValueError, match="outside"):
        decoder.forward(np.full((1, 2), CONFIG.vocab_size))
    with pytest.raises(ValueError, match="float32 device array"):
        GPUDecoder(CONFIG, model.plan, dev(np.zeros(10)))
    with pytest.raises(ValueError, match="1 to 16 sequences"):
        GPUDecoder(CONFIG, model.plan, model.master_weights(), batch=17)
    with pytest.raises(ValueError, match="continues from prefill"):
        decoder.decode(1, Sampling())
    with pytest.raises(ValueError, match="query heads"):
        decode_attention(poisoned((1, 1, 64), BF16), poisoned((1, 1, 4, 16)), decoder.k_cache[0],
                         decoder.v_cache[0], dev(np.array([0])), decoder.scratch)


def test_trainer_samples_through_the_gpu_decoder(corpus, capsys):
    from tests.runs import run
    assert run("-e", "tiny", "-b", "4", "-t", "32", "-s", "2", "-g", "8", "-v", "0", "-x", "3", *corpus, "-o", "out",
               device="cuda") == 0
    assert "--- sample at step 2 ---" in capsys.readouterr().out


def test_dependent_launches_change_no_bit(monkeypatch):
    """The decode kernels launched as programmatic dependents (each may start before the one before it
    ends, kernels/common.cuh) give the bits of ordinary launches, eagerly and replayed from the graph; the
    dependent launches did happen (on sm_90), so the comparison is not of ordinary launches twice."""
    from llama.runtime import cuda
    rng = np.random.default_rng(10)
    params = (0.1 * rng.standard_normal(ParameterLayout(CONFIG).size)).astype(np.float32)
    model = bf16_model(CONFIG, 2, 48, params)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, 12))
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=3)
    launch_ex, dependent = cuda.Kernel._launch_ex, [0]

    def counting_launch(self, grid, block, args, shared, is_dependent, cluster):
        dependent[0] += is_dependent
        launch_ex(self, grid, block, args, shared, is_dependent, cluster)

    monkeypatch.setattr(cuda.Kernel, "_launch_ex", counting_launch)
    runs = []
    for on in (True, False):
        monkeypatch.setitem(cuda.DEPENDENT_LAUNCHES, "on", on)
        decoder = decoder_of(model, 2, 48)
        eager = np.stack([decoder.forward(tokens[:, i:i + 1]) for i in range(12)])
        decoder.reset()
        decoder.prefill(tokens[:, :4], sampling)
        drawn = decoder.decode(30, sampling)
        runs.append((eager, drawn, decoder.step["logits"].download()))
        if on:
            assert (dependent[0] > 0) == cuda.runtime().dependent_launches
    for with_overlap, without in zip(*runs):
        np.testing.assert_array_equal(with_overlap.view(np.uint8), without.view(np.uint8))
