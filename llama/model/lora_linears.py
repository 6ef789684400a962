"""The block's linear layers with LoRA adapters (--lora), with linears.py's interface: the frozen base's GEMM, and
beside it each adapted GEMM's update scale * (x A^T) B^T (llama/twins/lora.py is the twin), A and B the stacks of
the GEMM's targets (llama/params.py AdapterLayout: the fused qkv's q, k, v, w1/w3's gate and up, o and down alone).

Forward, for a GEMM of m targets and rank r (out (N, OC), x (N, IC)):
    out = x W^T (the base GEMM; RoPE in its epilogue for the qkv)
    xa = x A^T                         (N, m r), a skinny GEMM
    out += scale * xa[target's r] B^T  ops.lora_add_bf16, RoPE'd like the base's output for the qkv
Backward, from dout (N, OC), never W's gradient:
    xa = x A^T                         again (cheaper than keeping it)
    dxa = scale * dout Bd              (N, m r), Bd the block-diagonal spread of B (ops.lora_block_diagonal_bf16)
    dA += dxa^T x                      (m r, IC), accumulated in fp32
    dB += scale * dout^T xa            its block-diagonal part (ops.lora_take_blocks_f32) where m > 1
    dx = dout W + dxa A                the base GEMM, then ops.lora_add_bf16 with A read transposed
(dx may be x's buffer: everything that reads x runs before the GEMM that overwrites it.)
The strategy is built with the plan, the base's weights (tensor -> bf16, model/frozen_base.py), the adapters'
weights and gradients (adapter tensor -> bf16 copy, fp32 gradient: the optimizer's, Zero's) and their layout."""

from __future__ import annotations

from .. import ops
from ..runtime.cuda import DeviceArray, allocate
from .linears import BF16Linears
from .shapes import lora_scratch


class LoRALinears:
    def __init__(self, plan, base_weights, adapter_weights, adapter_gradients, adapters, config, N: int):
        self.plan, self.spec = plan, plan.lora
        self.base = BF16Linears(plan, base_weights, None)  # the base's forward and input gradient
        self.weights, self.gradients = adapter_weights, adapter_gradients
        self.scratch = allocate(lora_scratch(config, self.spec, N))
        # each adapted GEMM by its base weight's offset (the fused qkv's is wq's): (A stack, B stack, rows by target)
        self.adapted = {weights[0].offset: (a, b, [w.shape[0] for w in weights])
                        for layer in adapters.gemms for _, a, b, weights in layer}

    def prepare(self) -> None:
        """Nothing to do at a forward's start."""

    def swiglu_backward(self, dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray) -> DeviceArray | None:
        return self.base.swiglu_backward(dgate_up, dout, gate_up)

    def _xa(self, x: DeviceArray, a) -> DeviceArray:
        """x A^T into the scratch, (N, m r)."""
        xa = self.scratch["xa"].prefix(x.shape[0], a.shape[0])
        self.base.gemm(xa, x, self.weights(a), trans_b=True)
        return xa

    def forward(self, out: DeviceArray, x: DeviceArray, tensor, rope: tuple | None = None) -> None:
        self.base.forward(out, x, tensor, rope)
        if tensor.offset in self.adapted:
            a, b, rows = self.adapted[tensor.offset]
            ops.lora_add_bf16(out, self._xa(x, a), self.weights(b), self.spec.scale, rows, self.spec.rank, rope=rope)

    def backward(self, dx: DeviceArray, dout: DeviceArray, x: DeviceArray, tensor,
                 dout_amax: DeviceArray | None = None) -> None:
        if tensor.offset not in self.adapted:
            self.base.gemm(dx, dout, self.base.weights(tensor))
            return
        a, b, rows = self.adapted[tensor.offset]
        N, OC, width, scale = x.shape[0], dout.shape[-1], a.shape[0], self.spec.scale
        xa, dxa = self._xa(x, a), self.scratch["dxa"].prefix(N, width)
        b_weights = self.weights(b)
        if len(rows) > 1:
            spread = self.scratch["block_diagonal"].prefix(OC, width)
            ops.lora_block_diagonal_bf16(spread, b_weights, rows)
            self.base.gemm(dxa, dout, spread, alpha=scale)
        else:
            self.base.gemm(dxa, dout, b_weights, alpha=scale)
        self.base.gemm(self.gradients(a), dxa, x, trans_a=True, accumulate=True)
        if len(rows) > 1:
            products = self.scratch["block_products"].prefix(OC, width)
            self.base.gemm(products, dout, xa, trans_a=True, alpha=scale)
            ops.lora_take_blocks_f32(self.gradients(b), products, rows)
        else:
            self.base.gemm(self.gradients(b), dout, xa, trans_a=True, alpha=scale, accumulate=True)
        self.base.gemm(dx, dout, self.base.weights(tensor))
        ops.lora_add_bf16(dx, dxa, self.weights(a), 1.0, [dx.shape[1]], width, transposed=True)
