"""Where each parameter lives in the one flat parameter buffer, and how it is initialized.

Both backends keep all parameters in one contiguous buffer (and the gradients in another of the
same layout), so that AdamW, the grad norm and checkpoints see one array. Tensors carry Meta's
names. Inside a layer wq, wk, wv are adjacent, so together they form one (q+k+v, dim) matrix that
a single matmul applies (`wqkv`); w1 (gate) and w3 (up) are adjacent in the same way (`w13`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import LlamaConfig
from .twins.init import standard_normals


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


def parameter_shapes(config: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in layer order. Linear weights are (out, in)."""
    c, hd, f = config.dim, config.head_dim, config.ffn_hidden_dim
    shapes = [("tok_embeddings.weight", (config.vocab_size, c))]
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes += [
            (p + "attention_norm.weight", (c,)),
            (p + "attention.wq.weight", (config.n_heads * hd, c)),
            (p + "attention.wk.weight", (config.n_kv_heads * hd, c)),
            (p + "attention.wv.weight", (config.n_kv_heads * hd, c)),
            (p + "attention.wo.weight", (c, config.n_heads * hd)),
            (p + "ffn_norm.weight", (c,)),
            (p + "feed_forward.w1.weight", (f, c)),
            (p + "feed_forward.w3.weight", (f, c)),
            (p + "feed_forward.w2.weight", (c, f)),
        ]
    shapes.append(("norm.weight", (c,)))
    if not config.tie_embeddings:
        shapes.append(("output.weight", (config.vocab_size, c)))
    return shapes


class ParameterLayout:
    """Offsets of the named tensors inside the flat buffer."""

    def __init__(self, config: LlamaConfig):
        self.config = config
        self.tensors: dict[str, Tensor] = {}
        offset = 0
        for name, shape in parameter_shapes(config):
            self.tensors[name] = Tensor(name, shape, offset)
            offset += self.tensors[name].size
        self.size = offset

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named numpy views into a flat host array."""
        return {t.name: flat[t.offset:t.offset + t.size].reshape(t.shape) for t in self.tensors.values()}

    def fused(self, layer: int, first: str, last: str) -> Tensor:
        """The adjacent tensors first..last of one layer as one matrix (e.g. wq..wv -> wqkv)."""
        a = self.tensors[f"layers.{layer}.{first}.weight"]
        b = self.tensors[f"layers.{layer}.{last}.weight"]
        cols = a.shape[1]
        return Tensor(f"layers.{layer}.{first}..{last}", ((b.offset + b.size - a.offset) // cols, cols), a.offset)

    def wqkv(self, layer: int) -> Tensor:
        return self.fused(layer, "attention.wq", "attention.wv")

    def w13(self, layer: int) -> Tensor:
        return self.fused(layer, "feed_forward.w1", "feed_forward.w3")

    def output(self) -> Tensor:
        """The output head: its own matrix, or the token embeddings when tied."""
        return self.tensors["tok_embeddings.weight" if self.config.tie_embeddings else "output.weight"]

    def layer_starts(self) -> list[int]:
        """Offsets where each layer's parameters begin, and the final norm's: the bucket boundaries of
        the gradients' reduce-scatter (llama/parallel/zero.py)."""
        names = [f"layers.{i}.attention_norm.weight" for i in range(self.config.n_layers)] + ["norm.weight"]
        return [self.tensors[name].offset for name in names]

    def gradient_groups(self) -> list[tuple[int, int]]:
        """[start, end) of the groups whose gradients the backward finishes one after another, as the
        optimizer in the backward updates them: the embedding table, each layer, the final norm and head."""
        starts = self.layer_starts()
        return list(zip([0, *starts], [*starts, self.size]))

    def norm_names(self) -> list[str]:
        """The RMSNorm weights, in layout order."""
        return [t.name for t in self.tensors.values() if len(t.shape) == 1]

    def decay_mask(self) -> np.ndarray:
        """uint8 per parameter: 1 where AdamW applies weight decay (2D weights), 0 for norms."""
        mask = np.zeros(self.size, dtype=np.uint8)
        for t in self.tensors.values():
            if len(t.shape) == 2:
                mask[t.offset:t.offset + t.size] = 1
        return mask


def count_parameters(config: LlamaConfig) -> int:
    return sum(int(np.prod(shape)) for _, shape in parameter_shapes(config))


# ---- the initialization: the normals of llama/twins/init.py (Philox, the same bits on the CPU and the GPU),
# scaled per tensor

INIT_STD = 0.02
CHUNK = 1 << 13  # Philox blocks drawn at a time on the host (their arrays stay in the L2 cache)


def initial_std(config: LlamaConfig, name: str, shape) -> float | None:
    """The standard deviation a tensor is drawn with, None for the RMSNorm weights (all 1). Matrices are
    N(0, 0.02), and the two projections that write into the residual stream (wo, w2) are scaled down by
    1/sqrt(2 * n_layers), as in GPT-2 and llm.c."""
    if len(shape) == 1:
        return None
    if name.endswith(("wo.weight", "w2.weight")):
        return INIT_STD / math.sqrt(2 * config.n_layers)
    return INIT_STD


def init_parameters(config: LlamaConfig, seed: int = 0, dtype=np.float32, on_tensor=None) -> np.ndarray:
    """A flat array of freshly initialized parameters (see initial_std), on the host; on_tensor(n), when
    given, is called after each tensor with its number of values (a progress bar's update)."""
    layout = ParameterLayout(config)
    flat = np.empty(layout.size, dtype=dtype)
    for t in layout.tensors.values():
        std = initial_std(config, t.name, t.shape)
        if std is None:
            flat[t.offset:t.offset + t.size] = 1.0
        else:
            for at in range(t.offset, t.offset + t.size, 4 * CHUNK):
                n = min(4 * CHUNK, t.offset + t.size - at)
                flat[at:at + n] = (standard_normals(seed, at, n) * std).astype(np.float32)
        if on_tensor is not None:
            on_tensor(t.size)
    return flat


def model_parameters(layout: ParameterLayout, params: np.ndarray | None, seed: int) -> np.ndarray:
    """A model's starting parameters: params, checked to be one flat array of the layout, or a fresh
    initialization from seed when None."""
    if params is None:
        return init_parameters(layout.config, seed)
    if params.shape != (layout.size,):
        raise ValueError(f"params must be a flat array of {layout.size} values, got shape {params.shape}")
    return params
