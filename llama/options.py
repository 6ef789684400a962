"""Every option list of a run, in one dependency-free module: the command line offers these, the plan
(llama/run/plan.py) checks against them, the models and the optimizer accept them. Nothing here imports the
rest of the package, so any layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DEVICES = ("cuda", "cpu")
DTYPES = ("bf16", "fp8", "fp32")  # GPU precision: mixed bf16, bf16 with FP8 linear layers, the exact fp32 path
RECOMPUTE = ("none", "partial", "full")  # what the backward recomputes: nothing, the norms and SwiGLU, every layer
OPTIMIZERS = ("adamw", "adamw8bit")  # AdamW with fp32 moments, or 8-bit block-wise moments (llama/optim.py)
SCHEDULES = ("cosine", "linear", "constant", "wsd")  # the learning-rate schedules (llama/optim.py)
FP8_SCALINGS = ("row", "tensor")  # --dtype fp8: one scale per slice along K, or one per tensor
ZERO_STAGES = (1, 2, 3)  # ZeRO: the optimizer state sharded; and the gradients; and the weights
REDUCE_DTYPES = ("fp32", "bf16")  # several GPUs: the gradients' reduce-scatter
# --doc-mask: attention within each document (documents start at BOS); auto is on with --sft, else off
DOC_MASKS = ("auto", "on", "off")

# the memory recipes each path runs, defaults first: (recompute, optimizer, optimizer-in-backward). The numpy
# reference runs them all; the bf16 GPU model too (the optimizer in the backward on one GPU),
# and so its FP8 linear layers; the fp32 GPU model keeps everything, with fp32 moments updated after the backward
RECIPES = {"cpu": (RECOMPUTE, OPTIMIZERS, (False, True)),
           "bf16": (("partial", "none", "full"), OPTIMIZERS, (False, True)),
           "fp8": (("partial", "none", "full"), OPTIMIZERS, (False, True)),
           "fp32": (("none",), ("adamw",), (False,))}


def zero_stages(dtype: str | None) -> tuple[int, ...]:
    """The ZeRO stages a dtype runs: FP8 casts every weight at the forward's start, so not stage 3."""
    return ZERO_STAGES[:2] if dtype == "fp8" else ZERO_STAGES


@dataclass(frozen=True)
class RunOptions:
    """What a run asks of the plan (llama/run/plan.py make_plan); None leaves the choice to the plan. gpus and
    batch ((B, T) per GPU) size the ZeRO stage the plan picks on several GPUs."""
    device: str | None = None  # DEVICES
    dtype: str | None = None  # DTYPES
    recompute: str | None = None  # RECOMPUTE
    optimizer: str | None = None  # OPTIMIZERS
    in_backward: bool = False  # the optimizer steps inside the backward
    fp8_scaling: str | None = None  # FP8_SCALINGS, with dtype fp8
    zero: int | None = None  # ZERO_STAGES
    reduce_dtype: str | None = None  # REDUCE_DTYPES
    gpus: int = 1
    batch: tuple[int, int] | None = None
    doc_mask: str | None = None  # DOC_MASKS; None is auto
    sft: bool = False  # chat fine-tuning: only the targets the shards' loss masks mark count
    bos_id: int | None = None  # the tokenizer's BOS, where documents start for the document mask
    lora: int | None = None  # fine-tune through LoRA adapters of this rank, the base frozen (llama/params.py LoraSpec)
    lora_alpha: float | None = None  # the adapters' alpha (PEFT's lora_alpha; None: PEFT's default)
    lora_dropout: float = 0.0
    lora_targets: str | None = None  # comma-separated, of LORA_TARGETS (None: all seven)
    qlora: bool = False  # with lora: the frozen base in NF4 (QLoRA)

    @classmethod
    def from_args(cls, args, gpus: int = 1, batch: tuple[int, int] | None = None,
                  bos_id: int | None = None) -> "RunOptions":
        """The options of train_llama.py's parsed command line: each field from the option of its name (--in-backward
        is --optimizer-in-backward), so that a new option is a field here and a flag there."""
        asked = {f.name: getattr(args, ARGUMENTS.get(f.name, f.name)) for f in fields(cls) if f.name not in FROM_RUN}
        return cls(**asked, gpus=gpus, batch=batch, bos_id=bos_id)


ARGUMENTS = {"in_backward": "optimizer_in_backward"}  # fields whose command-line option has another name
FROM_RUN = ("gpus", "batch", "bos_id")  # fields the run knows, not the command line
