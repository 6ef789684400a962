"""Llama 3.1 model configuration: sizes, RoPE scaling, presets, JSON load/save.

The fields follow Meta's `ModelArgs` (llama-models, models/llama3/args.py). Derived sizes
(head_dim, FFN hidden size) are properties so that a config never disagrees with itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A model configuration that cannot describe a Llama model."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = True
    rope_scale_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    max_seq_len: int = 131072  # Llama 3.1 and 3.2 context length (max_position_embeddings)
    tie_embeddings: bool = False

    def __post_init__(self):
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        """How many query heads share one key/value head."""
        return self.n_heads // self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Meta's FFN width: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of",
                     "max_seq_len", "rope_original_context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("norm_eps", "rope_theta", "rope_scale_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.ffn_dim_multiplier is not None and not self.ffn_dim_multiplier > 0:
            raise ConfigError(f"ffn_dim_multiplier must be positive or null, got {self.ffn_dim_multiplier!r}")
        if self.dim % self.n_heads:
            raise ConfigError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")
        if self.use_scaled_rope and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError("rope_high_freq_factor must be larger than rope_low_freq_factor")

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "LlamaConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**values)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "LlamaConfig":
        try:
            values = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config {path} must hold a JSON object")
        return cls.from_dict(values)


# Llama 3.2 1B/3B use the 3.1 frequency-scaling formula with factor 32 instead of 8.
PRESETS: dict[str, LlamaConfig] = {
    "llama3.1-8b": LlamaConfig(),
    "llama3.2-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, multiple_of=256,
                               ffn_dim_multiplier=1.5, rope_scale_factor=32.0, tie_embeddings=True),
    "llama3.2-3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, multiple_of=256,
                               ffn_dim_multiplier=1.0, rope_scale_factor=32.0, tie_embeddings=True),
    # From-scratch sizes. d12 is the ~125M-class body (272.5M parameters with the 128256 vocab).
    "d12": LlamaConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, multiple_of=256,
                       ffn_dim_multiplier=None, max_seq_len=2048),
    "d6": LlamaConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, multiple_of=128,
                      ffn_dim_multiplier=None, max_seq_len=1024),
    # the CPU default: with the 128256 vocab the tied embedding table is most of its 17.2M parameters
    "small": LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=64,
                         ffn_dim_multiplier=None, max_seq_len=512, tie_embeddings=True),
    "tiny": LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16,
                        ffn_dim_multiplier=None, max_seq_len=64, vocab_size=97),
}


# the presets of Meta's released models: their vocabulary is the Llama 3 tokenizer's
META_MODELS = ("llama3.1-8b", "llama3.2-1b", "llama3.2-3b")


def get_preset(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose from: {', '.join(PRESETS)}") from None
