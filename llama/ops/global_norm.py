"""The gradient norm's launchers (kernels/global_norm.cu; twin llama/optim.py's global_norm and
clip_norm_estimate): the squared norm over a fixed grid of NORM_BLOCKS, so it is the same on every GPU,
fp32 (two launches) and bf16 path (one); the optimizer-in-backward's clip estimate."""

from __future__ import annotations

from ..runtime.cuda import DeviceArray
from .common import BLOCK, F64, check, check_vectors, kernel

NORM_BLOCKS = 512  # fixed, so that the grad norm is the same on every GPU


def global_norm_squared(out: DeviceArray, partial: DeviceArray, x: DeviceArray) -> None:
    """out (1,) = sum(x^2), deterministic; partial (NORM_BLOCKS,) is scratch."""
    check("out", out, (1,))
    check("partial", partial, (NORM_BLOCKS,))
    kernel("global_norm", "global_norm_partial", "PPq")((NORM_BLOCKS,), BLOCK, partial.ptr, x.ptr, x.size)
    kernel("global_norm", "global_norm_finish", "PPi")((1,), 1024, out.ptr, partial.ptr, NORM_BLOCKS)


def global_norm_squared_bf16(out: DeviceArray, scratch: DeviceArray, grads: DeviceArray) -> None:
    """out (1,) = sum(grads^2) of the flat fp32 gradients, deterministic, in one launch; scratch
    float64 (NORM_BLOCKS + 1,), zeroed once (its last word holds the completion counter)."""
    check("out", out, (1,))
    check("scratch", scratch, (NORM_BLOCKS + 1,), F64)
    check("grads", grads, grads.shape)
    check_vectors(8, grads=grads, scratch=scratch)
    kernel("global_norm", "global_norm_squared_bf16", "PPPPq")((NORM_BLOCKS,), BLOCK, out.ptr, scratch.ptr,
                                                         scratch.ptr + NORM_BLOCKS * 8, grads.ptr, grads.size)


def clip_norm_estimate(out: DeviceArray, current: DeviceArray, previous: DeviceArray, group: int) -> None:
    """out (1,) = the squared norm by which the optimizer in the backward clips `group`'s update:
    sum(current[group:]) + sum(previous[:group]), this step's squared group norms (current (P,), final
    from `group` on) and the last step's (llama/optim.py's clip_norm_estimate), fp32 in a fixed order."""
    check("out", out, (1,))
    check("current", current, (current.size,))
    check("previous", previous, (current.size,))
    if not 0 <= group < current.size:
        raise ValueError(f"group {group} outside the {current.size} groups")
    kernel("global_norm", "clip_norm_estimate", "PPPii")((1,), 32, out.ptr, current.ptr, previous.ptr, group,
                                                         current.size)
