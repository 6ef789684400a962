"""The reference against transformers' LlamaForCausalLM with the same random weights (optional).

Skipped where torch or transformers is missing. Meta's q/k rows are permuted to HF's rotate-half
layout on the way in and back on the way out.
"""

import numpy as np
import pytest

from llama import reference as ref
from llama.config import get_preset
from tests.gradcheck import rel_error

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def meta_to_hf(w, n_heads):
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def hf_to_meta(w, n_heads):
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


HF_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head",
            "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
            "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
            "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
            "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm"}


def hf_name(name):
    base = name.removesuffix(".weight")
    if base.startswith("layers."):
        _, i, rest = base.split(".", 2)
        return f"model.layers.{i}.{HF_NAMES[rest]}.weight"
    return HF_NAMES[base] + ".weight"


def hf_model(config):
    rope = {"rope_type": "llama3", "factor": config.rope_scale_factor,
            "low_freq_factor": config.rope_low_freq_factor, "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_context}
    kwargs = dict(vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_hidden_dim,
                  num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                  num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.norm_eps,
                  max_position_embeddings=config.max_seq_len, tie_word_embeddings=config.tie_embeddings,
                  attention_bias=False, mlp_bias=False)
    if "rope_parameters" in transformers.LlamaConfig().to_dict():
        kwargs["rope_parameters"] = {**rope, "rope_theta": config.rope_theta}
    else:
        kwargs.update(rope_scaling=rope, rope_theta=config.rope_theta)
    hf_config = transformers.LlamaConfig(**kwargs)
    hf_config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(hf_config).double().eval()


@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_gradients_match_transformers(tied):
    # factor 8 with a short original context, so all three RoPE scaling branches are exercised
    config = get_preset("tiny").replace(dim=64, n_heads=4, n_kv_heads=2, vocab_size=101, tie_embeddings=tied,
                                        rope_original_context=64, rope_theta=10000.0)
    model = ref.ReferenceModel(config, dtype=np.float64, seed=7)
    model.params += 0.05 * np.random.default_rng(0).standard_normal(model.params.size)
    rng = np.random.default_rng(1)
    tokens, targets = rng.integers(0, 101, (2, 24)), rng.integers(0, 101, (2, 24))
    loss = model.forward(tokens, targets)
    logits = model.read_logits()
    model.backward()

    hf = hf_model(config)
    # HF computes RoPE frequencies and angles, RMSNorm and softmax in float32 even in a float64
    # model, so agreement stops near 1e-7: the tolerances below sit just above that floor
    np.testing.assert_allclose(hf.model.rotary_emb.inv_freq.numpy(), ref.rope_frequencies(config), rtol=1e-6)
    state = {}
    for name, w in model.p.items():
        if "wq" in name:
            w = meta_to_hf(w, config.n_heads)
        elif "wk" in name:
            w = meta_to_hf(w, config.n_kv_heads)
        state[hf_name(name)] = torch.tensor(w)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf_logits = hf(torch.tensor(tokens)).logits
    hf_loss = torch.nn.functional.cross_entropy(hf_logits.reshape(-1, 101), torch.tensor(targets).reshape(-1))
    hf_loss.backward()
    params = dict(hf.named_parameters())

    logit_err = rel_error(logits, hf_logits.detach().numpy())
    print(f"\ntied={tied} loss {loss:.12f} vs {hf_loss.item():.12f}; logits rel err {logit_err:.2e}")
    assert abs(loss - hf_loss.item()) < 1e-6
    assert logit_err < 1e-6
    worst = 0.0
    for name, g in model.g.items():
        hg = params[hf_name(name)].grad.numpy()
        if "wq" in name:
            hg = hf_to_meta(hg, config.n_heads)
        elif "wk" in name:
            hg = hf_to_meta(hg, config.n_kv_heads)
        worst = max(worst, rel_error(g, hg))
        assert rel_error(g, hg) < 1e-5, name
    print(f"worst gradient rel err over {len(model.g)} tensors: {worst:.2e}")
