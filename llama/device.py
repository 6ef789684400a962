"""One place decides what runs on this device: the training dtype and each kernel family's version.

The trainer prints describe() in one line at start. Versions are the rungs of the kernel ladders
(dev/cuda/README.md): the best one the device can run is chosen here and nowhere else.
"""

from __future__ import annotations

import functools

from .cuda import runtime

DTYPES = ("bf16", "fp32")
BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense tensor-core bf16, datasheets
FP32_PEAK_FLOPS = {"H100": 67e12, "H200": 67e12, "A100": 19.5e12}  # non-tensor fp32, datasheets


@functools.cache
def _capability() -> tuple[int, int]:
    capability = runtime().device.compute_capability()
    if capability < (8, 0):
        raise RuntimeError(f"bf16 tensor-core kernels need compute capability 8.0 or newer, not {capability}")
    return capability


def gemm_version(M: int | None = None, N: int | None = None, K: int | None = None) -> str:
    """bf16 GEMM for an (M, N, K) problem (None: the family's name for the one-line summary).
    Hopper: version 3 ('wgmma3', ping-pong consumers, split-K in the kernel) where it measured faster
    than version 2 ('wgmma', cooperative 128x256 tiles): short K with N up to 16384, or few output
    tiles; version 2 for long K over many tiles and for the vocabulary-wide head
    (scripts/bench_matmul.py, H200; dev/cuda/README.md). Other GPUs from sm_80: 'mma' (version 1)."""
    if _capability() != (9, 0):
        return "mma"
    if M is None:
        return "wgmma/wgmma3"
    return "wgmma3" if (K <= 4096 and N <= 16384) or M * N <= 8 * 2**20 else "wgmma"


def attention_version() -> str:
    """bf16 flash attention: version 2 (FA2-style on mma.sync, kernels/flash_attention.cu) from sm_80 on."""
    return "flash v2 (mma.sync)"


def bf16_unsupported(config) -> str | None:
    """Why the bf16 kernels cannot train this model on this GPU, or None when they can."""
    capability = runtime().device.compute_capability()
    if capability < (8, 0):
        return f"bf16 tensor cores need compute capability 8.0 or newer, this GPU has {capability}"
    if config.head_dim not in (64, 128):
        return f"flash attention takes head_dim 64 or 128, this model's is {config.head_dim}"
    if config.dim % 8 or config.vocab_size % 8:
        return f"bf16 rows must hold multiples of 8 values: dim {config.dim}, vocab {config.vocab_size}"
    return None


def default_dtype(config) -> str:
    """bf16 wherever its kernels take the model, else the exact fp32 path."""
    return "fp32" if bf16_unsupported(config) else "bf16"


def peak_flops(dtype: str) -> float | None:
    """The datasheet peak of the dtype in use on this GPU, for MFU; None when unknown."""
    table = BF16_PEAK_FLOPS if dtype == "bf16" else FP32_PEAK_FLOPS
    return next((v for k, v in table.items() if k in runtime().name), None)


def describe(dtype: str, config) -> str:
    """The one line the trainer prints: what runs on this device, and why fp32 if bf16 cannot."""
    rt = runtime()
    if dtype == "bf16":
        kernels = f"gemm {gemm_version()}, attention {attention_version()}, CUDA graphs"
    else:
        why = bf16_unsupported(config)
        kernels = "fp32 kernels (the exact path)" + (f"; not bf16: {why}" if why else "")
    return f"GPU {rt.name} ({rt.code}) | dtype {dtype} | {kernels}"
