"""Llama 3.1 on the GPU, built from the kernels in kernels/ through the launchers in llama/ops/fp32.py.

It mirrors llama/model/reference.py layer by layer, with the same names: read the two side by side.
Parameters live in one flat device buffer and gradients in another (layout from llama/params.py);
activations are allocated once for the largest batch (B, T), and a smaller (b, t) uses a prefix of
each buffer. Within a step nothing is allocated, copied to the host or synchronized, except when the
loss or the grad norm is read. With a communicator (several GPUs) the optimizer is ZeRO at stage 1, 2 or 3
(llama/parallel/zero.py) over the fp32 params: the forward and backward find each tensor's weights and
gradients through it, and tell it where they are (Zero.layer around each layer, use_weights, reduce_from).
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..runtime.cuda import DeviceArray, allocate
from ..optim import AdamWConfig
from .base import check_batch, counted_targets, mean_counted_loss
from .gpu_base import GPUModelBase
from .shapes import fp32_activations, fp32_inputs


class GPUModelFP32(GPUModelBase):
    def __init__(self, config: LlamaConfig, plan, batch: tuple[int, int], params: np.ndarray | None = None,
                 seed: int = 0, comm=None):
        """Every model's arguments (llama/model/__init__.py). From the plan: the ZeRO stage on several GPUs
        (llama/parallel/zero.py) and the document mask (each forward computes its batch's document bounds on the
        GPU and every layer's attention is document-masked)."""
        self._setup(config, plan, batch, params, seed, comm, np.float32)
        self._allocate_activations()
        self.has_dlogits = False

    # ---- buffers

    def _allocate_activations(self) -> None:
        """The activations for batches of up to (B, T) and the batch's inputs (llama/model/shapes.py)."""
        layer, shared = fp32_activations(self.config, self.B, self.T)
        self.layer_buffers = [allocate(layer) for _ in range(self.config.n_layers)]
        self.buffers = allocate(shared)
        inputs = allocate(fp32_inputs(self.B * self.T))
        self.tokens, self.targets = inputs["tokens"], inputs["targets"]
        self.token_order, self.token_starts, self.token_unique = (inputs[k] for k in ("token_order", "token_starts",
                                                                                     "token_unique"))
        self.num_unique = 0

    def _views(self, b: int, t: int) -> tuple[list[dict], dict]:
        """Activations for a (b, t) batch: prefixes of the buffers, shaped as in the reference."""
        layer, shared = fp32_activations(self.config, b, t)
        layers = [{name: buffers[name].prefix(*shape) for name, (shape, _) in layer.items()}
                  for buffers in self.layer_buffers]
        return layers, {name: self.buffers[name].prefix(*shape) for name, (shape, _) in shared.items()}

    def param(self, tensor) -> DeviceArray:
        """A weight (a Tensor of the layout or its name)."""
        tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
        return self.zero.weight(tensor.offset, tensor.shape)


    # ---- forward and backward

    def forward(self, tokens: np.ndarray, targets: np.ndarray | None = None, return_loss: bool = True) -> float | None:
        """Run the model on (b, t) tokens. With targets, the fused classifier turns the logits into
        dlogits for backward() and the mean loss over the counted targets (>= 0) is returned (reading it is the
        step's one sync; return_loss=False skips it). Without targets the logits are kept (read_logits)."""
        check_batch(tokens, targets, self.config.vocab_size, self.B, self.T)
        c, L = self.config, self.layout
        b, t = tokens.shape
        N = b * t
        self.shape = (b, t)
        # uploads first, while the GPU is idle (a host-to-device copy waits for earlier kernels)
        self.tokens.prefix(N).upload(tokens.ravel())
        if targets is not None:
            self.targets.prefix(N).upload(targets.ravel())
            order, starts, unique = ops.sort_tokens(tokens)
            self.token_order.prefix(N).upload(order)
            self.token_starts.prefix(len(starts)).upload(starts)
            self.token_unique.prefix(len(unique)).upload(unique)
            self.num_unique = len(unique)
        layers, s = self._views(b, t)
        tokens_d = self.tokens.prefix(N).reshape(b, t)
        z, starts = self.zero, L.layer_starts()  # each layer's first offset, the final norm's (ZeRO's buckets)

        self._document_bounds(tokens_d)
        z.begin(gather=False)  # (stage 3 gathers each layer's weights as the forward reaches it)
        z.use_weights(0, prefetch=starts[0])
        ops.embedding_forward(layers[0]["x"], tokens_d, self.param("tok_embeddings.weight"))
        for i, a in enumerate(layers):
            pre = f"layers.{i}."
            with z.layer(starts[i], prefetch=starts[i + 1]):
                x_next = layers[i + 1]["x"] if i + 1 < c.n_layers else s["residual"]
                ops.rmsnorm_forward(a["ln1"], a["rstd1"], a["x"], self.param(pre + "attention_norm.weight"), c.norm_eps)
                ops.matmul_forward(s["qkv"].reshape(N, -1), a["ln1"], self.param(L.wqkv(i)))
                ops.rope_forward(a["q"], a["k"], a["v"], s["qkv"], self.rope_cos, self.rope_sin)
                ops.attention_forward(a["att"], a["probs"], s["heads"], a["q"], a["k"], a["v"], **self._document_mask())
                ops.matmul_forward(a["h"], a["att"].reshape(N, -1), self.param(pre + "attention.wo.weight"))
                ops.residual_forward(a["h"], a["x"], a["h"])
                ops.rmsnorm_forward(a["ln2"], a["rstd2"], a["h"], self.param(pre + "ffn_norm.weight"), c.norm_eps)
                ops.matmul_forward(a["gate_up"], a["ln2"], self.param(L.w13(i)))
                ops.swiglu_forward(a["ffn"], a["gate_up"])
                ops.matmul_forward(x_next, a["ffn"], self.param(pre + "feed_forward.w2.weight"))
                ops.residual_forward(x_next, a["h"], x_next)
        z.use_weights(starts[-1])
        z.use_weights(L.output().offset)
        ops.rmsnorm_forward(s["lnf"], s["rstdf"], s["residual"], self.param("norm.weight"), c.norm_eps)
        ops.matmul_forward(s["logits"], s["lnf"], self.param(L.output()))
        self.has_dlogits = targets is not None
        if targets is None:
            z.end(None)
            return None  # with targets the ZeRO region stays open for backward(), which ends it
        counted = counted_targets(targets)
        ops.fused_classifier(s["logits"], s["losses"], self.targets.prefix(N), 1.0 / max(counted, 1))
        if not return_loss:
            return None
        return mean_counted_loss(s["losses"].download(), counted)

    def token_losses(self) -> np.ndarray:
        """(b, t) cross-entropy of each target of the last forward with targets."""
        if self.shape is None or not self.has_dlogits:
            raise RuntimeError("token_losses() needs a forward() with targets first")
        b, t = self.shape
        return self.buffers["losses"].prefix(b * t).download().reshape(b, t)

    def read_logits(self, position: int | np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """(b, t, V) logits of the last forward without targets, or (len(rows), V) at one position of each of the
        rows (default all b): an int, or one per row."""
        if self.shape is None or self.has_dlogits:
            raise RuntimeError("read_logits() needs a forward() without targets first")
        (b, t), V = self.shape, self.config.vocab_size
        logits = self.buffers["logits"]
        if position is None:
            return logits.prefix(b, t, V).download()
        rows = np.arange(b) if rows is None else np.asarray(rows)
        positions = np.broadcast_to(position, rows.shape)
        return np.stack([logits.view((int(row) * t + int(p) % t) * V, (V,)).download() for row, p in zip(rows, positions)])

    def backward(self, loss_scale: float = 1.0) -> None:
        """Add the gradient of loss_scale * (mean loss of the last forward) into the gradients (ZeRO-2 and 3:
        reduce-scatter each bucket of them into the shard as soon as it is final), ending the forward's ZeRO
        region."""
        if not self.has_dlogits:
            raise RuntimeError("backward() needs a forward() with targets first")
        c, L = self.config, self.layout
        b, t = self.shape
        N = b * t
        layers, s = self._views(b, t)
        grad, z, starts = self.grad, self.zero, L.layer_starts()
        dx = s["dresidual"]
        z.use_weights(starts[-1])  # in the forward's ZeRO region: stage 3 gathers only what the forward did not leave
        z.use_weights(L.output().offset)
        ops.matmul_backward(s["dln"], self.grad(L.output()), s["logits"], s["lnf"],
                            self.param(L.output()), alpha=loss_scale)
        dx.fill_zero()
        ops.rmsnorm_backward(dx, grad("norm.weight"), s["rms_scratch"], s["dln"], s["residual"],
                             self.param("norm.weight"), s["rstdf"])
        z.reduce_from(starts[-1], last=False)
        for i in reversed(range(c.n_layers)):
            pre, a = f"layers.{i}.", layers[i]
            with z.layer(starts[i], prefetch=starts[i - 1] if i else None, gradients=True):
                ops.matmul_backward(s["dffn"], grad(pre + "feed_forward.w2.weight"), dx, a["ffn"],
                                    self.param(pre + "feed_forward.w2.weight"))
                ops.swiglu_backward(s["dgate_up"], s["dffn"], a["gate_up"])
                ops.matmul_backward(s["dln"], self.grad(L.w13(i)), s["dgate_up"], a["ln2"],
                                    self.param(L.w13(i)))
                ops.rmsnorm_backward(dx, grad(pre + "ffn_norm.weight"), s["rms_scratch"], s["dln"], a["h"],
                                     self.param(pre + "ffn_norm.weight"), a["rstd2"])
                ops.matmul_backward(s["datt"].reshape(N, -1), grad(pre + "attention.wo.weight"), dx,
                                    a["att"].reshape(N, -1), self.param(pre + "attention.wo.weight"))
                ops.attention_backward(s["dq"], s["dk"], s["dv"], s["dprobs"], s["dheads"], s["datt"], a["q"], a["k"],
                                       a["v"], a["probs"], **self._document_mask())
                ops.rope_backward(s["dqkv"], s["dq"], s["dk"], s["dv"], self.rope_cos, self.rope_sin)
                ops.matmul_backward(s["dln"], self.grad(L.wqkv(i)), s["dqkv"].reshape(N, -1),
                                    a["ln1"], self.param(L.wqkv(i)))
                ops.rmsnorm_backward(dx, grad(pre + "attention_norm.weight"), s["rms_scratch"], s["dln"], a["x"],
                                     self.param(pre + "attention_norm.weight"), a["rstd1"])
            z.reduce_from(starts[i], last=False)
        ops.embedding_backward(grad("tok_embeddings.weight"), dx, self.token_order.prefix(N), self.token_starts,
                               self.token_unique, self.num_unique)
        z.end(last=False)

    def optimizer_step(self, lr: float, step: int, opt: AdamWConfig, return_norm: bool = True) -> float | None:
        """Clip by global norm and take one AdamW step (step counts from 1); returns the norm
        (reading it synchronizes; return_norm=False skips that). On several GPUs this is ZeRO
        (llama/parallel/zero.py): reduce-scatter the gradients, the global norm, AdamW on this rank's shard of
        the fp32 params, all-gather them (at ZeRO-3 the forward gathers them as it goes)."""
        s, z = self.buffers, self.zero
        z.finish_reduce()
        ops.global_norm_squared(s["norm_squared"], s["norm_partial"], z.grad_shard)
        z.sum_over_ranks(s["norm_squared"])
        ops.adamw_update(z.master, z.grad_shard, z.m, z.v, z.decay_mask, s["norm_squared"], step, lr, opt)
        z.gather_weights()
        return float(np.sqrt(s["norm_squared"].download()[0])) if return_norm else None

    def master_weights(self) -> DeviceArray:
        """The full flat fp32 weights on the device (gathered from every rank on several GPUs: all ranks call it)."""
        return self.zero.gather_flat(self.zero.master)
