"""The block's linear layers on FP8 casts (--dtype fp8, the plan's dtype "fp8", Hopper), with linears.py's interface:
the forward, dX and dW GEMMs on FP8 e4m3 casts with row-wise power-of-two scales (ops.cast_fp8, ops.gemm_fp8),
whose twins are reference.matmul_fp8_forward/backward: the input along its rows (forward) and transposed (dW), the
output's gradient the same two ways (dX, dW), the weight along its rows (forward) and transposed (dX), cast from
the bf16 copy at the start of every forward. The plan's fp8_scaling "tensor" (the comparison) gives each cast one
scale, that of the whole operand's amax.
"""

from __future__ import annotations

from .. import ops
from ..runtime.cuda import DeviceArray, allocate
from .shapes import fp8_shapes, fp8_weight_copies, linear_weights


class FP8Linears:
    """The block's linear layers on FP8 casts; B x T sizes the casts' scratch, zero (llama/parallel/zero.py) gathers
    each layer's weights before their casts."""

    def __init__(self, plan, weights, gradients, config, layout, B: int, T: int, zero):
        self.plan, self.weights, self.gradients, self.config, self.layout, self.zero = (
            plan, weights, gradients, config, layout, zero)
        self.scratch = allocate(fp8_shapes(config, B, T))
        # each linear weight's two FP8 copies with their scales (its rows, its transpose), by the weight's offset
        self.casts = {offset: tuple(allocate(copy).values()) for i in range(config.n_layers)
                      for offset, copy in fp8_weight_copies(layout, i).items()}

    def prepare(self) -> None:
        """Every linear weight's FP8 copies from its bf16 copy (the start of a forward)."""
        for i in range(self.config.n_layers):
            self.zero.use_weights(self.layout.wqkv(i).offset)  # gathered (stages 1-2; stage 3 has no FP8)
            for tensor in linear_weights(self.layout, i):
                q, scales, q_t, scales_t = self.casts[tensor.offset]
                self._cast(self.weights(tensor), rows=q, row_scales=scales, cols=q_t, col_scales=scales_t)

    def _cast(self, x: DeviceArray, **outputs) -> None:
        """ops.cast_fp8 of x into outputs, with the plan's scaling and the casts' amax scratch."""
        ops.cast_fp8(x, **outputs, amax=self.scratch["amax"], scaling=self.plan.fp8_scaling)

    def forward(self, out: DeviceArray, x: DeviceArray, tensor, rope: tuple | None = None) -> None:
        """On the casts of x along its rows and of the weight (reference.matmul_fp8_forward)."""
        (N, IC), f = x.shape, self.scratch
        x_q, x_scales = f["input"].prefix(N, IC), f["input_scales"].prefix(N)
        self._cast(x, rows=x_q, row_scales=x_scales)
        w_q, w_scales, _, _ = self.casts[tensor.offset]
        ops.gemm_fp8(out, x_q, x_scales, w_q, w_scales, rope=rope, version=self.plan.fp8_gemm)

    def backward(self, dx: DeviceArray, dout: DeviceArray, x: DeviceArray, tensor,
                 dout_amax: DeviceArray | None = None) -> None:
        """On the casts reference.matmul_fp8_backward takes, each along its GEMM's K (dout's from the maxima its
        producer wrote into dout_amax, where it did)."""
        (N, IC), OC, f = x.shape, dout.shape[-1], self.scratch
        g_q, g_scales = f["grad"].prefix(N, OC), f["grad_scales"].prefix(N)
        g_t, g_t_scales = f["grad_t"].prefix(OC, N), f["grad_t_scales"].prefix(OC)
        outputs = dict(rows=g_q, row_scales=g_scales, cols=g_t, col_scales=g_t_scales)
        if dout_amax is None:
            self._cast(dout, **outputs)
        else:
            ops.cast_fp8(dout, **outputs, amax=dout_amax, amax_ready=True)
        x_t, x_t_scales = f["input"].prefix(IC, N), f["input_scales"].prefix(IC)
        self._cast(x, cols=x_t, col_scales=x_t_scales)
        ops.gemm_fp8(self.gradients(tensor), g_t, g_t_scales, x_t, x_t_scales, accumulate=True,
                     version=self.plan.fp8_gemm)
        _, _, w_t, w_t_scales = self.casts[tensor.offset]
        ops.gemm_fp8(dx, g_q, g_scales, w_t, w_t_scales, version=self.plan.fp8_gemm)

    def swiglu_backward(self, dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray) -> DeviceArray | None:
        """With row-wise scales, dgate_up's row and column maxima too, in the scratch it returns, so that gate+up's
        backward casts dgate_up without an amax pass of its own."""
        if self.plan.fp8_scaling != "row":
            ops.swiglu_backward_bf16(dgate_up, dout, gate_up)
            return None
        ops.swiglu_backward_bf16(dgate_up, dout, gate_up, amax=self.scratch["grad_amax"])
        return self.scratch["grad_amax"]
