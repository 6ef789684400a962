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
from .twins.lora import lora_init
from .twins.nf4 import dequantize, quantize


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


# ---- LoRA adapters (--lora): their own flat buffer, what the optimizer trains while the base stays frozen

# the seven linear layers an adapter can target, by our short name: the weight's name in a layer (Meta's)
LORA_TARGETS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
                "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}
# the targets each GEMM of a layer multiplies at once (the fused qkv and w1/w3; the GPU adapts them together)
LORA_GEMMS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))


@dataclass(frozen=True)
class LoraSpec:
    """What PEFT's LoraConfig says of the adapters: rank, alpha (PEFT's lora_alpha), dropout, targets (our short
    names, LORA_TARGETS), rsLoRA's scale; the update of a targeted weight W is scale * B @ A."""
    rank: int
    alpha: float = 8.0  # PEFT's default lora_alpha
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(LORA_TARGETS)
    use_rslora: bool = False

    def __post_init__(self):
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {', '.join(unknown) or '(none)'}: choose from {', '.join(LORA_TARGETS)}")
        if self.rank < 1 or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA rank {self.rank} (at least 1), dropout {self.dropout} (in [0, 1))")

    def split_gemms(self) -> list[tuple[str, ...]]:
        """The fused GEMMs (LORA_GEMMS) of which the targets take some and not all."""
        return [group for group in LORA_GEMMS if 0 < len(set(group) & set(self.targets)) < len(group)]

    @property
    def scale(self) -> float:
        """alpha / rank, or alpha / sqrt(rank) with rsLoRA (PEFT's scaling)."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


class AdapterLayout:
    """Offsets of the adapters in their flat buffer: layer by layer, GEMM by GEMM (LORA_GEMMS), the A of each of the
    GEMM's targets (rank, in) then their B (out, rank), so that a GEMM's A's stack into one (targets * rank, in)
    matrix and its B's into one (the targets' rows, rank), the whole GEMM's output when it takes all its targets:
    tensors "layers.{i}.attention.wq.lora_A", ".lora_B", ...
    The interface of ParameterLayout that the optimizer and ZeRO read (size, tensors, layer_starts, gradient_groups,
    decay_mask, norm_names, views)."""

    def __init__(self, config: LlamaConfig, spec: LoraSpec):
        self.config, self.spec = config, spec
        base = ParameterLayout(config).tensors
        self.tensors: dict[str, Tensor] = {}
        # per layer, per adapted GEMM: (its targets, their A stack, their B stack, the base's weights they adapt)
        self.gemms: list[list[tuple[tuple[str, ...], Tensor, Tensor, list[Tensor]]]] = []
        offset = 0
        for i in range(config.n_layers):
            layer = []
            for group in (tuple(t for t in g if t in spec.targets) for g in LORA_GEMMS):
                if not group:
                    continue
                weights = [base[f"layers.{i}.{LORA_TARGETS[t]}.weight"] for t in group]
                stack_a = offset
                for w in weights:
                    offset = self._add(f"{w.name.removesuffix('.weight')}.lora_A", (spec.rank, w.shape[1]), offset)
                stack_b = offset
                for w in weights:
                    offset = self._add(f"{w.name.removesuffix('.weight')}.lora_B", (w.shape[0], spec.rank), offset)
                rows = sum(w.shape[0] for w in weights)
                layer.append((group, Tensor(f"layers.{i}.{group}.lora_A", (len(group) * spec.rank, weights[0].shape[1]),
                                            stack_a), Tensor(f"layers.{i}.{group}.lora_B", (rows, spec.rank), stack_b),
                              weights))
            self.gemms.append(layer)
        self.size = offset

    def _add(self, name: str, shape: tuple[int, int], offset: int) -> int:
        self.tensors[name] = Tensor(name, shape, offset)
        return offset + shape[0] * shape[1]

    def adapted(self) -> dict[str, tuple[Tensor, Tensor]]:
        """{the base weight's name: (its A, its B)}."""
        return {name.removesuffix(".lora_A") + ".weight": (t, self.tensors[name.removesuffix("_A") + "_B"])
                for name, t in self.tensors.items() if name.endswith(".lora_A")}

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {t.name: flat[t.offset:t.offset + t.size].reshape(t.shape) for t in self.tensors.values()}

    def layer_starts(self) -> list[int]:
        """Where each layer's adapters begin, and the end (ZeRO's buckets, as ParameterLayout's)."""
        return [layer[0][1].offset for layer in self.gemms] + [self.size]

    def gradient_groups(self) -> list[tuple[int, int]]:
        starts = self.layer_starts()
        return list(zip(starts[:-1], starts[1:]))

    def norm_names(self) -> list[str]:
        return []

    def decay_mask(self) -> np.ndarray:
        """Weight decay on every adapter value (all are matrices)."""
        return np.ones(self.size, dtype=np.uint8)


def init_adapters(layout: AdapterLayout, seed: int) -> np.ndarray:
    """Fresh adapters, flat, as PEFT initializes them: each A uniform on (-1/sqrt(in), 1/sqrt(in)) from seed at its
    offset in the buffer (twins.lora.lora_init, the same bits anywhere), each B zero."""
    flat = np.zeros(layout.size, np.float32)
    for a, b in layout.adapted().values():
        flat[a.offset:a.offset + a.size] = lora_init(seed, a.offset, a.shape[0], a.shape[1], b.shape[0])[0].ravel()
    return flat


def quantized_base(config: LlamaConfig, flat: np.ndarray) -> np.ndarray:
    """QLoRA's frozen base as the model computes with it: a float32 copy of the flat parameters with each block's
    seven linear weights (LORA_TARGETS) replaced by their NF4 round trip (twins.nf4 quantize, then dequantize),
    each Meta tensor on its own, as bitsandbytes quantizes each nn.Linear; the embedding, head and norms as they are."""
    base = np.array(flat, np.float32)
    views = ParameterLayout(config).views(base)
    for i in range(config.n_layers):
        for weight in LORA_TARGETS.values():
            view = views[f"layers.{i}.{weight}.weight"]
            view[...] = dequantize(quantize(view))
    return base
