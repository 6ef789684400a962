"""The fp32 path's residual add (kernels/residual.cu; twin llama/twins/residual.py). The bf16 path fuses it
into the next RMSNorm (ops.rmsnorm_residual_forward_bf16)."""

from __future__ import annotations

from ..runtime.cuda import DeviceArray
from .common import BLOCK, blocks, check, kernel


def residual_forward(out: DeviceArray, x: DeviceArray, branch: DeviceArray) -> None:
    check("x", x, out.shape)
    check("branch", branch, out.shape)
    kernel("residual", "residual_forward", "PPPq")(blocks(out.size), BLOCK, out.ptr, x.ptr, branch.ptr, out.size)
