"""The bf16 transformer block on our kernels, defined once for the training model (llama/model/gpu_bf16.py)
and the GPU decoder's prefill (llama/model/gpu_decoder.py): the twin of reference.py's ReferenceBlock.

A layer runs _attention_norm (its first RMSNorm, fused with the residual add of the layer before), then
_layer_forward: the QKV GEMM with RoPE in its epilogue, _attention (flash attention over the batch; the
decoder's writes its KV cache first), the wo GEMM, the residual fused with the second RMSNorm, the w1/w3 GEMM,
SwiGLU and the w2 GEMM, whose branch the next layer's first norm (or the final norm) adds to h.
Its users hold config, layout and plan (llama/run/plan.py: which GEMM and attention builds run), weight(tensor)
(a matrix's bf16 copy, as the GEMMs read it), master(name) (a norm's fp32 weights) and _document_mask() (the flash
attention launchers' doc_start and doc_end keywords of the batch in flight; none: the attention spans the row)."""

from __future__ import annotations

from .. import ops
from ..runtime.cuda import DeviceArray


class BF16Block:
    def gemm(self, c: DeviceArray, a: DeviceArray, b: DeviceArray, **options) -> None:
        """ops.gemm with the plan's GEMM version for the problem's shape."""
        ops.gemm(c, a, b, version=self.plan.gemm, **options)

    def linear_forward(self, out: DeviceArray, x: DeviceArray, weight: DeviceArray, rope: tuple | None = None) -> None:
        """out (N, OC) = x (N, IC) @ weight (OC, IC)^T, weight a bf16 copy; rope as ops.gemm's."""
        self.gemm(out, x, weight, trans_b=True, rope=rope)

    def linear_backward(self, dx: DeviceArray, dweight: DeviceArray, dout: DeviceArray, x: DeviceArray,
                        weight: DeviceArray, dout_amax: DeviceArray | None = None) -> None:
        """dweight (fp32) += dout (N, OC)^T @ x (N, IC), then dx (N, IC) = dout @ weight (dx may be x's
        buffer). dout_amax: what swiglu_backward returned for dout (FP8Linears' casts take it; None here)."""
        self.gemm(dweight, dout, x, trans_a=True, accumulate=True)
        self.gemm(dx, dout, weight)

    def swiglu_backward(self, dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray) -> DeviceArray | None:
        """dgate_up (N, 2F) from dout (N, F) (ops.swiglu_backward_bf16, in place if dgate_up is gate_up); returns
        what linear_backward takes as dgate_up's dout_amax: None here, its maxima in FP8Linears."""
        ops.swiglu_backward_bf16(dgate_up, dout, gate_up)
        return None

    def _attention_norm(self, i: int, a: dict, h: DeviceArray, branch: DeviceArray) -> None:
        """Layer i's first RMSNorm into a["ln1"], a["rstd1"]: of its input a["x"] for the first layer, else of
        the residual h + branch of the layer before, which it writes to a["x"]."""
        weight, eps = self.master(f"layers.{i}.attention_norm.weight"), self.config.norm_eps
        if i == 0:
            ops.rmsnorm_forward_bf16(a["ln1"], a["rstd1"], a["x"], weight, eps)
        else:
            ops.rmsnorm_residual_forward_bf16(a["x"], a["ln1"], a["rstd1"], h, branch, weight, eps)

    def _attention(self, i: int, a: dict) -> None:
        """Layer i's causal attention of the packed a["qkv"] into a["att"], a["lse"], document-masked as
        _document_mask() says."""
        c = self.config
        ops.flash_attention_forward(a["att"], a["lse"], a["qkv"], c.n_heads, c.n_kv_heads, source=self.plan.attention,
                                    **self._document_mask())

    def _layer_forward(self, i: int, a: dict, s: dict, N: int, rope: tuple) -> None:
        """Layer i's forward after its first norm (a["ln1"] of a["x"]): attention, the residual and the
        second norm, the SwiGLU FFN; its output branch goes to s["branch"] (added to a["h"] by the next
        norm)."""
        c, L, pre = self.config, self.layout, f"layers.{i}."
        self.linear_forward(a["qkv"].reshape(N, -1), a["ln1"], self.weight(L.wqkv(i)), rope)
        self._attention(i, a)
        self.linear_forward(s["branch"], a["att"].reshape(N, -1), self.weight(pre + "attention.wo.weight"))
        ops.rmsnorm_residual_forward_bf16(a["h"], a["ln2"], a["rstd2"], a["x"], s["branch"],
                                          self.master(pre + "ffn_norm.weight"), c.norm_eps)
        self.linear_forward(a["gate_up"], a["ln2"], self.weight(L.w13(i)))
        ops.swiglu_forward_bf16(a["ffn"], a["gate_up"])
        self.linear_forward(s["branch"], a["ffn"], self.weight(pre + "feed_forward.w2.weight"))
