"""The softmax cross-entropy's launchers (kernels/classifier.cu; twin llama/twins/classifier.py): the losses
and the logits' gradient written over them, fp32 and bf16, and the bf16 path's loss sum. A target < 0 is not
counted: its loss and gradient are 0."""

from __future__ import annotations

import math

import numpy as np

from ..runtime.cuda import BF16, DeviceArray, runtime
from .common import I32, check, kernel, multiprocessors


CLASSIFIER_BLOCK = 1024  # threads per block of the classifier kernels


def _scalar_pointer(name: str, scalar: DeviceArray | None) -> int:
    """The device address of an optional fp32 scalar (1,), 0 for None."""
    if scalar is None:
        return 0
    check(name, scalar, (1,))
    return scalar.ptr


def fused_classifier(logits: DeviceArray, losses: DeviceArray, targets: DeviceArray, dloss: float) -> None:
    """losses (N,) of the (N, V) logits; the logits are overwritten by dlogits = (softmax - onehot) * dloss."""
    N, V = logits.shape
    check("losses", losses, (N,))
    check("targets", targets, (N,), I32)
    kernel("classifier", "fused_classifier", "PPPif")((N,), CLASSIFIER_BLOCK, logits.ptr, losses.ptr, targets.ptr,
                                                       V, np.float32(dloss))


def _max_shared_bytes() -> int:
    """Dynamic shared memory one block may opt in to on this GPU, less room for static shared memory."""
    drv = runtime().drv
    return runtime().device.get_attribute(drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) - 1024


def fused_classifier_bf16(logits: DeviceArray, losses: DeviceArray, targets: DeviceArray, dloss: float,
                          dloss_scale: DeviceArray | None = None) -> None:
    """For a chunk of n tokens: losses (n,) fp32 of the bf16 logits (n, V), any V; the logits are
    overwritten by dlogits = (softmax - onehot) * dloss in bf16, dloss times the device scalar dloss_scale (1,)
    if given (read when the kernel runs: a captured graph's per-step scale)."""
    n, V = logits.shape
    check("logits", logits, (n, V), BF16)
    check("losses", losses, (n,))
    check("targets", targets, (n,), I32)
    scale_ptr = _scalar_pointer("dloss_scale", dloss_scale)
    # thread t keeps vectors t + k * CLASSIFIER_BLOCK of a row: as many slots as shared memory holds,
    # then CLASSIFIER_REG_VECTORS in registers (kernels/classifier.cu); one block per multiprocessor
    smem_slots = min(math.ceil(V // 8 / CLASSIFIER_BLOCK), _max_shared_bytes() // (16 * CLASSIFIER_BLOCK))
    kernel("classifier", "fused_classifier_bf16", "PPPiifiP")(
        (max(1, min(n, multiprocessors())),), CLASSIFIER_BLOCK, logits.ptr, losses.ptr, targets.ptr, n, V,
        np.float32(dloss), smem_slots, scale_ptr, shared=smem_slots * CLASSIFIER_BLOCK * 16)


def loss_accumulate_bf16(total: DeviceArray, losses: DeviceArray, scale: float,
                         scale_at: DeviceArray | None = None) -> None:
    """total (1,) += scale * sum(losses (n,)), fp32, in a fixed order; scale times the device scalar scale_at (1,)
    if given."""
    check("total", total, (1,))
    check("losses", losses, (losses.size,))
    scale_ptr = _scalar_pointer("scale_at", scale_at)
    kernel("classifier", "loss_accumulate_bf16", "PPifP")((1,), 1024, total.ptr, losses.ptr, losses.size,
                                                        np.float32(scale), scale_ptr)
