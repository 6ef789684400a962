"""A random transformers LlamaForCausalLM and its logits, for the tests against transformers itself
(CPU and GPU). Importing this module skips the importing test module where torch or transformers is
missing."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.io.hf import transformers_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# GQA and llama3 RoPE scaling with a short original context, so that all three scaling branches act
CONFIG = get_preset("tiny").replace(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=517, max_seq_len=128,
                                    rope_theta=10000.0, rope_scale_factor=32.0, rope_original_context=32)
TOKENS = np.random.default_rng(5).integers(0, 517, (2, 40))


def random_hf_model(tied: bool, seed: int = 0):
    """A random LlamaForCausalLM in float32 whose norm weights are not all 1."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers_config(CONFIG.replace(tie_embeddings=tied))).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model.double()(torch.tensor(tokens)).logits.numpy()
