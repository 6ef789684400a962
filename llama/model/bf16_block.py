"""The bf16 transformer block on our kernels, forward and backward, defined once for the training model
(llama/model/gpu_bf16.py) and the GPU decoder's prefill (llama/model/gpu_decoder.py): the twin of reference.py's
ReferenceBlock.

A layer runs attention_norm (its first RMSNorm, fused with the residual add of the layer before), then forward:
the QKV GEMM with RoPE in its epilogue, the attention (flash attention over the batch; the decoder's writes its
KV cache first), the wo GEMM, the residual fused with the second RMSNorm, the w1/w3 GEMM, SwiGLU and the w2
GEMM, whose branch the next layer's first norm (or the final norm) adds to h. backward runs first what the
plan's recompute left out of the forward (LAYER_ACTIVATIONS), then the layer's gradients in reverse.

The block holds what it is built from: the config, the layout (which tensor is which), the plan (the flash
attention build, what the backward recomputes), the linear layers (llama/model/linears.py: bf16, FP8),
norm(name) (a norm's fp32 weights), grad(tensor) (where a tensor's gradient accumulates; None in the decoder),
the RoPE tables, and the attention's document mask (a callable giving the flash attention launchers' doc_start
and doc_end keywords of the batch in flight; none: the attention spans the row).
Activations are dicts of DeviceArrays: a (the layer's kept ones, LAYER_ACTIVATIONS) and s (the shared ones).
"""

from __future__ import annotations

from .. import ops
from ..runtime.cuda import DeviceArray


class BF16Block:
    def __init__(self, config, layout, plan, linears, norm, grad=None, document_mask=dict):
        self.config, self.layout, self.plan, self.linears = config, layout, plan, linears
        self.norm, self.grad, self.document_mask = norm, grad, document_mask
        self.attention = self.flash_attention  # the decoder puts its own, over its KV cache

    def attention_norm(self, i: int, a: dict, h: DeviceArray, branch: DeviceArray) -> None:
        """Layer i's first RMSNorm into a["ln1"], a["rstd1"]: of its input a["x"] for the first layer, else of
        the residual h + branch of the layer before, which it writes to a["x"]."""
        weight, eps = self.norm(f"layers.{i}.attention_norm.weight"), self.config.norm_eps
        if i == 0:
            ops.rmsnorm_forward_bf16(a["ln1"], a["rstd1"], a["x"], weight, eps)
        else:
            ops.rmsnorm_residual_forward_bf16(a["x"], a["ln1"], a["rstd1"], h, branch, weight, eps)

    def flash_attention(self, i: int, a: dict) -> None:
        """Layer i's causal attention of the packed a["qkv"] into a["att"], a["lse"], document-masked."""
        c = self.config
        ops.flash_attention_forward(a["att"], a["lse"], a["qkv"], c.n_heads, c.n_kv_heads, source=self.plan.attention,
                                    **self.document_mask())

    def forward(self, i: int, a: dict, s: dict, N: int, rope: tuple) -> None:
        """Layer i's forward after its first norm (a["ln1"] of a["x"]): attention, the residual and the
        second norm, the SwiGLU FFN; its output branch goes to s["branch"] (added to a["h"] by the next
        norm). rope: (cos, sin, t, rotated columns), as ops.gemm's."""
        c, L, linear, pre = self.config, self.layout, self.linears, f"layers.{i}."
        linear.forward(a["qkv"].reshape(N, -1), a["ln1"], L.wqkv(i), rope)
        self.attention(i, a)
        linear.forward(s["branch"], a["att"].reshape(N, -1), L.tensors[pre + "attention.wo.weight"])
        ops.rmsnorm_residual_forward_bf16(a["h"], a["ln2"], a["rstd2"], a["x"], s["branch"],
                                          self.norm(pre + "ffn_norm.weight"), c.norm_eps)
        linear.forward(a["gate_up"], a["ln2"], L.w13(i))
        ops.swiglu_forward_bf16(a["ffn"], a["gate_up"])
        linear.forward(s["branch"], a["ffn"], L.tensors[pre + "feed_forward.w2.weight"])

    def backward(self, i: int, a: dict, s: dict, N: int, rope: tuple) -> None:
        """Layer i's backward from the gradient of its output in s["dresidual"] (replaced by that of its
        input), adding into its weights' gradients; first what the recipe recomputes of its forward. rope as
        forward's (the attention's backward rotates dq and dk back with its tables)."""
        c, L, linear, pre, dx = self.config, self.layout, self.linears, f"layers.{i}.", s["dresidual"]
        H, KV, recompute = c.n_heads, c.n_kv_heads, self.plan.recompute
        attention_norm, ffn_norm = self.norm(pre + "attention_norm.weight"), self.norm(pre + "ffn_norm.weight")
        if recompute == "full":  # the layer's forward again, from its input
            ops.rmsnorm_forward_bf16(a["ln1"], a["rstd1"], a["x"], attention_norm, c.norm_eps)
            self.forward(i, a, s, N, rope)
        if recompute == "partial":
            ops.swiglu_forward_bf16(a["ffn"], a["gate_up"])
        dffn, dgate_up = a["ffn"], a["gate_up"]  # each gradient overwrites its activation, no longer needed
        linear.backward(dffn, dx, a["ffn"], L.tensors[pre + "feed_forward.w2.weight"])
        dgate_up_amax = linear.swiglu_backward(dgate_up, dffn, a["gate_up"])
        if recompute == "partial":
            ops.rmsnorm_forward_bf16(a["ln2"], a["rstd2"], a["h"], ffn_norm, c.norm_eps)
        linear.backward(s["dln"], dgate_up, a["ln2"], L.w13(i), dgate_up_amax)
        ops.rmsnorm_backward_bf16(dx, self.grad(pre + "ffn_norm.weight"), s["rms_scratch"], s["dln"], a["h"],
                                  ffn_norm, a["rstd2"])
        linear.backward(s["datt"].reshape(N, -1), dx, a["att"].reshape(N, -1), L.tensors[pre + "attention.wo.weight"])
        ops.flash_attention_backward(s["dqkv"], s["attention_scratch"], s["datt"], a["att"], a["lse"], a["qkv"], H, KV,
                                     *rope[:2], source=self.plan.attention, **self.document_mask())
        if recompute == "partial":
            ops.rmsnorm_forward_bf16(a["ln1"], a["rstd1"], a["x"], attention_norm, c.norm_eps)
        linear.backward(s["dln"], s["dqkv"].reshape(N, -1), a["ln1"], L.wqkv(i))
        ops.rmsnorm_backward_bf16(dx, self.grad(pre + "attention_norm.weight"), s["rms_scratch"], s["dln"], a["x"],
                                  attention_norm, a["rstd1"])
