"""The linear layers of the bf16 block, one strategy per way of multiplying, behind one interface:

  forward(out, x, tensor, rope=None)      out (N, OC) = x (N, IC) @ W^T, W the layout's tensor (a matrix of a
                                          block: the fused qkv, wo, the fused w1/w3, w2); rope as ops.gemm's
  backward(dx, dout, x, tensor, dout_amax=None)
                                          the weight's gradient (W's gradient += dout^T @ x, where the strategy
                                          trains W) and dx (N, IC) = dout @ W (dx may be x's buffer); dout_amax:
                                          what swiglu_backward returned for dout
  swiglu_backward(dgate_up, dout, gate_up) SwiGLU's backward, which writes the gradient gate+up's backward
                                          takes: returns what that backward takes as dout_amax
  prepare()                               at the start of every forward (the FP8 casts of the weights)

BF16Linears, here, runs bf16 GEMMs on the weights' bf16 copy; fp8_linears.py's FP8Linears (--dtype fp8) runs them
on FP8 casts.

A strategy is built with the plan, `weights` (tensor -> the bf16 DeviceArray the GEMMs read) and `gradients`
(tensor -> where its fp32 gradient accumulates), so the block names a layer by its tensor and never by buffer.
"""

from __future__ import annotations

from .. import ops
from ..runtime.cuda import DeviceArray


class BF16Linears:
    """The block's linear layers as bf16 GEMMs, with the plan's GEMM version for each problem's shape."""

    def __init__(self, plan, weights, gradients):
        self.plan, self.weights, self.gradients = plan, weights, gradients

    def gemm(self, c: DeviceArray, a: DeviceArray, b: DeviceArray, **options) -> None:
        """ops.gemm with the plan's GEMM version for the problem's shape."""
        ops.gemm(c, a, b, version=self.plan.gemm, **options)

    def prepare(self) -> None:
        """Nothing to do at a forward's start."""

    def forward(self, out: DeviceArray, x: DeviceArray, tensor, rope: tuple | None = None) -> None:
        self.gemm(out, x, self.weights(tensor), trans_b=True, rope=rope)

    def backward(self, dx: DeviceArray, dout: DeviceArray, x: DeviceArray, tensor,
                 dout_amax: DeviceArray | None = None) -> None:
        self.gemm(self.gradients(tensor), dout, x, trans_a=True, accumulate=True)
        self.gemm(dx, dout, self.weights(tensor))

    def swiglu_backward(self, dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray) -> DeviceArray | None:
        """ops.swiglu_backward_bf16 (in place if dgate_up is gate_up); nothing for gate+up's backward."""
        ops.swiglu_backward_bf16(dgate_up, dout, gate_up)
        return None
