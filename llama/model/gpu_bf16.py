"""Llama 3.1 on the GPU in bf16 mixed precision: the fast training path.

It follows llama/model/reference.py layer by layer, like llama/model/gpu_fp32.py (the exact fp32
path), with fused steps whose numpy twins are compositions of the reference's layers:
- rmsnorm_residual_forward_bf16 = residual_forward, then rmsnorm_forward (one pass);
- the QKV GEMM's epilogue applies RoPE (rope_forward's rotation), and flash attention reads q, k, v
  straight from the packed projection; its backward returns dqkv rotated back (rope_backward);
- the classifier runs in chunks of tokens inside the forward: logits, loss and dlogits of a chunk,
  then at once the head's dX and dW GEMMs, so the (tokens, vocab) logits never exist whole.
Precision: fp32 master weights and AdamW moments; a bf16 copy of every weight, written by the AdamW
kernel in the same pass, which the GEMMs and the embedding read (the RMSNorms read their fp32 master
weights); bf16 activations; fp32 weight gradients, accumulated by the GEMM epilogue.
What each layer keeps for its backward is the plan's recompute (LAYER_ACTIVATIONS): everything
("none"); all but the RMSNorm outputs and the SwiGLU product, recomputed in the backward ("partial");
only its input, the backward running the layer's forward again first ("full"). The recomputed
activations are the same bits, so are the gradients. AdamW's moments are fp32, or 8-bit blocks on one
GPU (--optimizer adamw8bit, kernels/adamw.cu's adamw8bit_update_bf16). Which GEMM version and flash
attention build run is the plan's (llama/plan.py).

The model is this module's buffers, forward and backward, composed with one helper per concern:
  bf16_block.py        the block's forward (BF16Block), shared with the GPU decoder's prefill
  bf16_fp8.py          the linear layers on FP8 casts under --dtype fp8 (FP8Linears)
  bf16_inputs.py       the batch and the optimizer's scalars, staged in pinned memory (PinnedInputs)
  bf16_step.py         the step as CUDA graphs by their keys, eager_step, the ZeRO optimizer (CapturedStep)
  bf16_in_backward.py  the optimizer in the backward (OptimizerInBackward)

With a communicator (several GPUs, llama/parallel/nccl.py) the optimizer is ZeRO
(llama/parallel/zero.py, stage 1, 2 or 3): the backward reduce-scatters each layer's gradients as soon as
they are final, each rank updates its shard of the fp32 master weights and moments, and the next forward
all-gathers the bf16 weights bucket by bucket, each layer waiting for its own (stage 3: into two slots used
in turn, before the layer's forward and again before its backward): the forward and backward bracket each
layer with Zero.layer. The RMSNorm weights, read in fp32, come from a small all-reduced replica of their
masters.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..cuda import BF16, DeviceArray, empty, zeros
from ..options import RunOptions
from ..parallel.zero import MasterReplica
from ..plan import Plan, make_plan
from .base import check_batch, counted_targets
from .bf16_fp8 import FP8Linears
from .bf16_in_backward import OptimizerInBackward
from .bf16_inputs import PinnedInputs
from .gpu_base import GPUModelBase
from .shapes import CLASSIFIER_CHUNK, FP32_BUFFERS, LAYER_ACTIVATIONS, activation_shapes


class GPUModelBF16(OptimizerInBackward, FP8Linears, PinnedInputs, GPUModelBase):
    def __init__(self, config: LlamaConfig, B: int, T: int, params: np.ndarray | None = None, seed: int = 0,
                 comm=None, plan: Plan | None = None, doc_mask_bos: int | None = None):
        """plan: the run's (llama/plan.py), which says which GEMM and attention builds run, what the
        backward recomputes and the optimizer, and with sft that the loss is divided by the step's counted
        targets (train_step's counted, read by the classifier from a device scalar); None makes the default bf16
        plan of this model on this GPU (a PlanError says why the model does not fit it). doc_mask_bos: None, or
        the BOS id: each forward computes its batch's document bounds on the GPU from the uploaded tokens (inside
        the captured graphs) and every layer's attention, forward and backward, is document-masked."""
        self.plan = plan or make_plan(config, RunOptions("cuda", "bf16"))
        self.recompute, self.in_backward = self.plan.recompute, self.plan.in_backward
        self.fp8 = self.plan.dtype == "fp8"
        params = self._setup(config, B, T, params, seed, comm, BF16, self.plan.optimizer, not self.in_backward,
                             self.plan.zero, BF16 if self.plan.reduce_dtype == "bf16" else np.float32, doc_mask_bos)
        self.params_bf16 = self.zero.weights
        self.norm_weights = None if comm is None else MasterReplica(self.zero, self.layout, self.layout.norm_names(), params)
        if self.in_backward:
            self._allocate_groups()
        self._allocate()
        if self.fp8:
            self._allocate_fp8()
        # (b, t, micro_steps, opt) -> ({(first, last): micro-batch graph}, optimizer graph); in the backward:
        # (b, t, "in backward", opt) -> the step's graph
        self.graphs = {}

    # ---- buffers

    def _shapes(self, b: int, t: int) -> tuple[dict, dict]:
        return activation_shapes(self.config, b, t, self.recompute, self.plan.attention)

    def _buffer(self, name: str, shape) -> DeviceArray:
        return empty(shape, np.float32 if name in FP32_BUFFERS else BF16)

    def _allocate(self) -> None:
        layer, shared = self._shapes(self.B, self.T)
        self.layer_buffers = [{k: self._buffer(k, s) for k, s in layer.items()} for _ in range(self.config.n_layers)]
        self.buffers = {k: self._buffer(k, s) for k, s in shared.items()}
        N, C = self.B * self.T, self.config.dim
        self.rms_scratch = zeros(ops.rmsnorm_bf16_scratch_size(C))
        self.embedding_scratch = zeros(ops.embedding_bf16_scratch_size(N, C))
        self.norm_scratch = zeros(ops.NORM_BLOCKS + 1, np.float64)
        self.norm_squared, self.loss_total = zeros(1), zeros(1)
        self.adam_scalars = zeros(ops.ADAMW_SCALARS)
        self._allocate_inputs(N)

    def _views(self, b: int, t: int) -> tuple[list[dict], dict]:
        """Activations for a (b, t) batch: prefixes of the buffers, shaped as in the reference."""
        layer, shared = self._shapes(b, t)
        layers = [{k: buffers[k].prefix(*s) for k, s in layer.items()} for buffers in self.layer_buffers]
        views = {k: self.buffers[k].prefix(*s) for k, s in shared.items()}
        for a in layers:  # each layer reads the shared buffers of what it does not keep under their usual names
            a.update({k: views[k] for k in LAYER_ACTIVATIONS["none"] if k not in a})
        return layers, views

    def weight(self, tensor) -> DeviceArray:
        """A weight's bf16 copy, as the GEMMs read it (a Tensor of the layout or its name)."""
        tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
        return self.zero.weight(tensor.offset, tensor.shape)

    def master(self, name: str) -> DeviceArray:
        """A weight's fp32 master copy, as the RMSNorms read it (their small updates would be lost in bf16)."""
        if self.norm_weights is not None:
            return self.norm_weights.view(name)
        tensor = self.layout.tensors[name]
        return self.zero.master.view(tensor.offset, tensor.shape)

    # ---- forward and backward

    def forward(self, tokens: np.ndarray, targets: np.ndarray | None = None, loss_scale: float | None = None,
                return_loss: bool = True) -> float | None:
        """Run the model on (b, t) tokens. With targets the mean loss over the counted ones (>= 0) is returned
        (reading it is a sync; return_loss=False skips it) and, when loss_scale is given, the head's gradients
        are added in the forward (chunked classifier) for backward() to continue (on several GPUs in the same
        ZeRO region, which backward() ends). Without targets the final norm is kept for read_logits()."""
        check_batch(tokens, targets, self.config.vocab_size, self.B, self.T)
        counted = max(counted_targets(targets), 1) if targets is not None else 1
        if self.plan.sft:  # the classifier's scale, which the captured step reads from the device
            self._set_loss_scale(1.0 / counted)
        # the classifier weighs each token by 1 / N times this (1.0 when every target counts), or with sft by the
        # device scale 1 / counted times this
        ratio = 1.0 if self.plan.sft else tokens.size / counted
        self._upload(tokens, targets)
        self.shape, self.has_targets = tokens.shape, targets is not None
        self.loss_total.fill_zero()
        with_gradients = targets is not None and loss_scale is not None
        self.zero.begin(gather=self.zero.stale)
        self._forward(loss_scale * ratio if with_gradients else None, targets is not None, ratio)
        if not with_gradients:
            self.zero.end(None)
        if targets is None or not return_loss:
            return None
        return float(self.loss_total.download()[0])

    def _forward(self, loss_scale: float | None, with_targets: bool, loss_weight: float) -> None:
        """The forward's launches for the uploaded batch of shape self.shape (captured by train_step), each
        layer's after its weights are there (ZeRO: Zero.layer, Zero.use_weights)."""
        c, z, starts = self.config, self.zero, self.layout.layer_starts()  # each layer's first offset, the final norm's
        b, t = self.shape
        N, H, KV, D = b * t, c.n_heads, c.n_kv_heads, c.head_dim
        layers, s = self._views(b, t)
        tokens = self.inputs["tokens"].prefix(N)
        rope = (self.rope_cos, self.rope_sin, t, (H + KV) * D)

        if self.fp8:
            self._cast_weights()
        self._document_bounds(tokens.reshape(b, t))
        z.use_weights(0, prefetch=starts[0])
        ops.embedding_forward_bf16(layers[0]["x"], tokens, self.weight("tok_embeddings.weight"))
        for i, a in enumerate(layers):
            with z.layer(starts[i], prefetch=starts[i + 1]):
                self._attention_norm(i, a, layers[i - 1]["h"], s["branch"])  # x = h + branch of the layer before
                self._layer_forward(i, a, s, N, rope)
        ops.rmsnorm_residual_forward_bf16(s["residual"], s["lnf"], s["rstdf"], layers[-1]["h"], s["branch"],
                                     self.master("norm.weight"), c.norm_eps)
        if with_targets:
            z.use_weights(self.layout.output().offset)
            self._classifier(s, N, loss_scale, loss_weight)

    def _classifier(self, s: dict, N: int, loss_scale: float | None, loss_weight: float) -> None:
        """Chunks of tokens: logits, losses and dlogits (over the logits); with loss_scale also the
        head's dX (into dln) and dW at once. Each token's loss counts loss_weight / N and its gradient
        loss_scale / N; with the plan's sft, times 1 / the step's counted targets instead of 1 / N, read from the
        device scalar loss_scale (set per step: a replayed graph reads the new value)."""
        C, V = self.config.dim, self.config.vocab_size
        w_out, dw_out = self.weight(self.layout.output()), self.grad(self.layout.output())
        targets = self.inputs["targets"]
        if self.plan.sft:
            dloss, weight, scale = loss_scale or 0.0, loss_weight, self.loss_scale
        else:
            dloss, weight, scale = (loss_scale or 0.0) / N, loss_weight / N, None
        for start in range(0, N, CLASSIFIER_CHUNK):
            n = min(CLASSIFIER_CHUNK, N - start)
            logits, lnf = s["logits"].prefix(n, V), s["lnf"].view(start * C, (n, C))
            self.gemm(logits, lnf, w_out, trans_b=True)
            ops.fused_classifier_bf16(logits, s["losses"].view(start, (n,)), targets.view(start, (n,)), dloss,
                                      dloss_scale=scale)
            if loss_scale is not None:
                self.gemm(s["dln"].view(start * C, (n, C)), logits, w_out)
                self.gemm(dw_out, logits, lnf, trans_a=True, accumulate=True)
        ops.loss_accumulate_bf16(self.loss_total, s["losses"], weight, scale_at=scale)

    def backward(self) -> None:
        """Add the gradients of the last forward (run with loss_scale) into the gradients (the eager path:
        optimizer_step() after the step's last one). On several GPUs it ends the forward's ZeRO region: at
        stages 2-3 each bucket is reduce-scattered into the shard (added from the step's second micro-batch
        on) as soon as it is final; stage 1 reduces them all in optimizer_step()."""
        self._backward(sync=False)
        self.zero.end(last=False)

    def _backward(self, sync: bool) -> None:
        """The backward's launches (captured by train_step); with sync (the last micro-batch of a step, several
        GPUs) each bucket of final gradients is reduce-scattered while the backward goes on."""
        c, z, starts = self.config, self.zero, self.layout.layer_starts()
        b, t = self.shape
        N, H, KV = b * t, c.n_heads, c.n_kv_heads
        layers, s = self._views(b, t)
        dx, grad = s["dresidual"], self.grad
        dx.fill_zero()
        ops.rmsnorm_backward_bf16(dx, grad("norm.weight"), self.rms_scratch, s["dln"], s["residual"],
                                  self.master("norm.weight"), s["rstdf"])
        self._gradients_final_from("norm.weight", sync)
        rope = (self.rope_cos, self.rope_sin, t, (H + KV) * c.head_dim)
        for i in reversed(range(c.n_layers)):
            with z.layer(starts[i], prefetch=starts[i - 1] if i else None, gradients=True):
                self._layer_backward(i, layers[i], s, N, rope)
            self._gradients_final_from(f"layers.{i}.attention_norm.weight", sync)
        ops.embedding_backward_bf16(grad("tok_embeddings.weight"), dx, self.inputs["order"].prefix(N),
                                    self.inputs["segments"].prefix(N, 4), self.embedding_scratch)
        self._gradients_final_from("tok_embeddings.weight", sync)

    def _layer_backward(self, i: int, a: dict, s: dict, N: int, rope: tuple) -> None:
        """Layer i's backward from the gradient of its output in s["dresidual"] (replaced by that of its
        input), adding into its weights' gradients; first what the recipe recomputes of its forward."""
        c, L, pre, grad, dx = self.config, self.layout, f"layers.{i}.", self.grad, s["dresidual"]
        H, KV, partial = c.n_heads, c.n_kv_heads, self.recompute == "partial"
        if self.recompute == "full":  # the layer's forward again, from its input
            ops.rmsnorm_forward_bf16(a["ln1"], a["rstd1"], a["x"], self.master(pre + "attention_norm.weight"),
                                     c.norm_eps)
            self._layer_forward(i, a, s, N, rope)
        if partial:
            ops.swiglu_forward_bf16(a["ffn"], a["gate_up"])
        dffn, dgate_up = a["ffn"], a["gate_up"]  # each gradient overwrites its activation, no longer needed
        self.linear_backward(dffn, grad(pre + "feed_forward.w2.weight"), dx, a["ffn"],
                             self.weight(pre + "feed_forward.w2.weight"))
        dgate_up_amax = self.swiglu_backward(dgate_up, dffn, a["gate_up"])
        if partial:
            ops.rmsnorm_forward_bf16(a["ln2"], a["rstd2"], a["h"], self.master(pre + "ffn_norm.weight"), c.norm_eps)
        self.linear_backward(s["dln"], grad(L.w13(i)), dgate_up, a["ln2"], self.weight(L.w13(i)), dgate_up_amax)
        ops.rmsnorm_backward_bf16(dx, grad(pre + "ffn_norm.weight"), self.rms_scratch, s["dln"], a["h"],
                                  self.master(pre + "ffn_norm.weight"), a["rstd2"])
        self.linear_backward(s["datt"].reshape(N, -1), grad(pre + "attention.wo.weight"), dx,
                             a["att"].reshape(N, -1), self.weight(pre + "attention.wo.weight"))
        ops.flash_attention_backward(s["dqkv"], s["attention_scratch"], s["datt"], a["att"], a["lse"], a["qkv"], H, KV,
                                     self.rope_cos, self.rope_sin, source=self.plan.attention, **self._document_mask())
        if partial:
            ops.rmsnorm_forward_bf16(a["ln1"], a["rstd1"], a["x"], self.master(pre + "attention_norm.weight"),
                                     c.norm_eps)
        self.linear_backward(s["dln"], grad(L.wqkv(i)), s["dqkv"].reshape(N, -1), a["ln1"], self.weight(L.wqkv(i)))
        ops.rmsnorm_backward_bf16(dx, grad(pre + "attention_norm.weight"), self.rms_scratch, s["dln"], a["x"],
                                  self.master(pre + "attention_norm.weight"), a["rstd1"])

    def token_losses(self) -> np.ndarray:
        """(b, t) fp32 cross-entropy of each target of the last forward() with targets (of its bf16 logits)."""
        if self.shape is None or not self.has_targets:
            raise RuntimeError("token_losses() needs a forward() with targets first")
        b, t = self.shape
        return self.buffers["losses"].prefix(b * t).download().reshape(b, t)

    def read_logits(self, position: int | np.ndarray | None = None) -> np.ndarray:
        """(b, t, V) logits of the last forward, or (b, V) at one position (an int, or one per row), as float32,
        from the final norm's output, which every forward keeps."""
        if self.shape is None:
            raise RuntimeError("read_logits() needs a forward() first")
        (b, t), C, V = self.shape, self.config.dim, self.config.vocab_size
        rows = range(b * t) if position is None else [
            row * t + int(p) % t for row, p in enumerate(np.broadcast_to(position, (b,)))]
        w_out, lnf, logits = self.weight(self.layout.output()), self.buffers["lnf"], self.buffers["logits"]
        out = np.empty((len(rows), V), np.float32)
        for i, row in enumerate(rows):  # one row at a time: generation needs one position
            self.gemm(logits.prefix(1, V), lnf.view(row * C, (1, C)), w_out, trans_b=True)
            out[i] = logits.prefix(1, V).download().astype(np.float32)[0]
        return out.reshape(b, t, V) if position is None else out

    # ---- state for checkpoints: GPUModelBase's, and the norms' fp32 replica

    def set_state(self, params: np.ndarray | None, adam_m=None, adam_v=None) -> None:
        super().set_state(params, adam_m, adam_v)
        if self.norm_weights is not None and params is not None:
            self.norm_weights.set(params)

    def master_weights(self) -> DeviceArray:
        """The full flat fp32 weights on the device (gathered from every rank on several GPUs: all
        ranks call it), e.g. for a decoder."""
        return self.zero.gather_flat(self.zero.master)
