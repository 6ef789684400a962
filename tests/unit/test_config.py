import json

import numpy as np
import pytest

from llama.config import PRESETS, ConfigError, LlamaConfig, get_preset
from llama.params import ParameterLayout, count_parameters
from llama.model.base import apply_rope_scaling, rope_frequencies


@pytest.mark.parametrize("name, hidden, params", [
    ("llama3.1-8b", 14336, 8_030_261_248),
    ("llama3.2-1b", 8192, 1_235_814_400),
    ("llama3.2-3b", 8192, 3_212_749_824),
])
def test_meta_shapes(name, hidden, params):
    config = get_preset(name)
    assert config.ffn_hidden_dim == hidden
    assert count_parameters(config) == params


def test_d12_preset():
    c = get_preset("d12")
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_hidden_dim) == (768, 12, 12, 4, 64, 2048)


@pytest.mark.parametrize("changes, message", [
    ({"n_heads": 5, "dim": 40}, "divisible by n_kv_heads"),
    ({"dim": 100, "n_heads": 8, "n_kv_heads": 8}, "divisible by n_heads"),
    ({"dim": 36, "n_heads": 4, "n_kv_heads": 2}, "must be even"),
    ({"n_layers": 0}, "n_layers must be a positive integer"),
    ({"vocab_size": -3}, "vocab_size must be a positive integer"),
    ({"dim": 64.0}, "dim must be a positive integer"),
    ({"norm_eps": 0.0}, "norm_eps must be positive"),
    ({"ffn_dim_multiplier": -1.0}, "ffn_dim_multiplier must be positive"),
])
def test_bad_configs_fail_clearly(changes, message):
    with pytest.raises(ConfigError, match=message):
        get_preset("tiny").replace(**changes)


def test_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'.*d12"):
        get_preset("gpt5")
    with pytest.raises(ConfigError, match="unknown config field"):
        LlamaConfig.from_dict({"dim": 64, "n_embd": 3})


def test_json_round_trip(tmp_path):
    for config in PRESETS.values():
        path = tmp_path / "config.json"
        config.save(path)
        assert LlamaConfig.load(path) == config
        assert json.loads(path.read_text())["dim"] == config.dim
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        LlamaConfig.load(path)


def meta_apply_scaling(freqs, scale_factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's loop from llama-models (models/llama3/model.py), written out per frequency."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out, branches = [], set()
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
            branches.add("keep")
        elif wavelen > low_freq_wavelen:
            out.append(freq / scale_factor)
            branches.add("divide")
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / scale_factor + smooth * freq)
            branches.add("blend")
    return np.array(out), branches


@pytest.mark.parametrize("preset", ["llama3.1-8b", "llama3.2-1b"])
def test_rope_scaling_matches_meta_on_all_three_branches(preset):
    c = get_preset(preset)
    raw = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim)
    expected, branches = meta_apply_scaling(raw, c.rope_scale_factor, c.rope_low_freq_factor,
                                            c.rope_high_freq_factor, c.rope_original_context)
    assert branches == {"keep", "divide", "blend"}
    np.testing.assert_allclose(rope_frequencies(c), expected, rtol=1e-15)
    np.testing.assert_allclose(apply_rope_scaling(raw, c.rope_scale_factor, 1.0, 4.0, 8192), expected, rtol=1e-15)
    assert np.array_equal(rope_frequencies(c.replace(use_scaled_rope=False)), raw)


def test_layout_fuses_adjacent_projections():
    c = get_preset("tiny")
    layout = ParameterLayout(c)
    flat = np.arange(layout.size, dtype=np.float64)
    views = layout.views(flat)
    wqkv = layout.wqkv(1)
    fused = flat[wqkv.offset:wqkv.offset + wqkv.size].reshape(wqkv.shape)
    expected = np.concatenate([views[f"layers.1.attention.w{x}.weight"] for x in "qkv"])
    assert np.array_equal(fused, expected)
    w13 = layout.w13(0)
    fused = flat[w13.offset:w13.offset + w13.size].reshape(w13.shape)
    assert np.array_equal(fused, np.concatenate([views["layers.0.feed_forward.w1.weight"],
                                                 views["layers.0.feed_forward.w3.weight"]]))
    mask = layout.decay_mask()
    assert mask.sum() == layout.size - (2 * c.n_layers + 1) * c.dim
    assert layout.output().name == "output.weight"
    assert ParameterLayout(c.replace(tie_embeddings=True)).output().name == "tok_embeddings.weight"
