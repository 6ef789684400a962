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
GPU (--optimizer adamw8bit, kernels/adamw.cu's adamw8bit_update_bf16). With the optimizer in the
backward (one GPU) each group of weights is updated as soon as the backward finishes its gradients,
which live in the embedding's buffer and one buffer the other groups use in turn (train_step).

The training step (llama/model/base.py drives it: start_step, micro_step, finish_step) is captured
as CUDA graphs, a micro-step (forward and backward) and the optimizer step, on the first step of a
shape and replayed after: tokens upload asynchronously from pinned memory, lr and the bias
corrections live in device memory, the loss accumulates on the device and is read once. While the
step runs, the host stages the next step's first micro-batch when the caller names it (train_step's
upcoming: its pinned copy and token segments), so that the GPU does not wait for that host work between
steps. Which GEMM version and flash attention build run is the plan's (llama/plan.py).

With --dtype fp8 (the plan's dtype "fp8", Hopper) the seven linear layers of each block run their forward,
dX and dW GEMMs on FP8 e4m3 casts with row-wise power-of-two scales (ops.cast_fp8, ops.gemm_fp8), whose
twins are reference.matmul_fp8_forward/backward: the input along its rows (forward) and transposed (dW), the
output's gradient the same two ways (dX, dW), the weight along its rows (forward) and transposed (dX), cast
from the bf16 copy at the start of every forward. Everything else is the bf16 path's. The plan's fp8_scaling
"tensor" (the comparison) gives each cast one scale, that of the whole operand's amax.

With a communicator (several GPUs, llama/parallel/nccl.py) the optimizer is ZeRO
(llama/parallel/zero.py, stage 1, 2 or 3): the backward reduce-scatters each layer's gradients as soon as
they are final, each rank updates its shard of the fp32 master weights and moments, and the next forward
all-gathers the bf16 weights bucket by bucket, each layer waiting for its own (stage 3: into two slots used
in turn, before the layer's forward and again before its backward). The RMSNorm weights, read in fp32, come
from a small all-reduced replica of their masters.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..cuda import BF16, FP8, DeviceArray, Graph, empty, runtime, zeros
from ..optim import QUANT_BLOCK, AdamWConfig
from ..parallel.zero import MasterReplica
from ..plan import Plan, make_plan
from ..progress import phase
from .base import check_batch
from .gpu_base import GPUModelBase
from .shapes import CLASSIFIER_CHUNK, FP32_BUFFERS, LAYER_ACTIVATIONS, activation_shapes, fp8_shapes, linear_weights

CAPTURE = "capturing the step's CUDA graphs"  # a progress phase (llama/progress.py)


class GPUModelBF16(GPUModelBase):
    def __init__(self, config: LlamaConfig, B: int, T: int, params: np.ndarray | None = None, seed: int = 0,
                 comm=None, plan: Plan | None = None):
        """plan: the run's (llama/plan.py), which says which GEMM and attention builds run, what the
        backward recomputes and the optimizer; None makes the default bf16 plan of this model on this GPU
        (a PlanError says why the model does not fit it)."""
        self.plan = plan or make_plan(config, "cuda", "bf16")
        self.recompute, self.in_backward = self.plan.recompute, self.plan.in_backward
        self.fp8 = self.plan.dtype == "fp8"
        params = self._setup(config, B, T, params, seed, comm, BF16, self.plan.optimizer, not self.in_backward,
                             self.plan.zero, BF16 if self.plan.reduce_dtype == "bf16" else np.float32)
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
        # inputs: device buffers, and two sets of pinned host buffers used in turn
        self.inputs = {"tokens": empty(N, np.int32), "targets": empty(N, np.int32), "order": empty(N, np.int32),
                       "segments": empty((N, 4), np.int32)}
        drv = runtime().drv
        self.pinned = [{k: drv.pagelocked_empty(a.shape, np.int32) for k, a in self.inputs.items()} for _ in range(2)]
        self.pinned_scalars = drv.pagelocked_empty(ops.ADAMW_SCALARS, np.float32)
        self.pinned_free = [drv.Event() for _ in range(3)]  # one per input set, one for the scalars
        for event in self.pinned_free:
            event.record(runtime().stream)
        self.turn = 0
        self.staged = None  # the (tokens, targets) whose host work the pinned set of this turn holds already

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

    def _allocate_groups(self) -> None:
        """The optimizer in the backward: the gradient groups (the embedding table, each layer, the final
        norm and head, as the reference's), the embedding's gradients (a tied head adds to them in the
        forward) and one buffer that each other group uses in turn, and the groups' squared norms of this
        step and of the last."""
        self.groups = self.layout.gradient_groups()
        self.embedding_grads = zeros(self.groups[0][1])
        self.group_grads = zeros(max(end - start for start, end in self.groups[1:]))
        self.step_group_norms, self.group_norms = zeros(len(self.groups)), zeros(len(self.groups))

    def _views(self, b: int, t: int) -> tuple[list[dict], dict]:
        """Activations for a (b, t) batch: prefixes of the buffers, shaped as in the reference."""
        layer, shared = self._shapes(b, t)
        layers = [{k: buffers[k].prefix(*s) for k, s in layer.items()} for buffers in self.layer_buffers]
        views = {k: self.buffers[k].prefix(*s) for k, s in shared.items()}
        for a in layers:  # each layer reads the shared buffers of what it does not keep under their usual names
            a.update({k: views[k] for k in LAYER_ACTIVATIONS["none"] if k not in a})
        return layers, views

    def gemm(self, c: DeviceArray, a: DeviceArray, b: DeviceArray, **options) -> None:
        """ops.gemm with the plan's GEMM version for the problem's shape."""
        ops.gemm(c, a, b, version=self.plan.gemm, **options)

    def linear_forward(self, out: DeviceArray, x: DeviceArray, weight: DeviceArray, rope: tuple | None = None) -> None:
        """out (N, OC) = x (N, IC) @ weight (OC, IC)^T, weight a bf16 copy; rope as ops.gemm's. FP8: on the
        casts of x along its rows and of the weight (reference.matmul_fp8_forward)."""
        if not self.fp8:
            self.gemm(out, x, weight, trans_b=True, rope=rope)
            return
        (N, IC), f = x.shape, self.fp8_scratch
        x_q, x_scales = f["input"].prefix(N, IC), f["input_scales"].prefix(N)
        self._cast_fp8(x, rows=x_q, row_scales=x_scales)
        w_q, w_scales, _, _ = self.fp8_weights[weight.ptr]
        ops.gemm_fp8(out, x_q, x_scales, w_q, w_scales, rope=rope, version=self.plan.fp8_gemm)

    def linear_backward(self, dx: DeviceArray, dweight: DeviceArray, dout: DeviceArray, x: DeviceArray,
                        weight: DeviceArray) -> None:
        """dweight (fp32) += dout (N, OC)^T @ x (N, IC), then dx (N, IC) = dout @ weight (dx may be x's
        buffer). FP8: on the casts reference.matmul_fp8_backward takes, each along its GEMM's K."""
        if not self.fp8:
            self.gemm(dweight, dout, x, trans_a=True, accumulate=True)
            self.gemm(dx, dout, weight)
            return
        (N, IC), OC, f = x.shape, dout.shape[-1], self.fp8_scratch
        g_q, g_scales = f["grad"].prefix(N, OC), f["grad_scales"].prefix(N)
        g_t, g_t_scales = f["grad_t"].prefix(OC, N), f["grad_t_scales"].prefix(OC)
        self._cast_fp8(dout, rows=g_q, row_scales=g_scales, cols=g_t, col_scales=g_t_scales)
        x_t, x_t_scales = f["input"].prefix(IC, N), f["input_scales"].prefix(IC)
        self._cast_fp8(x, cols=x_t, col_scales=x_t_scales)
        ops.gemm_fp8(dweight, g_t, g_t_scales, x_t, x_t_scales, accumulate=True, version=self.plan.fp8_gemm)
        _, _, w_t, w_t_scales = self.fp8_weights[weight.ptr]
        ops.gemm_fp8(dx, g_q, g_scales, w_t, w_t_scales, version=self.plan.fp8_gemm)

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

    def grad(self, tensor) -> DeviceArray:
        """Where a tensor's gradient accumulates (a Tensor of the layout or its name): its view of the flat
        gradients, or with the optimizer in the backward of its group's buffer."""
        tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
        if not self.in_backward:
            return self.zero.grad(tensor.offset, tensor.shape)
        group = next(g for g, (start, end) in enumerate(self.groups) if start <= tensor.offset < end)
        buffer = self.embedding_grads if group == 0 else self.group_grads
        return buffer.view(tensor.offset - self.groups[group][0], tensor.shape)

    def zero_grad(self) -> None:
        if not self.in_backward:
            return super().zero_grad()
        self.embedding_grads.fill_zero()
        self.group_grads.fill_zero()

    # ---- inputs

    def _upload(self, tokens: np.ndarray, targets: np.ndarray | None) -> None:
        """Stage the batch in pinned memory (unless _prepare staged these very arrays) and copy it in
        asynchronously, in stream order."""
        if self.staged is None or self.staged[0] is not tokens or self.staged[1] is not targets:
            self._stage(tokens, targets)
        self.staged = None
        N, pinned = tokens.size, self.pinned[self.turn]
        for name in ["tokens"] + (["targets", "order", "segments"] if targets is not None else []):
            self.inputs[name].prefix(*pinned[name][:N].shape).upload_async(pinned[name][:N])
        self.pinned_free[self.turn].record(runtime().stream)
        self.turn ^= 1

    def _stage(self, tokens: np.ndarray, targets: np.ndarray | None) -> None:
        """The host side of an upload: the batch, and with targets its token segments (the embedding's
        backward), into the pinned set of this turn."""
        N, pinned = tokens.size, self.pinned[self.turn]
        self.pinned_free[self.turn].synchronize()  # the copies that last read this set have run
        pinned["tokens"][:N] = tokens.ravel()
        if targets is not None:
            pinned["targets"][:N] = targets.ravel()
            pinned["order"][:N], pinned["segments"][:N] = ops.token_segments(tokens)

    def _prepare(self, upcoming: tuple | None) -> None:
        """While the step runs on the GPU: the host work of the next step's first micro-batch (tokens,
        targets), which the next _upload of the same arrays skips (Model.train_step's upcoming)."""
        if upcoming is not None:
            self._stage(*upcoming)
            self.staged = upcoming

    # ---- forward and backward

    def forward(self, tokens: np.ndarray, targets: np.ndarray | None = None, loss_scale: float | None = None,
                return_loss: bool = True) -> float | None:
        """Run the model on (b, t) tokens. With targets the mean loss is returned (reading it is a
        sync; return_loss=False skips it) and, when loss_scale is given, the head's gradients are
        added in the forward (chunked classifier) for backward() to continue (on several GPUs in the same
        ZeRO region, which backward() ends). Without targets the final norm is kept for read_logits()."""
        check_batch(tokens, targets, self.config.vocab_size, self.B, self.T)
        self._upload(tokens, targets)
        self.shape = tokens.shape
        self.loss_total.fill_zero()
        with_gradients = targets is not None and loss_scale is not None
        self.zero.begin(gather=self.zero.stale)
        self._forward(loss_scale if with_gradients else None, targets is not None, 1.0)
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
        z.use_weights(0, prefetch=starts[0])
        ops.embedding_forward_bf16(layers[0]["x"], tokens, self.weight("tok_embeddings.weight"))
        for i, a in enumerate(layers):
            with z.layer(starts[i], prefetch=starts[i + 1]):
                if i == 0:
                    ops.rmsnorm_forward_bf16(a["ln1"], a["rstd1"], a["x"],
                                             self.master("layers.0.attention_norm.weight"), c.norm_eps)
                else:  # x = h + ffn branch of the layer before, then its norm
                    ops.rmsnorm_residual_forward_bf16(a["x"], a["ln1"], a["rstd1"], layers[i - 1]["h"], s["branch"],
                                                      self.master(f"layers.{i}.attention_norm.weight"), c.norm_eps)
                self._layer_forward(i, a, s, N, rope)
        ops.rmsnorm_residual_forward_bf16(s["residual"], s["lnf"], s["rstdf"], layers[-1]["h"], s["branch"],
                                     self.master("norm.weight"), c.norm_eps)
        if with_targets:
            z.use_weights(self.layout.output().offset)
            self._classifier(s, N, loss_scale, loss_weight)

    def _layer_forward(self, i: int, a: dict, s: dict, N: int, rope: tuple) -> None:
        """Layer i's forward after its first norm (a["ln1"] of a["x"]): attention, the residual and the
        second norm, the SwiGLU FFN; its output branch goes to s["branch"] (added to a["h"] by the next
        norm)."""
        c, L, pre = self.config, self.layout, f"layers.{i}."
        self.linear_forward(a["qkv"].reshape(N, -1), a["ln1"], self.weight(L.wqkv(i)), rope)
        ops.flash_attention_forward(a["att"], a["lse"], a["qkv"], c.n_heads, c.n_kv_heads, source=self.plan.attention)
        self.linear_forward(s["branch"], a["att"].reshape(N, -1), self.weight(pre + "attention.wo.weight"))
        ops.rmsnorm_residual_forward_bf16(a["h"], a["ln2"], a["rstd2"], a["x"], s["branch"],
                                          self.master(pre + "ffn_norm.weight"), c.norm_eps)
        self.linear_forward(a["gate_up"], a["ln2"], self.weight(L.w13(i)))
        ops.swiglu_forward_bf16(a["ffn"], a["gate_up"])
        self.linear_forward(s["branch"], a["ffn"], self.weight(pre + "feed_forward.w2.weight"))

    def _classifier(self, s: dict, N: int, loss_scale: float | None, loss_weight: float) -> None:
        """Chunks of tokens: logits, losses and dlogits (over the logits); with loss_scale also the
        head's dX (into dln) and dW at once."""
        C, V = self.config.dim, self.config.vocab_size
        w_out, dw_out = self.weight(self.layout.output()), self.grad(self.layout.output())
        targets = self.inputs["targets"]
        for start in range(0, N, CLASSIFIER_CHUNK):
            n = min(CLASSIFIER_CHUNK, N - start)
            logits, lnf = s["logits"].prefix(n, V), s["lnf"].view(start * C, (n, C))
            self.gemm(logits, lnf, w_out, trans_b=True)
            ops.fused_classifier_bf16(logits, s["losses"].view(start, (n,)), targets.view(start, (n,)),
                                      (loss_scale or 0.0) / N)
            if loss_scale is not None:
                self.gemm(s["dln"].view(start * C, (n, C)), logits, w_out)
                self.gemm(dw_out, logits, lnf, trans_a=True, accumulate=True)
        ops.loss_accumulate_bf16(self.loss_total, s["losses"], loss_weight / N)

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
        ops.swiglu_backward_bf16(dgate_up, dffn, a["gate_up"])
        if partial:
            ops.rmsnorm_forward_bf16(a["ln2"], a["rstd2"], a["h"], self.master(pre + "ffn_norm.weight"), c.norm_eps)
        self.linear_backward(s["dln"], grad(L.w13(i)), dgate_up, a["ln2"], self.weight(L.w13(i)))
        ops.rmsnorm_backward_bf16(dx, grad(pre + "ffn_norm.weight"), self.rms_scratch, s["dln"], a["h"],
                                  self.master(pre + "ffn_norm.weight"), a["rstd2"])
        self.linear_backward(s["datt"].reshape(N, -1), grad(pre + "attention.wo.weight"), dx,
                             a["att"].reshape(N, -1), self.weight(pre + "attention.wo.weight"))
        ops.flash_attention_backward(s["dqkv"], s["attention_scratch"], s["datt"], a["att"], a["lse"], a["qkv"], H, KV,
                                     self.rope_cos, self.rope_sin, source=self.plan.attention)
        if partial:
            ops.rmsnorm_forward_bf16(a["ln1"], a["rstd1"], a["x"], self.master(pre + "attention_norm.weight"),
                                     c.norm_eps)
        self.linear_backward(s["dln"], grad(L.wqkv(i)), s["dqkv"].reshape(N, -1), a["ln1"], self.weight(L.wqkv(i)))
        ops.rmsnorm_backward_bf16(dx, grad(pre + "attention_norm.weight"), self.rms_scratch, s["dln"], a["x"],
                                  self.master(pre + "attention_norm.weight"), a["rstd1"])

    def _gradients_final_from(self, name: str, sync: bool) -> None:
        """The gradients from this tensor to the end of the flat buffer are final: reduce-scatter them
        (several GPUs), or with the optimizer in the backward update the group this tensor starts."""
        offset = self.layout.tensors[name].offset
        if self.in_backward:
            self._update_group(next(g for g, (start, _) in enumerate(self.groups) if start == offset))
        else:
            self.zero.reduce_from(offset, last=sync)

    def _update_group(self, g: int) -> None:
        """AdamW on group g's weights from its final gradients: its squared norm into step_group_norms[g],
        clipped by the norm estimated from this step's and the last step's group norms (norm_squared), and
        the shared buffer zeroed for the group the backward does next."""
        start, end = self.groups[g]
        grads = (self.embedding_grads if g == 0 else self.group_grads).prefix(end - start)
        ops.global_norm_squared_bf16(self.step_group_norms.view(g, (1,)), self.norm_scratch, grads)
        ops.clip_norm_estimate(self.norm_squared, self.step_group_norms, self.group_norms, g)
        self._adamw(start, grads, self.step_opt)
        if g > 1:
            self.group_grads.prefix(self.groups[g - 1][1] - self.groups[g - 1][0]).fill_zero()

    def read_logits(self, position: int | None = None) -> np.ndarray:
        """(b, t, V) logits of the last forward without targets, or (b, V) at one position, as float32."""
        if self.shape is None:
            raise RuntimeError("read_logits() needs a forward() first")
        (b, t), C, V = self.shape, self.config.dim, self.config.vocab_size
        rows = range(b * t) if position is None else [row * t + position % t for row in range(b)]
        w_out, lnf, logits = self.weight(self.layout.output()), self.buffers["lnf"], self.buffers["logits"]
        out = np.empty((len(rows), V), np.float32)
        for i, row in enumerate(rows):  # one row at a time: generation needs one position
            self.gemm(logits.prefix(1, V), lnf.view(row * C, (1, C)), w_out, trans_b=True)
            out[i] = logits.prefix(1, V).download().astype(np.float32)[0]
        return out.reshape(b, t, V) if position is None else out

    # ---- optimizer and the captured step

    def optimizer_step(self, lr: float, step: int, opt: AdamWConfig, return_norm: bool = True) -> float | None:
        """Clip by global norm and take one AdamW step (step counts from 1), updating the bf16 copy."""
        self.zero.finish_reduce()
        self._set_scalars(lr, step, opt)
        self._optimizer(opt)
        self.zero.stale = True
        return float(np.sqrt(self.norm_squared.download()[0])) if return_norm else None

    def _set_scalars(self, lr: float, step: int, opt: AdamWConfig) -> None:
        """lr and the bias corrections of this step into device memory, where the AdamW kernel reads them."""
        self.pinned_free[2].synchronize()
        self.pinned_scalars[:] = ops.adamw_scalars(step, lr, opt)
        self.adam_scalars.upload_async(self.pinned_scalars)
        self.pinned_free[2].record(runtime().stream)

    def _optimizer(self, opt: AdamWConfig) -> None:
        """ZeRO (llama/parallel/zero.py) on the reduced gradient shard: the global norm, AdamW on this rank's
        shard, and the norms' new fp32 masters to every rank; the new bf16 weights are all-gathered as the next
        forward needs them."""
        z = self.zero
        ops.global_norm_squared_bf16(self.norm_squared, self.norm_scratch, z.grad_shard)
        z.sum_over_ranks(self.norm_squared)
        self._adamw(0, z.grad_shard, opt)
        if self.norm_weights is not None:
            self.norm_weights.collect()
            z.sum_over_ranks(self.norm_weights.values)

    def _adamw(self, start: int, grads: DeviceArray, opt: AdamWConfig) -> None:
        """AdamW, with the run's moments (fp32 or 8-bit), on the grads.size values of this rank's shard from
        start, clipped by the norm whose square norm_squared holds; the new bf16 weights into the shard."""
        z, n = self.zero, grads.size

        def shard(a: DeviceArray) -> DeviceArray:
            return a.view(start, (n,))

        def blocks(a: DeviceArray) -> DeviceArray:  # one scale per QUANT_BLOCK values
            return a.view(start // QUANT_BLOCK, (-(-n // QUANT_BLOCK),))

        if z.optimizer == "adamw8bit":
            ops.adamw8bit_update_bf16(shard(z.master), shard(z.weight_shard), grads, shard(z.m_codes), blocks(z.m_scales),
                                      shard(z.v_codes), blocks(z.v_scales), shard(z.decay_mask), self.norm_squared,
                                      self.adam_scalars, z.maps, opt)
        else:
            ops.adamw_update_bf16(shard(z.master), shard(z.weight_shard), grads, shard(z.m), shard(z.v),
                                  shard(z.decay_mask), self.norm_squared, self.adam_scalars, opt)

    def start_step(self, batches: list, opt: AdamWConfig) -> None:
        """The captured graphs of this step's shape when they exist (the first step of a shape runs
        eagerly and captures them at its end); the gradients and the loss zeroed."""
        micro, shapes = len(batches), {x.shape for x, _ in batches}
        key = (*batches[0][0].shape, micro, opt) if len(shapes) == 1 else None
        self.step_graphs, self.micro_index = (key, micro, self.graphs.get(key)), 0
        self.zero_grad()
        self.loss_total.fill_zero()

    def micro_step(self, tokens: np.ndarray, targets: np.ndarray, micro: int, last: bool) -> None:
        check_batch(tokens, targets, self.config.vocab_size, self.B, self.T)
        self._upload(tokens, targets)
        self.shape = tokens.shape
        graphs, first = self.step_graphs[2], self.micro_index == 0
        if graphs is not None:
            graphs[0][first, last].replay()
        else:
            self._micro_step(micro, first, last)
        self.micro_index += 1
        self.zero.stale = self.zero.stale and not first

    def finish_step(self, lr: float, step: int, opt: AdamWConfig, upcoming: tuple | None = None) -> tuple[float, float]:
        """The optimizer step, the next step's first micro-batch staged meanwhile, then the loss and norm read
        with one synchronization."""
        key, micro, graphs = self.step_graphs
        self._set_scalars(lr, step, opt)
        if graphs is not None:
            graphs[1].replay()
        else:
            self._optimizer(opt)
        self._prepare(upcoming)
        loss, norm = float(self.loss_total.download()[0]), float(np.sqrt(self.norm_squared.download()[0]))
        if graphs is None and key is not None:  # everything is allocated and compiled now: a graph per role
            roles = {(i == 0, i == micro - 1) for i in range(micro)}  # (first, last) of the step's micro-batches
            with phase(CAPTURE):
                self.graphs[key] = ({role: Graph(lambda role=role: self._micro_step(micro, *role)) for role in roles},
                                    Graph(lambda: self._optimizer(opt)))
        self.zero.stale = True
        return loss, norm

    def _micro_step(self, micro: int, first: bool, last: bool) -> None:
        """Forward and backward of one micro-batch; the first one of a step gathers the new weights, the
        last one reduce-scatters the gradients (several GPUs; at ZeRO-2 and 3 every one does)."""
        self.zero.begin(gather=first, first=first)
        self._forward(1.0 / micro, True, 1.0 / micro)
        self._backward(sync=last)
        self.zero.end(last)

    # ---- the optimizer in the backward: one micro-batch a step, one captured graph

    def train_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   upcoming: tuple | None = None) -> tuple[float, float]:
        """Model.train_step; with the optimizer in the backward one forward and a backward that updates
        each group of weights as soon as its gradients are final, clipped by the norm estimated from the
        groups' norms so far and the last step's (group_norms_squared), as the reference does. The first
        step of a shape runs eagerly and captures."""
        if not self.in_backward:
            return super().train_step(batches, lr, step, opt, upcoming)
        if len(batches) != 1:
            raise ValueError(f"optimizer-in-backward takes one micro-batch a step, got {len(batches)}")
        tokens, targets = batches[0]
        check_batch(tokens, targets, self.config.vocab_size, self.B, self.T)
        self._set_scalars(lr, step, opt)
        self._upload(tokens, targets)
        self.shape, key = tokens.shape, (*tokens.shape, "in backward", opt)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self._step_in_backward(opt)
        self._prepare(upcoming)
        loss, norm = float(self.loss_total.download()[0]), float(np.sqrt(self.norm_squared.download()[0]))
        if graph is None:
            with phase(CAPTURE):
                self.graphs[key] = Graph(lambda: self._step_in_backward(opt))
        return loss, norm

    def _step_in_backward(self, opt: AdamWConfig) -> None:
        """The launches of one step with the optimizer in the backward (captured by train_step)."""
        self.step_opt = opt
        self.zero_grad()
        self.loss_total.fill_zero()
        self._forward(1.0, True, 1.0)
        self._backward(sync=False)  # the last group's update leaves this step's squared norm in norm_squared
        self.group_norms.copy_from(self.step_group_norms)

    @property
    def group_norms_squared(self) -> list[float] | None:
        """Each gradient group's squared norm of the last step, from which the optimizer in the backward
        estimates the norm it clips by (Model); checkpoints keep it."""
        return [float(x) for x in self.group_norms.download()] if self.in_backward else None

    @group_norms_squared.setter
    def group_norms_squared(self, norms: list[float] | None) -> None:
        if self.in_backward:
            self.group_norms.upload(np.zeros(len(self.groups), np.float32) if norms is None
                                    else np.asarray(norms, np.float32))

    # ---- state for checkpoints: GPUModelBase's, and the norms' fp32 replica

    def set_state(self, params: np.ndarray, adam_m: np.ndarray | None = None, adam_v: np.ndarray | None = None) -> None:
        super().set_state(params, adam_m, adam_v)
        if self.norm_weights is not None:
            self.norm_weights.set(params)

    def master_weights(self) -> DeviceArray:
        """The full flat fp32 weights on the device (gathered from every rank on several GPUs: all
        ranks call it), e.g. for a decoder."""
        return self.zero.gather_flat(self.zero.master)
