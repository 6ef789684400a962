"""What runs where, decided once: the Plan of a run, printed in one line.

make_plan() looks at the machine and the model and returns a frozen Plan: the device, the training
dtype, the memory recipe (what the backward recomputes, the optimizer's moments), the bf16 GEMM version
of each problem shape, the flash attention build, the datasheet peak for MFU, and the summary line. The trainer, the bf16 model and the decoder
receive it; the launchers in llama/ops/ launch the versions they are given and decide nothing.
Versions are rungs of the kernel ladders (dev/cuda/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


from ..runtime.cuda import cuda_unavailable, runtime
from .memory import choose_zero
from ..runtime.machine import gpu_free
from ..model.shapes import HOPPER_ATTENTION
from ..optim import QUANT_BLOCK
from ..ops.lora import MAX_K as LORA_MAX_K
from ..params import LORA_GEMMS, LORA_TARGETS, LoraSpec
from ..options import DOC_MASKS, FP8_SCALINGS, RECIPES, REDUCE_DTYPES, ZERO_STAGES, RunOptions, zero_stages
from ..ops.common import VECTOR
from ..ops.flash_attention import HEAD_DIMS, FlashSource

DYNAMIC_TWINS = {"wgmma5": "wgmma8", "wgmma6": "wgmma7"}  # GEMM versions and their twins that claim tiles
FP8_ROW = 16  # FP8 rows hold a multiple of this many values: TMA reads rows of whole 16-byte units
BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense tensor-core bf16, datasheets
FP32_PEAK_FLOPS = {"H100": 67e12, "H200": 67e12, "A100": 19.5e12}  # non-tensor fp32, datasheets
# the flash attention build and its name in the plan's line: on Hopper kernels/flash_attention_wgmma.cu, the ladder's
# v6 forward at head dim 64 (v3's at 128) and v3's backward; v2 (kernels/flash_attention.cu, mma.sync) on any other
# GPU from sm_80
ATTENTION_HOPPER = HOPPER_ATTENTION, "flash v6 (wgmma + TMA)"
ATTENTION = FlashSource(), "flash v2 (mma.sync)"


class PlanError(ValueError):
    """What this machine or model cannot run, in one line for the user."""


@dataclass(frozen=True)
class GemmChooser:
    """The GEMM version of each (M, N, K) problem. bf16 on Hopper: version 5 ('wgmma5', ping-pong
    consumers on 128x128 tiles, split-K in the kernel, staged epilogue) for few output tiles (split-K) and for
    short K (at most 2048) into outputs up to 8192 wide; version 6 ('wgmma6', cooperative 128x256 tiles, staged
    epilogue) for the rest: long K, and wide outputs (the head, gate+up). Each where it measured faster inside a
    CUDA graph on the d768, d2048 and d4096 shapes (scripts/bench_matmul.py --graph, H100, dev/cuda/README.md:
    geometric mean 0.942 of cuBLAS against 0.944 for the best of the two per shape). From sm_80: 'mma' (v1).
    FP8 (Hopper only): version 6 on every shape, faster than version 5 on 27 of the 31 model shapes (geometric
    mean of the ratios to torch._scaled_mm 0.93, against 0.89 for the bf16 rule's picks; dev/cuda/README.md).
    dynamic (bf16 on Hopper): versions 8 and 7 instead of 5 and 6, their twins whose CTAs claim tiles from a
    counter, so that CTAs which start late (multiprocessors held by NCCL's kernels) leave their tiles after the
    first to the others (a CTA's first tile is still its block index); the same results bit for bit."""
    hopper: bool
    fp8: bool = False
    dynamic: bool = False

    def __call__(self, M: int, N: int, K: int) -> str:
        if self.fp8:
            return "wgmma6"
        if not self.hopper:
            return "mma"
        version = "wgmma5" if M * N <= 8 * 2**20 or (K <= 2048 and N <= 8192) else "wgmma6"
        return DYNAMIC_TWINS[version] if self.dynamic else version

    @property
    def name(self) -> str:
        if self.fp8 or not self.hopper:
            return "wgmma6" if self.fp8 else "mma"
        return "wgmma8/wgmma7" if self.dynamic else "wgmma5/wgmma6"


def gemm_chooser(fp8: bool = False, dynamic: bool = False) -> GemmChooser:
    """The GEMM chooser of this GPU, for bf16 or FP8 operands, with the versions that claim tiles (dynamic)."""
    return GemmChooser(hopper=runtime().device.compute_capability() == (9, 0), fp8=fp8, dynamic=dynamic)


@dataclass(frozen=True)
class Plan:
    device: str  # "cuda" or "cpu"
    dtype: str  # "bf16" (mixed precision), "fp8" (bf16 with FP8 linear layers) or "fp32" (the exact path); on the
    # CPU "fp32" (the numpy reference) or "fp8" (the reference with the FP8 casts, ReferenceModel(fp8="row"))
    hardware: str  # "GPU NVIDIA H200 (sm_90a)" or "CPU"
    gemm: GemmChooser | None = None  # bf16 GEMM version per problem shape (GPU)
    attention: FlashSource | None = None  # the flash attention build (GPU)
    attention_name: str = ""
    peak_flops: float | None = None  # datasheet peak of dtype on this GPU, for MFU; None when unknown
    note: str = ""  # why not bf16, or why the CPU
    recompute: str = "none"  # what the backward recomputes (RECOMPUTE)
    optimizer: str | None = "adamw"  # "adamw" (fp32 moments) or "adamw8bit" (llama/optim.py); None: a model that
    # only scores (evaluation_plan), with no gradients and no optimizer state
    in_backward: bool = False  # the optimizer steps inside the backward, a group of gradients at a time
    fp8_scaling: str = "row"  # dtype fp8: one scale per row along each GEMM's K, or "tensor" (the comparison)
    fp8_gemm: GemmChooser | None = None  # dtype fp8 (GPU): the FP8 GEMM version per problem shape
    zero: int = 1  # the ZeRO stage on several GPUs (llama/parallel/zero.py): 1 shards the optimizer state, 2 the
    # gradients too, 3 the weights too
    reduce_dtype: str = "fp32"  # several GPUs: the gradients' reduce-scatter in fp32, or bf16 (half the bytes)
    doc_mask_bos: int | None = None  # each token attends within its own document only, documents starting at this
    # token id (the tokenizer's BOS); None: attention spans the row
    sft: bool = False  # chat fine-tuning: only the targets the shards' loss masks mark count in the loss
    lora: LoraSpec | None = None  # fine-tuning through LoRA adapters (llama/params.py), the base frozen; None: in full
    qlora: bool = False  # with lora: the frozen base in NF4
    options: RunOptions = RunOptions()  # what the run asked for (make_plan's)

    def __getattr__(self, name: str):
        """An option the plan decides nothing about reads as the run asked for it (RunOptions' field of that name),
        so that a new run option reaches the models through the plan without a field here."""
        if name.startswith("__") or name == "options":
            raise AttributeError(name)
        return getattr(self.options, name)

    def adapted_linears(self) -> int:
        """How many of a block's seven linear layers the adapters target."""
        return len(self.lora.targets) if self.lora else 0

    @property
    def doc_mask(self) -> bool:
        """Whether attention is document-masked."""
        return self.doc_mask_bos is not None

    @property
    def path(self) -> str:
        """The model that runs: "cpu" (the numpy reference), "bf16", "fp8" or "fp32" (a GPU model)."""
        return "cpu" if self.device == "cpu" else self.dtype

    def summary(self) -> str:
        """The one line the trainer prints: what runs where."""
        if self.device == "cpu":
            runs = "the numpy reference" + (f" with FP8 casts ({self.fp8_scaling}-wise scales) in the linear layers"
                                            if self.dtype == "fp8" else "")
        elif self.dtype in ("bf16", "fp8"):
            fp8 = (f" (FP8 e4m3 on {self.fp8_gemm.name}, {self.fp8_scaling}-wise scales, in the linear layers)"
                   if self.dtype == "fp8" else "")
            runs = f"gemm {self.gemm.name}{fp8}, attention {self.attention_name}, CUDA graphs"
        else:
            runs = "fp32 kernels (the exact path)"
        return (f"{self.hardware} | dtype {self.dtype} | {runs} | recompute {self.recompute} | {self.optimizer or 'scoring only'}"
                + (" in the backward" if self.in_backward else "") + (f" | ZeRO-{self.zero}" if self.zero > 1 else "")
                + (" | bf16 reduce-scatter" if self.reduce_dtype == "bf16" else "")
                + (" | document mask" if self.doc_mask else "") + (" | SFT loss mask" if self.sft else "")
                + (f" | lora r{self.lora.rank} on {self.adapted_linears()} linears, base "
                   f"{'nf4' if self.qlora else 'frozen'}" if self.lora else "")
                + (f"; {self.note}" if self.note else ""))


def _device(requested: str | None) -> tuple[str, str | None]:
    """The device to run on, and why not a GPU when one was not asked for and none is usable."""
    if requested == "cpu":
        return "cpu", None
    why = cuda_unavailable()
    if why and requested == "cuda":
        raise PlanError(f"--device cuda, but no CUDA GPU is usable here ({why})")
    return ("cpu", why) if why else ("cuda", None)


def choose_device(requested: str | None) -> str:
    """'cuda' when a CUDA GPU is usable through pycuda (or asked for), else 'cpu'."""
    return _device(requested)[0]


def bf16_unsupported(config) -> str | None:
    """Why the bf16 kernels cannot train this model on this GPU, or None when they can."""
    capability = runtime().device.compute_capability()
    if capability < (8, 0):
        return f"bf16 tensor cores need compute capability 8.0 or newer, this GPU has {capability}"
    if config.head_dim not in HEAD_DIMS:
        return f"flash attention takes head_dim {' or '.join(map(str, HEAD_DIMS))}, this model's is {config.head_dim}"
    if config.dim % VECTOR or config.vocab_size % VECTOR:
        return f"bf16 rows must hold multiples of {VECTOR} values: dim {config.dim}, vocab {config.vocab_size}"
    return None


def fp8_unsupported(config) -> str | None:
    """Why the FP8 linear layers cannot train this model on this GPU, or None when they can."""
    if runtime().code != "sm_90a":
        return f"FP8 GEMMs are wgmma kernels for sm_90a (Hopper), this GPU is {runtime().code}"
    widths = {"dim": config.dim, "n_heads * head_dim": config.n_heads * config.head_dim,
              "ffn_hidden_dim": config.ffn_hidden_dim}
    odd = [f"{name} {value}" for name, value in widths.items() if value % FP8_ROW]
    return f"FP8 rows hold multiples of {FP8_ROW} values: {', '.join(odd)}" if odd else None


def choose_recipe(path: str, recompute: str | None, optimizer: str | None, in_backward: bool | None = None,
                  gpus: int = 1) -> dict:
    """The path's memory recipe: what was asked for, else its defaults; PlanError for what it does not run
    (on gpus GPUs)."""
    recomputes, optimizers, in_backwards = RECIPES[path]
    where = "the numpy reference" if path == "cpu" else f"the {path} GPU model"
    if in_backward and gpus > 1:
        raise PlanError("--optimizer-in-backward runs on one GPU: on several, ZeRO reduce-scatters the gradients "
                        "as the backward goes")
    if in_backward and True not in in_backwards:
        raise PlanError(f"--optimizer-in-backward: {where} updates after the backward; the CPU reference runs every "
                        "recipe")
    for option, value, allowed in (("recompute", recompute, recomputes), ("optimizer", optimizer, optimizers)):
        if value is not None and value not in allowed:
            raise PlanError(f"--{option} {value}: {where} runs {' or '.join(allowed)}"
                            + ("; the CPU reference runs every recipe" if path != "cpu" else ""))
    return {"recompute": recompute or recomputes[0], "optimizer": optimizer or optimizers[0],
            "in_backward": bool(in_backward)}


def check_zero(zero: int | None, gpus: int, dtype: str | None) -> None:
    """PlanError for a ZeRO stage (None: the plan's choice) that a run on gpus GPUs in dtype cannot take."""
    if zero is not None and zero not in ZERO_STAGES:
        raise PlanError(f"--zero {zero}: choose from {', '.join(map(str, ZERO_STAGES))}")
    if zero not in (None, 1) and gpus == 1:
        raise PlanError(f"--zero {zero} shards over several GPUs; on one, everything is held once (stage 1)")
    if zero is not None and zero not in zero_stages(dtype):
        raise PlanError("--zero 3 with --dtype fp8: the FP8 casts of every weight are made at the forward's start, "
                        "when ZeRO-3 holds two layers; take --zero 2")


def check_reduce_dtype(reduce_dtype: str | None, gpus: int, dtype: str | None) -> None:
    """PlanError for a reduce-scatter dtype (None: fp32) that a run on gpus GPUs in dtype cannot take."""
    if reduce_dtype not in (None, "fp32") and (gpus == 1 or dtype == "fp32" or reduce_dtype not in REDUCE_DTYPES):
        raise PlanError(f"--reduce-dtype {reduce_dtype}: the gradients' reduce-scatter on several GPUs runs in "
                        "fp32 or bf16, and in fp32 on the exact path")


def choose_doc_mask(doc_mask: str | None, sft: bool) -> bool:
    """Whether attention is document-masked: --doc-mask on or off, auto (None) on with --sft only; PlanError for
    --sft with the mask off (packed conversations must not see each other)."""
    if doc_mask is not None and doc_mask not in DOC_MASKS:
        raise PlanError(f"--doc-mask {doc_mask}: choose from {', '.join(DOC_MASKS)}")
    if sft and doc_mask == "off":
        raise PlanError("--sft with --doc-mask off: conversations packed into one row would attend to each other; "
                        "--sft takes the document mask (leave --doc-mask at auto or on)")
    return doc_mask == "on" or (doc_mask in (None, "auto") and sft)


def document_start(options: RunOptions) -> int | None:
    """The token id that starts a document where attention is document-masked (choose_doc_mask), else None;
    PlanError when the mask is on and the options name no BOS id."""
    if not choose_doc_mask(options.doc_mask, options.sft):
        return None
    if options.bos_id is None:
        raise PlanError("the document mask needs the tokenizer's BOS id (RunOptions.bos_id)")
    return options.bos_id


def choose_lora(options: RunOptions, device: str, dtype: str) -> dict:
    """The plan's lora (a LoraSpec, or None for a full fine-tune) and qlora; PlanError for what the adapters do not
    run with: on the GPU the fp8 linear layers, the fp32 path, ZeRO-3, targets that split a fused GEMM; on the CPU the
    fp8 casts; anywhere the optimizer in the backward and a dropout (not yet)."""
    o = options
    if o.lora is None:
        if o.qlora or o.lora_alpha is not None or o.lora_targets is not None or o.lora_dropout:
            raise PlanError("--qlora, --lora-alpha, --lora-dropout and --lora-targets go with --lora RANK")
        return {"lora": None, "qlora": False}
    targets = tuple(t.strip() for t in o.lora_targets.split(",")) if o.lora_targets else tuple(LORA_TARGETS)
    try:
        spec = LoraSpec(o.lora, o.lora_alpha if o.lora_alpha is not None else LoraSpec.alpha, o.lora_dropout, targets)
    except ValueError as e:
        raise PlanError(f"--lora: {e}") from None
    stacked = max(len(set(group) & set(targets)) for group in LORA_GEMMS)  # the most targets one GEMM adapts
    refused = [(spec.dropout > 0, "--lora-dropout: only 0 trains for now"),
               (o.in_backward, "--optimizer-in-backward with --lora: the adapters' gradients are small; drop it"),
               (device == "cuda" and dtype in ("fp8", "fp32"), f"--dtype {dtype} with --lora: the adapters run on "
                "the bf16 GPU model"),
               (device == "cpu" and dtype == "fp8", "--dtype fp8 with --lora: on the CPU the adapters run beside the "
                "reference's exact fp32 linear layers"),
               (device == "cuda" and o.zero == 3, "--zero 3 with --lora: the frozen base is held whole on each GPU; "
                "take --zero 1 or 2"),
               (device == "cuda" and (spec.rank % 8 or stacked * spec.rank > LORA_MAX_K),
                f"--lora {spec.rank}: on the GPU a multiple of 8, and at most {LORA_MAX_K // stacked} with "
                f"{stacked} targets in one GEMM (kernels/lora.cu's LORA_MAX_K)"),
               (device == "cuda" and bool(spec.split_gemms()), "--lora-targets: on the GPU "
                + " and ".join(",".join(g) for g in spec.split_gemms()) + " run as one GEMM, so adapt them together")]
    for refuse, why in refused:
        if refuse:
            raise PlanError(why)
    return {"lora": spec, "qlora": o.qlora}


def cpu_plan(**options) -> Plan:
    """The plan of the numpy reference with these RunOptions (what a test or a script on the CPU builds it from)."""
    return make_plan(None, RunOptions(device="cpu", **options))


def make_plan(config, options: RunOptions = RunOptions(), free_memory: int | None = None) -> Plan:
    """The plan of a run of this model with these options (llama/options.py RunOptions): device None picks the
    GPU where one is usable; dtype None picks bf16 wherever its kernels take the model, else the exact fp32
    path; recompute, optimizer and in_backward None take the path's defaults (RECIPES); fp8_scaling None is
    row-wise; zero None on several GPUs is the lowest ZeRO stage whose buffers for the options' (B, T) batches
    fit in free_memory bytes (None: this GPU's free memory; the trainer passes the least over the ranks, so that
    they all take the same stage; stage 1 without a batch); reduce_dtype None reduces the gradients in fp32;
    doc_mask and sft as choose_doc_mask says, the mask's documents starting at the options' bos_id."""
    o = options
    masks = {"doc_mask_bos": document_start(o), "sft": o.sft}
    if o.fp8_scaling is not None and o.dtype != "fp8":
        raise PlanError(f"--fp8-scaling {o.fp8_scaling}: the scaling of --dtype fp8's casts, and this run's dtype is "
                        f"{o.dtype or 'not fp8'}")
    if o.fp8_scaling is not None and o.fp8_scaling not in FP8_SCALINGS:
        raise PlanError(f"--fp8-scaling {o.fp8_scaling}: choose from {', '.join(FP8_SCALINGS)}")
    fp8_scaling = o.fp8_scaling or FP8_SCALINGS[0]
    check_zero(o.zero, o.gpus, o.dtype)
    check_reduce_dtype(o.reduce_dtype, o.gpus, o.dtype)
    device, why_no_gpu = _device(o.device)
    if device == "cpu":  # the numpy reference: fp32, or fp8 as its twin of the FP8 linear layers
        if o.dtype == "bf16":
            raise PlanError("--dtype bf16 needs a CUDA GPU; the CPU reference computes in fp32 (or fp8's casts)")
        return Plan("cpu", o.dtype or "fp32", "CPU",
                    note=f"no usable CUDA GPU or pycuda ({why_no_gpu})" if why_no_gpu else "",
                    **choose_recipe("cpu", o.recompute, o.optimizer, o.in_backward), fp8_scaling=fp8_scaling, **masks,
                    **choose_lora(o, "cpu", o.dtype or "fp32"), options=o)
    why_not_bf16 = bf16_unsupported(config)
    if o.dtype in ("bf16", "fp8") and why_not_bf16:
        raise PlanError(f"--dtype {o.dtype}: {why_not_bf16}")
    if o.dtype == "fp8" and fp8_unsupported(config):
        raise PlanError(f"--dtype fp8: {fp8_unsupported(config)}")
    dtype = o.dtype or ("fp32" if why_not_bf16 else "bf16")
    check_reduce_dtype(o.reduce_dtype, o.gpus, dtype)  # the exact path the plan fell back to reduces in fp32
    recipe = choose_recipe(dtype, o.recompute, o.optimizer, o.in_backward, o.gpus)
    if recipe["in_backward"] and dtype != "fp32":  # each layer's update starts a whole 16-byte vector (8-bit: block)
        unit = QUANT_BLOCK if recipe["optimizer"] == "adamw8bit" else 16
        if config.dim % unit:
            raise PlanError(f"--optimizer-in-backward with {recipe['optimizer']} on the GPU needs dim a multiple of "
                            f"{unit}, so that each layer's weights start a whole {'block' if unit > 16 else 'vector'}; "
                            f"this model's is {config.dim}")
    rt = runtime()
    peaks = FP32_PEAK_FLOPS if dtype == "fp32" else BF16_PEAK_FLOPS  # fp8: MFU against the bf16 peak
    # several GPUs: the GEMMs claim their tiles, so that NCCL's kernels beside them delay them less (bench_multi_gpu.py:
    # 1B at ZeRO-2 on 2 H100s, 284.0 ms a step with versions 5/6, 278.2 with 8/7)
    plan = Plan("cuda", dtype, f"GPU {rt.name} ({rt.code})", gemm_chooser(dynamic=o.gpus > 1),
                *(ATTENTION_HOPPER if rt.code == "sm_90a" else ATTENTION),
                next((v for k, v in peaks.items() if k in rt.name), None),
                f"not bf16: {why_not_bf16}" if dtype == "fp32" and why_not_bf16 else "", **recipe,
                fp8_scaling=fp8_scaling, fp8_gemm=gemm_chooser(fp8=True) if dtype == "fp8" else None,
                zero=o.zero or 1, reduce_dtype=o.reduce_dtype or "fp32", **masks, **choose_lora(o, "cuda", dtype),
                options=o)
    if o.zero is None and o.gpus > 1 and o.batch is not None:
        available = gpu_free() if free_memory is None else free_memory
        plan = replace(plan, zero=choose_zero(plan, config, *o.batch, o.gpus, available))
    return plan


def evaluation_plan(config, device: str | None = None, dtype: str | None = None) -> Plan:
    """The plan of a model that only scores: no optimizer, so no gradients and no moments (an 8B model's weights
    fit where its training state would not), and each layer keeps only its input (recompute full) where the path
    runs that, since no backward follows (the forward computes the same either way)."""
    plan = make_plan(config, RunOptions(device, dtype))
    if "full" in RECIPES[plan.path][0]:
        plan = make_plan(config, RunOptions(device, plan.dtype, "full"))
    return replace(plan, optimizer=None)
