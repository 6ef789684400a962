"""The buffers a GPU model allocates, by shape: each layer's saved activations and the shared ones, the FP8
casts' scratch, the linear weights as the GEMMs read them. Low in the package, so that the memory accounting
(llama/run/memory.py) sizes a run without importing a model; llama/model/gpu_bf16.py allocates exactly these.
"""

from __future__ import annotations

import numpy as np

from ..config import LlamaConfig
from ..runtime.cuda import FP8
from ..ops.flash_attention import FlashSource, flash_attention_scratch_size

HOPPER_ATTENTION = FlashSource("flash_attention_wgmma", tma=True)  # the Hopper build, what the memory check sizes by default
CLASSIFIER_CHUNK = 4096  # tokens whose logits exist at once
FP32_BUFFERS = ("rstd1", "rstd2", "lse", "rstdf", "losses", "attention_scratch")  # the other activations are bf16


# the activations each layer keeps for its backward, by recompute; the others are one shared set, which
# the backward fills again for each layer
LAYER_ACTIVATIONS = {"none": ("x", "rstd1", "ln1", "qkv", "att", "lse", "h", "rstd2", "ln2", "gate_up", "ffn"),
                     "partial": ("x", "rstd1", "qkv", "att", "lse", "h", "rstd2", "gate_up"),
                     "full": ("x",)}


def activation_shapes(config: LlamaConfig, b: int, t: int, recompute: str, attention) -> tuple[dict, dict]:
    """Shapes of each layer's saved activations (LAYER_ACTIVATIONS[recompute]) and of the shared
    buffers, for a (b, t) batch. attention: the plan's flash attention build (its backward's scratch)."""
    c = config
    N, C, D, H, KV, F = b * t, c.dim, c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_hidden_dim
    activations = {"x": (N, C), "rstd1": (N,), "ln1": (N, C), "qkv": (b, t, (H + 2 * KV) * D), "att": (b, t, H * D),
                   "lse": (b, H, t), "h": (N, C), "rstd2": (N,), "ln2": (N, C), "gate_up": (N, 2 * F), "ffn": (N, F)}
    layer = {k: s for k, s in activations.items() if k in LAYER_ACTIVATIONS[recompute]}
    shared = {"branch": (N, C), "residual": (N, C), "lnf": (N, C), "rstdf": (N,), "losses": (N,),
              "logits": (min(CLASSIFIER_CHUNK, N), c.vocab_size),
              "dresidual": (N, C), "dln": (N, C), "datt": (b, t, H * D),
              "dqkv": (b, t, (H + 2 * KV) * D),
              "attention_scratch": (flash_attention_scratch_size(b, t, H, D, attention),)}
    return layer, shared | {k: s for k, s in activations.items() if k not in layer}


def fp8_shapes(config: LlamaConfig, b: int, t: int) -> dict:
    """The FP8 casts' scratch for a (b, t) batch (--dtype fp8), name -> (shape, dtype): a linear layer's input
    (the forward's row cast, or the backward's transposed one), its output's gradient (rows and transposed),
    their scales, the casts' amax, and the amax of gate+up's gradient that SwiGLU's backward writes."""
    c = config
    N, widest_in = b * t, max(c.dim, c.n_heads * c.head_dim, c.ffn_hidden_dim)
    widest_out = max((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim, 2 * c.ffn_hidden_dim)
    return {"input": ((N * widest_in,), FP8), "input_scales": ((max(N, widest_in),), np.float32),
            "grad": ((N * widest_out,), FP8), "grad_scales": ((N,), np.float32),
            "grad_t": ((N * widest_out,), FP8), "grad_t_scales": ((widest_out,), np.float32),
            "amax": ((max(N, widest_in) + widest_in + widest_out,), np.uint32),  # any cast's rows + columns
            "grad_amax": ((N + widest_out,), np.uint32)}  # an output gradient's, from the kernel that writes it


def linear_weights(layout, layer: int) -> list:
    """A layer's linear weights as the GEMMs read them: the fused qkv, wo, the fused w1/w3, w2."""
    pre = f"layers.{layer}."
    return [layout.wqkv(layer), layout.tensors[pre + "attention.wo.weight"], layout.w13(layer),
            layout.tensors[pre + "feed_forward.w2.weight"]]
