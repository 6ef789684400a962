"""Tiny Llama models and their inputs for the comparisons with transformers.

The live tests (tests/unit/test_hf_compare.py, test_hf_transformers.py, tests/gpu/test_hf.py) run
transformers itself and skip themselves where torch or transformers is missing; random_hf_model and
hf_logits import torch when called. Their golden twins (tests/unit/test_golden_hf.py) need neither:
scripts/record_golden.py records what transformers computes for the GOLDEN_* models and inputs below
into tests/data/golden/, and the twins check our numpy reference and HF import/export against it.
"""

import hashlib
import json
from pathlib import Path

import numpy as np

from llama.config import get_preset
from llama.io.hf import to_hf_state, transformers_config
from llama.model.reference import ReferenceModel
from llama.params import ParameterLayout
from llama.run.plan import cpu_plan

# GQA and llama3 RoPE scaling with a short original context, so that all three scaling branches act
CONFIG = get_preset("tiny").replace(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=517, max_seq_len=128,
                                    rope_theta=10000.0, rope_scale_factor=32.0, rope_original_context=32)
TOKENS = np.random.default_rng(5).integers(0, 517, (2, 40))


def random_hf_model(tied: bool, seed: int = 0):
    """A random LlamaForCausalLM in float32 whose norm weights are not all 1."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers_config(CONFIG.replace(tie_embeddings=tied))).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model.double()(torch.tensor(tokens)).logits.numpy()


def hf_model_of(config, params: np.ndarray):
    """transformers' LlamaForCausalLM of config in float64, holding our flat parameters."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM(transformers_config(config)).double().eval()
    views = ParameterLayout(config).views(params.astype(np.float64))
    missing, unexpected = model.load_state_dict({k: torch.tensor(v) for k, v in to_hf_state(views, config).items()},
                                                strict=False)
    if unexpected or not set(missing) <= ({"lm_head.weight"} if config.tie_embeddings else set()):
        raise ValueError(f"the state does not fit transformers' model: missing {missing}, unexpected {unexpected}")
    return model


def reference_forward(config, params: np.ndarray, tokens: np.ndarray, targets: np.ndarray | None = None):
    """Our float64 reference holding params after a forward of tokens (and targets): (model, loss or None)."""
    model = ReferenceModel(config, cpu_plan(), params=params.astype(np.float64), dtype=np.float64)
    return model, model.forward(tokens, targets)


GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
RECORD_COMMAND = "PYTHONPATH=$PWD python3 scripts/record_golden.py tests/data/golden"
# The golden model: tiny's 4 query heads on 2 key/value heads, head_dim 8 and theta 1e4 (wavelengths 6.3, 63,
# 628 and 6283 positions) against an original context of 64 (scaling thresholds 16 and 64), so that one
# frequency is kept, one smoothed and two scaled; a narrow FFN (48) and vocabulary (64) keep the fixtures small.
GOLDEN_CONFIG = get_preset("tiny").replace(vocab_size=64, ffn_dim_multiplier=0.5, max_seq_len=128,
                                           rope_theta=10000.0, rope_original_context=64)
GOLDEN_EXPORT_VOCAB = 517  # the sample tokenizer's 261 ranks and 256 special tokens (tests/sample_files.py)
GOLDEN_TEXT = "the thin line: ünïcödé 日本語 🦙\r\n  tabs\tand 12345"
GOLDEN_CHAT = [{"role": "system", "content": "the thin line"}, {"role": "user", "content": "hi"}]
WEIGHT_SEED = 7


def golden_tokens(vocab_size: int, batch: int, steps: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, steps))


def seeded_params(config, seed: int = WEIGHT_SEED) -> np.ndarray:
    """Flat float32 parameters in our layout from a seed alone: N(0, 0.1^2) weights, norm weights 1 + N(0, 0.1^2)."""
    layout = ParameterLayout(config)
    params = (0.1 * np.random.default_rng(seed).standard_normal(layout.size)).astype(np.float32)
    views = layout.views(params)
    for name in layout.norm_names():
        views[name] += 1
    return params


def sha256(data) -> str:
    """Hex digest of bytes, or of an array's float32 little-endian values."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data, dtype="<f4").tobytes()
    return hashlib.sha256(data).hexdigest()


def fixture_paths(name: str, folder: Path = GOLDEN) -> tuple[Path, Path]:
    """(NAME.json, NAME.npz) of a golden fixture."""
    return folder / f"{name}.json", folder / f"{name}.npz"


def write_fixture(folder: Path, name: str, facts: dict, arrays: dict[str, np.ndarray]) -> None:
    """NAME.json (facts) and NAME.npz (arrays, compressed) in folder."""
    facts_path, arrays_path = fixture_paths(name, folder)
    facts_path.write_text(json.dumps(facts, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    np.savez_compressed(arrays_path, **arrays)
