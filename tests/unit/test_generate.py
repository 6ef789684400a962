"""Generation with a KV cache on the CPU: the cached decoder against the full forward at every
position, greedy generation both ways, and the sampling rules."""

import io

import numpy as np
import pytest

from llama.config import get_preset
from llama.model.generate import TextStream, decoder_for, generate
from llama.model.sampling import Sampling, sample_token
from llama.options import RunOptions
from llama.run.plan import cpu_plan, make_plan
from llama.model.reference import ReferenceDecoder
from llama.model.reference import ReferenceModel
from llama.data.tokenizer import ByteTokenizer
from tests.gradcheck import rel_error

CONFIG = get_preset("tiny").replace(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=120, max_seq_len=48,
                                    rope_original_context=16)


def random_model(dtype, seed=0):
    model = ReferenceModel(CONFIG, cpu_plan(), dtype=dtype, seed=seed)
    model.params += (0.1 * np.random.default_rng(seed).standard_normal(model.params.size)).astype(dtype)
    return model


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 1e-6)])
@pytest.mark.parametrize("chunks", [[1] * 21, [7] + [1] * 14, [5, 1, 9, 6], [21]])
def test_cached_logits_equal_the_full_forward_at_every_position(dtype, tol, chunks):
    model = random_model(dtype)
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, sum(chunks)))
    model.forward(tokens)
    full = model.read_logits()
    decoder = ReferenceDecoder(CONFIG, model.params, batch=2, max_len=32)
    worst, start = 0.0, 0
    for n in chunks:
        logits = decoder.forward(tokens[:, start:start + n])
        start += n
        assert decoder.position == start
        worst = max(worst, rel_error(logits, full[:, start - 1]))
    assert worst < tol, worst


def test_greedy_generation_is_the_same_with_and_without_the_cache():
    model = random_model(np.float32, seed=2)
    prompt = [3, 14, 15, 92, 65]
    result = generate(ReferenceDecoder(CONFIG, model.params, max_len=40), prompt, 20, Sampling(temperature=0))
    ids = list(prompt)
    for _ in range(20):  # no cache: the whole sequence again for every token
        model.forward(np.array([ids]))
        ids.append(int(np.argmax(model.read_logits(position=len(ids) - 1)[0])))
    assert result.tokens == ids[len(prompt):]
    assert result.prompt_tokens == 5 and "tokens/s" in result.speeds()


def test_generation_stops_at_a_stop_id_or_a_full_cache():
    model = random_model(np.float32, seed=3)
    decoder = decoder_for(model, make_plan(CONFIG, RunOptions("cpu")), max_len=12)
    free = generate(decoder, [1, 2, 3], 50, Sampling(temperature=0))
    assert len(free.tokens) == 10 and decoder.position == 12  # 12 positions: 3 prompt + 9 decoded, 1 more drawn
    stop = free.tokens[4]
    stopped = generate(decoder, [1, 2, 3], 50, Sampling(temperature=0), stop_ids=(stop,))
    assert stopped.tokens == free.tokens[:free.tokens.index(stop) + 1]
    with pytest.raises(ValueError, match="the prompt must hold 1 to 12 tokens"):
        generate(decoder, list(range(13)), 5, Sampling())
    with pytest.raises(ValueError, match="do not fit: batch 1"):
        decoder.forward(np.zeros((2, 1), dtype=np.int64))


def test_sampling_is_seeded_and_follows_top_k_and_top_p():
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))
    draw = lambda rng, **kw: [sample_token(logits, rng, **kw) for _ in range(400)]
    assert draw(np.random.default_rng(7)) == draw(np.random.default_rng(7))
    assert set(draw(np.random.default_rng(0))) == {0, 1, 2, 3, 4}
    assert set(draw(np.random.default_rng(0), top_k=2)) == {1, 3}
    assert set(draw(np.random.default_rng(0), top_p=0.5)) == {1, 3}  # 0.4 < 0.5 <= 0.4 + 0.3
    assert set(draw(np.random.default_rng(0), top_p=0.4)) == {1}
    assert set(draw(np.random.default_rng(0), top_p=0)) == {1}  # the likeliest id always stays: greedy
    assert set(draw(np.random.default_rng(0), top_k=3, top_p=0.9)) == {1, 3, 4}
    assert sample_token(logits, np.random.default_rng(0), temperature=0) == 1
    low = draw(np.random.default_rng(0), temperature=0.05)  # sharp: nearly always the best
    assert low.count(1) > 390


def test_text_stream_holds_back_split_characters():
    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), out)
    for b in "ü🦙".encode():
        stream(b)
        assert "\ufffd" not in out.getvalue()
    assert out.getvalue() == "ü🦙"
