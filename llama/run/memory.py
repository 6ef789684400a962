"""How much memory a run needs, buffer by buffer, and the least change that would make one fit (what the machine
has: llama/runtime/machine.py).

What a run needs comes from what the models allocate, buffer by buffer, for the plan's memory recipe
(what the backward recomputes, the optimizer's moments). The numpy reference (llama/model/reference.py),
measured with tracemalloc (tests/unit/test_memory.py): 9 bytes a parameter (weights, gradients, the
decay mask) and the moments (8, or 2 in 8 bits); the activations each layer keeps for the backward and
two copies of the logits; and the largest transient: AdamW's temporaries, or the backward's (two and a
quarter times a layer's activations and attention probabilities, three times the logits). The last step's
activations are dropped before the next forward. The GPU models: the buffers they allocate, to the byte
(llama/model/shapes.py's model_buffers and ZeRO's, llama/parallel/zero.py; the decay mask a bit a weight; checked
against the models' allocations by tests/unit/test_model_launches.py and tests/gpu/test_model_bf16.py), which came
to the device memory measured in use when the mask took a byte a weight (d12 B16 x T1024: 9.6 GB; llama3.2-1b B8 x T2048:
38.9 GB); the CUDA context and graphs come on top, so it is a lower bound. scripts/memory_plan.py prints
the buffers.
"""

from __future__ import annotations

from dataclasses import replace


from ..config import LlamaConfig
from ..model.shapes import model_buffers
from .. import ops
from ..optim import QUANT_BLOCK, AdamW8bitState
from ..options import RECIPES, zero_stages
from ..params import CHUNK, AdapterLayout, LoraSpec, ParameterLayout, count_parameters
from ..parallel.zero import flat_gather_length, home_lengths, model_shards

FLOAT32 = 4


def reference_training_buffers(config: LlamaConfig, B: int, T: int, recompute: str = "none",
                               optimizer: str = "adamw", in_backward: bool = False, lora: LoraSpec | None = None,
                               qlora: bool = False) -> dict[str, int]:
    """What the numpy reference allocates at its peak while it trains on (B, T) batches, by buffer (bytes);
    "largest transient" is the biggest set of temporaries alive at once: AdamW's (20 bytes a parameter,
    or in 8 bits 34 bytes a value of a chunk of blocks, after the global norm's float64 copy of the gradients), or the
    backward's (its layer's activations when they were recomputed, the attention probabilities, the logits).
    With the optimizer in the backward the gradients exist a group at a time (the embedding table's stays
    open all the backward when the head is tied) and AdamW's temporaries are a group's, beside the backward's.
    With LoRA adapters (lora) the base has weights alone, the adapters have gradients, the decay mask and moments,
    and each layer keeps x A^T (rank values a token) of each target; as the weights are so few, the base's making
    may be the peak: drawn from the seed, 45 bytes a value of the largest chunk drawn at once (init_parameters'
    temporaries, measured), or QLoRA's NF4 round trip of a copy of it (the copy and the base at once)."""
    c, P, tokens = config, count_parameters(config), B * T
    C, KVD, F = c.dim, c.n_kv_heads * c.head_dim, c.ffn_hidden_dim
    every = tokens * (6 * C + 2 * KVD + 3 * F)  # what a layer's backward reads
    if lora is not None:
        every += tokens * lora.rank * len(lora.targets)
    kept = {"none": every, "partial": every - tokens * (2 * C + F), "full": tokens * C}[recompute]
    logits = tokens * c.vocab_size
    attention = B * c.n_heads * T * T
    backward = FLOAT32 * (9 * (every + attention) // 4 + 3 * logits + (every - kept if recompute != "none" else 0))
    base, P = P, P if lora is None else AdapterLayout(c, lora).size  # P: the trained values from here on
    gradients, updated = P, P  # values whose gradients exist at once; values one AdamW update takes
    if in_backward:
        groups = [end - start for start, end in ParameterLayout(c).gradient_groups()]
        updated = max(groups)
        gradients = groups[0] + max(groups[1:]) if c.tie_embeddings else updated
    if optimizer == "adamw8bit":
        moments, update = 2 * P + 2 * FLOAT32 * -(-P // QUANT_BLOCK), 34 * min(AdamW8bitState.CHUNK, updated)
    else:
        moments, update = 2 * FLOAT32 * P, 20 * updated
    if in_backward:  # a group's update runs beside the backward's own temporaries: the head's scaled dlogits,
        # dx and dlnf, or the gradients of a layer's activations
        beside = FLOAT32 * max(logits + 2 * tokens * C, tokens * (9 * C + 4 * KVD + 3 * F))
        update = beside + max(FLOAT32 * updated + update, 2 * FLOAT32 * updated)
    update = max(2 * FLOAT32 * updated, update)  # or the norm's float64 copy
    frozen = f"fp32 base ({'NF4 round trip, ' if qlora else ''}frozen)"
    weights = ({"fp32 weights": FLOAT32 * P} if lora is None else
               {frozen: FLOAT32 * base, "fp32 adapters": FLOAT32 * P})
    trained = "" if lora is None else "adapter "
    return weights | {
        f"fp32 {trained}gradients" + (" (a group at a time)" if in_backward else ""): FLOAT32 * gradients,
        "decay mask": P, f"{trained}{optimizer} moments": moments,
        f"activations (recompute {recompute}) x {c.n_layers} layers": FLOAT32 * c.n_layers * kept,
        "logits and their gradient": 2 * FLOAT32 * logits,
        "largest transient": max(update, backward, 0 if lora is None else FLOAT32 * base if qlora else
                                 45 * min(4 * CHUNK, max(t.size for t in ParameterLayout(c).tensors.values())))}


def zero_buffers(config: LlamaConfig, gpus: int, zero: int, reduce_dtype: str = "fp32",
                 optimizer: str = "adamw", trained=None) -> tuple[int, int, int, int, int]:
    """Values per GPU under ZeRO (llama/parallel/zero.py): the weights the forward reads, the gradients, a shard,
    the scratch of a later micro-batch's fp32 reduction, and the longest bucket. Stage 1: the full padded buffers; stage 2 keeps the
    gradients, and stage 3 the weights too, in their buckets' homes (the first and last bucket, two slots); 8-bit
    moments pad the buckets to whole blocks (model_shards). trained: the layout of what the optimizer holds (--lora's
    adapters), by default the model's parameters."""
    shards = model_shards(trained or ParameterLayout(config), gpus, optimizer)
    full = shards.padded_size
    own, slots = home_lengths(shards) if zero > 1 else ({}, [])
    homes = sum(own.values()) + sum(slots)
    return (full if zero < 3 else homes, full if zero == 1 else homes, shards.shard_size,
            max(shards.pieces) if zero > 1 and reduce_dtype == "fp32" else 0,
            max(end - start for start, end in shards.buckets))


def gpu_training_buffers(config: LlamaConfig, plan, B: int, T: int, gpus: int = 1) -> dict[str, int]:
    """What the plan's GPU model allocates on each GPU to train on (B, T) batches, by buffer (bytes): ZeRO's
    (llama/parallel/zero.py: the weights the forward reads, the gradients, the master weights and moments, sharded
    over gpus by the plan's stage, zero_buffers; the moments in fp32 or 8 bits; with the optimizer in the backward no
    gradients there, the model keeps them a group at a time) and the model's own (llama/model/shapes.py
    model_buffers: its activations, scratch, inputs). The CUDA context, the kernels' code and the CUDA graphs
    come on top."""
    trained = AdapterLayout(config, plan.lora) if plan.lora else None
    weights, gradients, shard, scratch, bucket = zero_buffers(config, gpus, plan.zero, plan.reduce_dtype,
                                                              plan.optimizer, trained)
    stage = f" (ZeRO-{plan.zero})" if gpus > 1 else ""
    if plan.optimizer is None:  # a model that only scores (evaluation_plan, one GPU): its weights alone
        weights_only = ({"fp32 weights": FLOAT32 * weights} if plan.dtype == "fp32" else
                        {"bf16 weights": 2 * weights, "fp32 master weights": FLOAT32 * shard})
        return weights_only | model_buffers(config, plan, B, T)
    if plan.dtype == "fp32":  # on several GPUs the master and gradient shards apart from the full buffers
        return {"fp32 weights" + stage: FLOAT32 * weights, "fp32 gradients" + stage: FLOAT32 * (gradients + scratch),
                **({"fp32 master and gradient shards": 2 * FLOAT32 * shard} if gpus > 1 else {}),
                "adamw moments": 2 * FLOAT32 * shard, "decay mask": ops.packed_mask_size(shard),
                **model_buffers(config, plan, B, T)}
    quantized = plan.optimizer == "adamw8bit"
    what = "adapters' " if plan.lora else ""
    buffers = {f"{what}bf16 weights" + stage: 2 * weights}
    if not plan.in_backward:
        buffers[f"{what}fp32 gradients" + stage] = FLOAT32 * (gradients + scratch)
    buffers |= {f"{what}fp32 master weights": FLOAT32 * shard,
                f"{plan.optimizer} moments": (2 * (shard + FLOAT32 * -(-shard // QUANT_BLOCK)) + ops.quantization_maps().nbytes
                                              if quantized else 2 * FLOAT32 * shard),
                "decay mask": ops.packed_mask_size(shard)}
    if gpus > 1:
        buffers["gradient and bf16 weight shards"] = (FLOAT32 + 2) * shard
    if plan.reduce_dtype == "bf16":
        buffers["bf16 reduction scratch"] = 2 * (bucket + bucket // gpus)
    return buffers | model_buffers(config, plan, B, T)


def sampling_buffers(config: LlamaConfig, gpus: int) -> dict[str, int]:
    """What a sample adds on each GPU of a run on several GPUs while the training buffers stay (bytes): the full
    fp32 weights gathered from every rank (Zero.gather_flat) and the decoder's bf16 copy of them (one GPU's
    decoder reads the training weights in place)."""
    if gpus == 1:
        return {}
    layout = ParameterLayout(config)
    shards = model_shards(layout, gpus)
    return {"a sample's gathered fp32 weights and their bf16 copy": FLOAT32 * flat_gather_length(shards) + 2 * layout.size}


def training_buffers(plan, config: LlamaConfig, B: int, T: int, gpus: int = 1) -> dict[str, int]:
    """What the run that plan (llama/run/plan.py) describes allocates on each device, by buffer."""
    if plan.device == "cpu":
        return reference_training_buffers(config, B, T, plan.recompute, plan.optimizer, plan.in_backward, plan.lora,
                                          plan.qlora)
    return gpu_training_buffers(config, plan, B, T, gpus)


def choose_zero(plan, config: LlamaConfig, B: int, T: int, gpus: int, available: int) -> int:
    """The ZeRO stage a run on several GPUs takes: the lowest (the least communication) whose buffers fit in
    `available` bytes, else 3 (the memory check then says what would fit)."""
    stages = zero_stages(plan.dtype)
    return next((z for z in stages if sum(training_buffers(replace(plan, zero=z), config, B, T, gpus).values())
                 <= available), stages[-1])


# what each part of a memory recipe costs, in the order we would give it up: recomputing the norms and SwiGLU
# (a few percent of a step), the optimizer in the backward (no gradient accumulation, clipping a step late),
# 8-bit moments (their rounding), recomputing every layer (a third more compute)
ZERO_SHARDS = {1: "the master weights and moments", 2: "the master weights, moments and gradients",
               3: "the master weights, moments, gradients and weights"}  # what each stage divides among the GPUs
RECIPE_COST = {"none": 0, "partial": 1, True: 2, False: 0, "adamw": 0, "adamw8bit": 3, "full": 5}


LEANER = (("none", "partial", "full"), ("adamw", "adamw8bit"), (False, True))  # each part of a recipe, leaner last


def keeps_less(now: tuple, recipe: tuple) -> bool:
    """Whether every part of a recipe (recompute, optimizer, in_backward) keeps no more than the run's own."""
    return all(order.index(new) >= order.index(old) for order, old, new in zip(LEANER, now, recipe))


def what_would_fit(plan, config: LlamaConfig, B: int, T: int, gpus: int, available: int) -> str:
    """The least change to a run that does not fit in `available` bytes that would: on several GPUs a higher
    ZeRO stage, else the cheapest memory recipe of its path that fits (RECIPE_COST) among those that keep no
    more than the run's own in any part (never --recompute none where the run recomputes), else a smaller -b
    (also with the leanest recipe, where that allows a larger one), else (on a GPU) more GPUs."""
    def fits(recipe: tuple, b: int = B, n: int = gpus, zero: int = plan.zero) -> bool:
        changed = replace(plan, recompute=recipe[0], optimizer=recipe[1], in_backward=recipe[2], zero=zero)
        return sum(training_buffers(changed, config, b, T, n).values()) <= available

    def options(recipe: tuple) -> list[str]:
        recompute, optimizer, in_backward = recipe
        return ([f"--recompute {recompute}"] * (recompute != plan.recompute)
                + [f"--optimizer {optimizer}"] * (optimizer != plan.optimizer)
                + ["--optimizer-in-backward"] * (in_backward and not plan.in_backward))

    recomputes, optimizers, in_backwards = RECIPES[plan.path]
    if (plan.device == "cuda" and gpus > 1) or plan.lora:  # the optimizer in the backward runs on one GPU, in full
        in_backwards = (False,)
    now = (plan.recompute, plan.optimizer, plan.in_backward)
    if plan.device == "cuda" and gpus > 1:
        stage = next((z for z in zero_stages(plan.dtype) if z > plan.zero and fits(now, zero=z)), None)
        if stage:
            return f"--zero {stage} would fit"
    by_cost = sorted(((r, o, i) for r in recomputes for o in optimizers for i in in_backwards if keeps_less(now, (r, o, i))),
                     key=lambda recipe: sum(RECIPE_COST[part] for part in recipe))
    recipe = next((r for r in by_cost if r != now and fits(r)), None)
    if recipe:
        return f"{' '.join(options(recipe))} would fit"
    lean = (max(recomputes, key=("none", "partial", "full").index), optimizers[-1], in_backwards[-1])

    def largest_batch(recipe: tuple) -> int | None:  # what a run needs grows with -b: bisect for the largest that fits
        low, high = 0, B - 1
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(recipe, b=mid) else (low, mid - 1)
        return low or None

    largest = {r: largest_batch(r) for r in (now, lean)}
    if largest[now] or largest[lean]:
        ways = [f"-b {largest[now]}"] if largest[now] else []
        if largest[lean] and largest[lean] > (largest[now] or 0) and lean != now:
            ways.append(" ".join(options(lean) + [f"-b {largest[lean]}"]))
        return f"{' or '.join(ways)} would fit (-d keeps the tokens per step)"
    sharded = (now[0], "adamw", False)  # several GPUs shard fp32 moments and reduce-scatter the gradients
    more = next(((n, z) for n in (2, 4, 8) for z in zero_stages(plan.dtype) if n > gpus and fits(sharded, n=n, zero=z)), None) \
        if plan.device == "cuda" else None
    if more:
        plain = ["--optimizer adamw"] * (now[1] != "adamw") + ["without --optimizer-in-backward"] * now[2]
        plain = " ".join(plain + [f"--zero {more[1]}"] * (more[1] > 1))
        return f"{more[0]} GPUs{' with ' + plain if plain else ''} would fit (ZeRO-{more[1]} shards {ZERO_SHARDS[more[1]]})"
    return ("nothing fits at this length; train a smaller model"
            + ("; -e d12 and the Llama presets are meant for a GPU" if plan.device == "cpu" else ""))
