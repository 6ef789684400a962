"""Every buffer a GPU model allocates besides ZeRO's (llama/parallel/zero.py), by name, shape and dtype: each
layer's saved activations and the shared ones, the scratch, the step's inputs, the RoPE tables, the document
bounds, the gradient groups of the optimizer in the backward, the FP8 casts and copies. The models allocate
from these descriptions and the memory accounting (llama/run/memory.py) sums them (model_buffers), so that the
two cannot drift; tests/unit/test_model_launches.py checks the sum against what a model allocates.
"""

from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..ops.flash_attention import FlashSource, flash_attention_scratch_size
from ..params import LORA_GEMMS, ParameterLayout
from ..runtime.cuda import BF16, FP8

F32, F64, I32 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32)
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
    """The FP8 casts' scratch for a (b, t) batch (--dtype fp8), {name: (shape, dtype)}: a linear layer's input
    (the forward's row cast, or the backward's transposed one), its output's gradient (rows and transposed),
    their scales, the casts' amax, and the amax of gate+up's gradient that SwiGLU's backward writes."""
    c = config
    N, widest_in = b * t, max(c.dim, c.n_heads * c.head_dim, c.ffn_hidden_dim)
    widest_out = max((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim, 2 * c.ffn_hidden_dim)
    U32 = np.dtype(np.uint32)
    return {"input": ((N * widest_in,), FP8), "input_scales": ((max(N, widest_in),), F32),
            "grad": ((N * widest_out,), FP8), "grad_scales": ((N,), F32),
            "grad_t": ((N * widest_out,), FP8), "grad_t_scales": ((widest_out,), F32),
            "amax": ((max(N, widest_in) + widest_in + widest_out,), U32),  # any cast's rows + columns
            "grad_amax": ((N + widest_out,), U32)}  # an output gradient's, from the kernel that writes it


def linear_weights(layout, layer: int) -> list:
    """A layer's linear weights as the GEMMs read them: the fused qkv, wo, the fused w1/w3, w2."""
    pre = f"layers.{layer}."
    return [layout.wqkv(layer), layout.tensors[pre + "attention.wo.weight"], layout.w13(layer),
            layout.tensors[pre + "feed_forward.w2.weight"]]



def nbytes(shapes: dict) -> int:
    """The bytes of a {name: (shape, dtype)} description."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in shapes.values())


def bf16_activations(config: LlamaConfig, b: int, t: int, recompute: str, attention) -> tuple[dict, dict]:
    """activation_shapes with their dtypes: ({name: (shape, dtype)} of a layer, of the shared ones)."""
    layer, shared = activation_shapes(config, b, t, recompute, attention)
    typed = lambda shapes: {k: (s, F32 if k in FP32_BUFFERS else BF16) for k, s in shapes.items()}  # noqa: E731
    return typed(layer), typed(shared)


def bf16_scratch(config: LlamaConfig, B: int, T: int) -> dict:
    """The bf16 model's scratch for (B, T) batches: the RMSNorms' and the embedding's backward partials, the global
    norm's partials, the squared norm and the loss, and the final norm's rows that read_logits reads at one position
    of each row, gathered for one GEMM."""
    N = B * T
    return {"rms_scratch": ((ops.rmsnorm_bf16_scratch_size(config.dim),), F32), "logit_rows": ((B, config.dim), BF16),
            "embedding_scratch": ((ops.embedding_bf16_scratch_size(N, config.dim),), F32),
            "norm_scratch": ((ops.NORM_BLOCKS + 1,), F64), "norm_squared": ((1,), F32), "loss_total": ((1,), F32)}


def step_inputs(N: int) -> dict:
    """A step's inputs on the device (llama/model/bf16_inputs.py): the optimizer's scalars, the batch of up to N
    tokens with the embedding backward's order and segments, the loss scale of --sft."""
    return {"scalars": ((ops.ADAMW_SCALARS,), F32), "tokens": ((N,), I32), "targets": ((N,), I32),
            "order": ((N,), I32), "segments": ((N, 4), I32), "loss_scale": ((1,), F32)}


def rope_tables(config: LlamaConfig, T: int) -> dict:
    """The RoPE tables of positions up to T (float32 cos and sin)."""
    return {"rope_cos": ((T, config.head_dim // 2), F32), "rope_sin": ((T, config.head_dim // 2), F32)}


def document_bounds(B: int, T: int) -> dict:
    """Each token's document [start, end) in its row, with the document mask."""
    return {"doc_start": ((B, T), I32), "doc_end": ((B, T), I32)}


def gradient_groups(layout) -> dict:
    """The optimizer in the backward's gradients: the embedding's group, one buffer the others use in turn, and the
    groups' squared norms of this step and of the last."""
    groups = layout.gradient_groups()
    return {"embedding_grads": ((groups[0][1],), F32),
            "group_grads": ((max(end - start for start, end in groups[1:]),), F32),
            "step_group_norms": ((len(groups),), F32), "group_norms": ((len(groups),), F32)}


def fp8_weight_copies(layout, layer: int) -> dict:
    """A layer's linear weights' FP8 copies with their scales, by the weight's offset: its rows (the forward's) and
    its transpose (dX's)."""
    copies = {}
    for tensor in linear_weights(layout, layer):
        rows, cols = tensor.shape
        copies[tensor.offset] = {"rows": ((rows, cols), FP8), "row_scales": ((rows,), F32),
                                 "cols": ((cols, rows), FP8), "col_scales": ((cols,), F32)}
    return copies


def linear_members(layout, layer: int) -> list:
    """A layer's seven linear weights as Meta's tensors (wq, wk, wv, wo, w1, w3, w2), in the layout's order."""
    return [t for t in layout.tensors.values() if t.name.startswith(f"layers.{layer}.") and len(t.shape) == 2]


def frozen_base(config: LlamaConfig, qlora: bool) -> dict:
    """The frozen base of a fine-tune through adapters (llama/model/frozen_base.py): the norms in fp32, and every
    other weight in bf16 (LoRA), or a block's linear weights in NF4 (codes, the double-quantized absmaxes, the
    offset), the embedding and head in bf16, one bf16 scratch a fused GEMM's weight is dequantized into, the
    quantization's absmax scratch and its tables (QLoRA); and the staging buffer the weights come in through, fp32,
    the largest linear weight's values (freed once the base is built)."""
    layout = ParameterLayout(config)
    members = [t for i in range(config.n_layers) for t in linear_members(layout, i)]
    buffers = {name: (layout.tensors[name].shape, F32) for name in layout.norm_names()}
    buffers["staging"] = ((max(t.size for t in members),), F32)
    if not qlora:
        return buffers | {"bf16 weights": ((layout.size,), BF16)}
    for t in layout.tensors.values():
        if len(t.shape) == 2 and t not in members:  # the embedding, an untied head
            buffers[t.name] = (t.shape, BF16)
    for t in members:
        sizes = ops.nf4_sizes(t.shape)
        buffers |= {f"{t.name} codes": (sizes["codes"], np.dtype(np.uint8)),
                    f"{t.name} absmax_codes": (sizes["absmax"], np.dtype(np.uint8)),
                    f"{t.name} absmax_scales": (sizes["absmax_scales"], F32), f"{t.name} offset": ((1,), F32)}
    fused = max(t.size for i in range(config.n_layers) for t in linear_weights(layout, i))
    return buffers | {"dequantized": ((fused,), BF16),
                      "nf4 absmax": ((max(ops.nf4_sizes(t.shape)["absmax"][0] for t in members),), F32),
                      "nf4 tables": ((ops.nf4_tables().size,), F32)}


def lora_scratch(config: LlamaConfig, spec, N: int) -> dict:
    """The adapters' scratch for N tokens (llama/model/lora_linears.py): x A^T and its gradient (N, m r) for the
    widest stack of m targets, the block-diagonal spread of a stacked B (its rows, m r) and the fp32 product whose
    blocks are B's gradient, each for the widest fused GEMM."""
    layout = ParameterLayout(config)
    r = spec.rank
    stacks = [(len(group), w.shape[0]) for group, w in zip(LORA_GEMMS, linear_weights(layout, 0))
              if set(group) <= set(spec.targets)]
    m = max(k for k, _ in stacks)
    fused = max([k * rows for k, rows in stacks if k > 1] or [1])  # the widest block-diagonal spread's values
    return {"xa": ((N * m * r,), BF16), "dxa": ((N * m * r,), BF16), "block_diagonal": ((fused * r,), BF16),
            "block_products": ((fused * r,), F32)}


def frozen_gradients(config: LlamaConfig) -> dict:
    """Where the RMSNorms' backward writes the frozen base's norm gradients, which nothing reads."""
    return {"frozen_gradients": ((config.dim,), F32)}


def fp32_activations(config: LlamaConfig, b: int, t: int) -> tuple[dict, dict]:
    """The fp32 model's (llama/model/gpu_fp32.py) activations for a (b, t) batch, all float32: ({name: (shape,
    dtype)} of a layer, of the shared ones, the backward's among them)."""
    c = config
    N, C, D, H, KV, F = b * t, c.dim, c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_hidden_dim
    layer = {"x": (N, C), "ln1": (N, C), "rstd1": (N,), "q": (b, H, t, D), "k": (b, KV, t, D),
             "v": (b, KV, t, D), "att": (b, t, H * D), "probs": (b, H, t, t), "h": (N, C), "ln2": (N, C),
             "rstd2": (N,), "gate_up": (N, 2 * F), "ffn": (N, F)}
    shared = {"residual": (N, C), "lnf": (N, C), "rstdf": (N,), "logits": (N, c.vocab_size), "losses": (N,),
              "qkv": (b, t, (H + 2 * KV) * D), "heads": (b, H, t, D),
              # backward
              "dresidual": (N, C), "dln": (N, C), "dffn": (N, F), "dgate_up": (N, 2 * F), "datt": (b, t, H * D),
              "dq": (b, H, t, D), "dk": (b, KV, t, D), "dv": (b, KV, t, D), "dqkv": (b, t, (H + 2 * KV) * D),
              "dprobs": (b, H, t, t), "dheads": (b, H, t, D), "rms_scratch": (ops.RMSNORM_PARTS * C,),
              "norm_partial": (ops.NORM_BLOCKS,), "norm_squared": (1,)}
    return {k: (s, F32) for k, s in layer.items()}, {k: (s, F32) for k, s in shared.items()}


def fp32_inputs(N: int) -> dict:
    """The fp32 model's batch of up to N tokens: tokens, targets, and the embedding backward's sorted order, the
    starts of each run of one token and the tokens of the runs."""
    return {"tokens": ((N,), I32), "targets": ((N,), I32), "token_order": ((N,), I32), "token_starts": ((N + 1,), I32),
            "token_unique": ((N,), I32)}


def model_buffers(config: LlamaConfig, plan, B: int, T: int) -> dict[str, int]:
    """What the GPU model of the plan allocates besides ZeRO's buffers, in bytes by line of the memory accounting:
    llama/model/gpu_bf16.py's (bf16, fp8) or gpu_fp32.py's."""
    N = B * T
    small = rope_tables(config, T) | (document_bounds(B, T) if plan.doc_mask else {})
    if plan.dtype == "fp32":
        layer, shared = fp32_activations(config, B, T)
        return {f"activations x {config.n_layers} layers": config.n_layers * nbytes(layer),
                "shared activations, the logits, scratch": nbytes(shared),
                "inputs, RoPE tables": nbytes(small | fp32_inputs(N))}
    layer, shared = bf16_activations(config, B, T, plan.recompute, plan.attention or HOPPER_ATTENTION)
    small |= bf16_scratch(config, B, T) | step_inputs(N)
    buffers = {f"activations (recompute {plan.recompute}) x {config.n_layers} layers": config.n_layers * nbytes(layer),
               "shared activations, a logits chunk": nbytes(shared), "scratch, inputs, RoPE tables": nbytes(small)}
    if plan.in_backward:
        buffers["fp32 gradients (a group at a time)"] = nbytes(gradient_groups(ParameterLayout(config)))
    if plan.lora:
        buffers[f"frozen base ({'nf4' if plan.qlora else 'bf16'}), its staging while built"] = nbytes(
            frozen_base(config, plan.qlora))
        buffers["adapters' scratch"] = nbytes(lora_scratch(config, plan.lora, N) | frozen_gradients(config))
    if plan.dtype == "fp8":
        layout = ParameterLayout(config)
        buffers["FP8 weight copies"] = sum(nbytes(copy) for i in range(config.n_layers)
                                           for copy in fp8_weight_copies(layout, i).values())
        buffers["FP8 casts' scratch"] = nbytes(fp8_shapes(config, B, T))
    return buffers
