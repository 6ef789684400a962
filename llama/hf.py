"""Hugging Face transformers <-> Meta naming and layout, for comparisons and weight exchange.

HF rotates (i, i + D/2) pairs ("rotate half") where Meta rotates (2i, 2i+1), so HF's q and k
projection rows are permuted per head; everything else maps by name only.
"""

from __future__ import annotations

import numpy as np

from .config import LlamaConfig

HF_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head",
            "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
            "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
            "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
            "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm"}


def hf_name(name: str) -> str:
    """Meta parameter name -> HF parameter name."""
    base = name.removesuffix(".weight")
    if base.startswith("layers."):
        _, i, rest = base.split(".", 2)
        return f"model.layers.{i}.{HF_NAMES[rest]}.weight"
    return HF_NAMES[base] + ".weight"


def meta_to_hf(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def hf_to_meta(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def heads_of(name: str, config: LlamaConfig) -> int | None:
    """How many heads a tensor's rows are permuted over (q, k), or None."""
    if name.endswith("attention.wq.weight"):
        return config.n_heads
    if name.endswith("attention.wk.weight"):
        return config.n_kv_heads
    return None


def to_hf_state(views: dict[str, np.ndarray], config: LlamaConfig) -> dict[str, np.ndarray]:
    """Named Meta tensors -> HF state dict (numpy)."""
    return {hf_name(k): (meta_to_hf(v, heads_of(k, config)) if heads_of(k, config) else v) for k, v in views.items()}


def transformers_config(config: LlamaConfig, attn_implementation: str = "eager"):
    """A transformers.LlamaConfig with the same architecture (needs transformers)."""
    import transformers

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
    hf_config._attn_implementation = attn_implementation
    return hf_config
