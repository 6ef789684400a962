"""The bf16 model's linear layers on FP8 casts (--dtype fp8, the plan's dtype "fp8", Hopper): the seven linear
layers of each block run their forward, dX and dW GEMMs on FP8 e4m3 casts with row-wise power-of-two scales
(ops.cast_fp8, ops.gemm_fp8), whose twins are reference.matmul_fp8_forward/backward: the input along its rows
(forward) and transposed (dW), the output's gradient the same two ways (dX, dW), the weight along its rows
(forward) and transposed (dX), cast from the bf16 copy at the start of every forward. The plan's fp8_scaling
"tensor" (the comparison) gives each cast one scale, that of the whole operand's amax."""

from __future__ import annotations

from .. import ops
from ..runtime.cuda import FP8, DeviceArray, empty
from .bf16_block import BF16Block
from .shapes import fp8_shapes, linear_weights


class FP8Linears(BF16Block):
    """BF16Block's linear layers on FP8 casts when self.fp8 (else the bf16 GEMMs); its user holds B, T, zero
    (llama/parallel/zero.py) and the plan's fp8_scaling and fp8_gemm."""

    def _allocate_fp8(self) -> None:
        """The casts' scratch (fp8_shapes) and each linear weight's two FP8 copies with their scales (its rows
        for the forward, its transpose for dX), by the address of the bf16 weight they are cast from."""
        shapes = fp8_shapes(self.config, self.B, self.T)
        self.fp8_scratch = {name: empty(shape, dtype) for name, (shape, dtype) in shapes.items()}
        self.fp8_weights = {}
        for i in range(self.config.n_layers):
            for tensor in linear_weights(self.layout, i):
                rows, cols = tensor.shape
                self.fp8_weights[self.weight(tensor).ptr] = (
                    empty((rows, cols), FP8), empty(rows), empty((cols, rows), FP8), empty(cols))

    def _cast_weights(self) -> None:
        """Every linear weight's FP8 copies from its bf16 copy (the start of a forward)."""
        for i in range(self.config.n_layers):
            self.zero.use_weights(self.layout.wqkv(i).offset)  # gathered (stages 1-2; stage 3 has no FP8)
            for tensor in linear_weights(self.layout, i):
                weight = self.weight(tensor)
                q, scales, q_t, scales_t = self.fp8_weights[weight.ptr]
                self._cast_fp8(weight, rows=q, row_scales=scales, cols=q_t, col_scales=scales_t)

    def _cast_fp8(self, x: DeviceArray, **outputs) -> None:
        """ops.cast_fp8 of x into outputs, with the plan's scaling and the casts' amax scratch."""
        ops.cast_fp8(x, **outputs, amax=self.fp8_scratch["amax"], scaling=self.plan.fp8_scaling)

    def swiglu_backward(self, dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray) -> DeviceArray | None:
        """BF16Block's; FP8 with row-wise scales: dgate_up's row and column maxima too, in the scratch it returns,
        so that gate+up's backward casts dgate_up without an amax pass of its own."""
        if not self.fp8 or self.plan.fp8_scaling != "row":
            return super().swiglu_backward(dgate_up, dout, gate_up)
        ops.swiglu_backward_bf16(dgate_up, dout, gate_up, amax=self.fp8_scratch["grad_amax"])
        return self.fp8_scratch["grad_amax"]

    def linear_forward(self, out: DeviceArray, x: DeviceArray, weight: DeviceArray, rope: tuple | None = None) -> None:
        """BF16Block's; FP8: on the casts of x along its rows and of the weight (reference.matmul_fp8_forward)."""
        if not self.fp8:
            super().linear_forward(out, x, weight, rope)
            return
        (N, IC), f = x.shape, self.fp8_scratch
        x_q, x_scales = f["input"].prefix(N, IC), f["input_scales"].prefix(N)
        self._cast_fp8(x, rows=x_q, row_scales=x_scales)
        w_q, w_scales, _, _ = self.fp8_weights[weight.ptr]
        ops.gemm_fp8(out, x_q, x_scales, w_q, w_scales, rope=rope, version=self.plan.fp8_gemm)

    def linear_backward(self, dx: DeviceArray, dweight: DeviceArray, dout: DeviceArray, x: DeviceArray,
                        weight: DeviceArray, dout_amax: DeviceArray | None = None) -> None:
        """BF16Block's; FP8: on the casts reference.matmul_fp8_backward takes, each along its GEMM's K (dout's
        from the maxima its producer wrote into dout_amax, where it did)."""
        if not self.fp8:
            super().linear_backward(dx, dweight, dout, x, weight)
            return
        (N, IC), OC, f = x.shape, dout.shape[-1], self.fp8_scratch
        g_q, g_scales = f["grad"].prefix(N, OC), f["grad_scales"].prefix(N)
        g_t, g_t_scales = f["grad_t"].prefix(OC, N), f["grad_t_scales"].prefix(OC)
        outputs = dict(rows=g_q, row_scales=g_scales, cols=g_t, col_scales=g_t_scales)
        if dout_amax is None:
            self._cast_fp8(dout, **outputs)
        else:
            ops.cast_fp8(dout, **outputs, amax=dout_amax, amax_ready=True)
        x_t, x_t_scales = f["input"].prefix(IC, N), f["input_scales"].prefix(IC)
        self._cast_fp8(x, cols=x_t, col_scales=x_t_scales)
        ops.gemm_fp8(dweight, g_t, g_t_scales, x_t, x_t_scales, accumulate=True, version=self.plan.fp8_gemm)
        _, _, w_t, w_t_scales = self.fp8_weights[weight.ptr]
        ops.gemm_fp8(dx, g_q, g_scales, w_t, w_t_scales, version=self.plan.fp8_gemm)
