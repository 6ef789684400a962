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
attention build run is the plan's (llama/run/plan.py).

The model is this module's buffers, its forward and backward over the layers, and the classifier, composed of
parts that each hold their own state (self.<part>):
  block    bf16_block.py BF16Block: a layer's forward and backward, shared with the GPU decoder's prefill
  linears  linears.py BF16Linears, or fp8_linears.py FP8Linears under --dtype fp8: the block's linear layers
  inputs   bf16_inputs.py PinnedInputs: the batch, the optimizer's scalars and the loss scale, staged in pinned memory
  step     bf16_step.py CapturedStep (the step as CUDA graphs, the ZeRO optimizer), or bf16_in_backward.py
           InBackwardStep (the optimizer in the backward): the step, and where the gradients accumulate
  zero     llama/parallel/zero.py Zero: the weights, gradients and optimizer state, sharded on several GPUs

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
from ..optim import AdamWConfig
from ..params import AdapterLayout, init_adapters
from ..parallel.zero import MasterReplica
from ..runtime.cuda import BF16, DeviceArray, allocate
from .base import check_batch, check_trains, counted_targets, weakly
from .bf16_block import BF16Block
from .bf16_in_backward import InBackwardStep
from .bf16_inputs import PinnedInputs
from .bf16_step import CapturedStep
from .gpu_base import GPUModelBase
from .fp8_linears import FP8Linears
from .frozen_base import FrozenBase
from .linears import BF16Linears
from .lora_linears import LoRALinears
from .shapes import (CLASSIFIER_CHUNK, LAYER_ACTIVATIONS, activation_shapes, bf16_activations, bf16_scratch,
                     frozen_gradients)


class GPUModelBF16(GPUModelBase):
    def __init__(self, config: LlamaConfig, plan, batch: tuple[int, int], params: np.ndarray | None = None,
                 seed: int = 0, comm=None):
        """Every model's arguments (llama/model/__init__.py). From the plan (llama/run/plan.py): which GEMM and
        attention builds run, the linear layers' dtype, what the backward recomputes and the optimizer (in the
        backward or after it), the document mask (each forward computes its batch's document bounds on the GPU
        from the uploaded tokens, inside the captured graphs, and every layer's attention, forward and backward,
        is document-masked), and with sft that the loss is divided by the step's counted targets (train_step's
        counted, read by the classifier from a device scalar). With the plan's lora the model fine-tunes through
        adapters: params (or seed) are the frozen base's (model/frozen_base.py), the adapters drawn from seed as PEFT
        draws them (llama/params.py init_adapters) are what the optimizer (ZeRO) trains."""
        self.base = None  # the frozen base of a fine-tune through adapters
        if plan.lora is not None:
            adapters = AdapterLayout(config, plan.lora)
            self.base = FrozenBase(config, plan.qlora, params, seed)
            params = self._setup(config, plan, batch, init_adapters(adapters, seed), seed, comm, BF16, trained=adapters)
        else:
            params = self._setup(config, plan, batch, params, seed, comm, BF16, gradients=not plan.in_backward)
        self.params_bf16 = self.zero.weights
        norms = self.layout.norm_names()
        self.norm_weights = None if comm is None or self.base else MasterReplica(self.zero, self.layout, norms, params)
        self.step = InBackwardStep(self) if plan.in_backward else CapturedStep(self)
        self._allocate()
        weight, grad = weakly(self.weight), weakly(self.grad)
        if self.base:
            self.linears = LoRALinears(plan, weight, weakly(self.adapter_weight), grad, self.trained, config,
                                       self.B * self.T)
        elif plan.dtype == "fp8":
            self.linears = FP8Linears(plan, weight, grad, config, self.layout, self.B, self.T, self.zero)
        else:
            self.linears = BF16Linears(plan, weight, grad)
        self.block = BF16Block(config, self.layout, plan, self.linears, weakly(self.master), grad,
                               weakly(self._document_mask))

    # ---- buffers

    def _shapes(self, b: int, t: int) -> tuple[dict, dict]:
        return activation_shapes(self.config, b, t, self.plan.recompute, self.plan.attention)

    def _allocate(self) -> None:
        """The activations for batches of up to (B, T), the scratch and the step's inputs (llama/model/shapes.py)."""
        layer, shared = bf16_activations(self.config, self.B, self.T, self.plan.recompute, self.plan.attention)
        self.layer_buffers = [allocate(layer) for _ in range(self.config.n_layers)]
        self.buffers = allocate(shared)
        N = self.B * self.T
        scratch = allocate(bf16_scratch(self.config, self.B, self.T), zeroed=True)
        self.buffers["rms_scratch"], self.embedding_scratch = scratch["rms_scratch"], scratch["embedding_scratch"]
        self.logit_rows = scratch["logit_rows"]
        self.norm_scratch, self.norm_squared, self.loss_total = (scratch[k] for k in ("norm_scratch", "norm_squared",
                                                                                     "loss_total"))
        self.inputs = PinnedInputs(N)
        if self.base:
            self.frozen_gradients = allocate(frozen_gradients(self.config))["frozen_gradients"]

    def _views(self, b: int, t: int) -> tuple[list[dict], dict]:
        """Activations for a (b, t) batch: prefixes of the buffers, shaped as in the reference."""
        layer, shared = self._shapes(b, t)
        layers = [{k: buffers[k].prefix(*s) for k, s in layer.items()} for buffers in self.layer_buffers]
        views = {k: self.buffers[k].prefix(*s) for k,
                 s in shared.items()} | {"rms_scratch": self.buffers["rms_scratch"]}
        for a in layers:  # each layer reads the shared buffers of what it does not keep under their usual names
            a.update({k: views[k] for k in LAYER_ACTIVATIONS["none"] if k not in a})
        return layers, views

    def weight(self, tensor) -> DeviceArray:
        """A weight's bf16 copy, as the GEMMs read it (a Tensor of the layout or its name): the frozen base's with
        adapters."""
        tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
        return self.base.matrix(tensor) if self.base else self.zero.weight(tensor.offset, tensor.shape)

    def adapter_weight(self, tensor) -> DeviceArray:
        """An adapter's bf16 copy (a Tensor of the adapters' layout), written by AdamW with its master."""
        return self.zero.weight(tensor.offset, tensor.shape)

    def master(self, name: str) -> DeviceArray:
        """A weight's fp32 master copy, as the RMSNorms read it (their small updates would be lost in bf16); the
        frozen base's norm with adapters."""
        if self.base:
            return self.base.norm(name)
        if self.norm_weights is not None:
            return self.norm_weights.view(name)
        tensor = self.layout.tensors[name]
        return self.zero.master.view(tensor.offset, tensor.shape)

    def grad(self, tensor) -> DeviceArray:
        """Where a tensor's gradient accumulates (a Tensor of what the optimizer trains, or a name): the step's to
        say; a frozen base's norm's goes to a discard buffer (the norm kernels' backward writes one)."""
        if self.base and (isinstance(tensor, str) or tensor.name in self.layout.tensors):
            tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
            return self.frozen_gradients.prefix(*tensor.shape)
        return self.step.grad(self.layout.tensors[tensor] if isinstance(tensor, str) else tensor)

    def gemm(self, c: DeviceArray, a: DeviceArray, b: DeviceArray, **options) -> None:
        """ops.gemm with the plan's GEMM version for the problem's shape (the head's GEMMs, bf16 whatever the
        linear layers)."""
        ops.gemm(c, a, b, version=self.plan.gemm, **options)

    # ---- the step: the step part's (bf16_step.py, bf16_in_backward.py)

    def train_step(self, batches: list, lr: float, step: int, opt: AdamWConfig, upcoming: tuple | None = None,
                   counted: float | None = None) -> tuple[float, float]:
        check_trains(self.plan)
        return self.step.train_step(batches, lr, step, opt, upcoming, counted)

    def eager_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   counted: float | None = None) -> tuple[float, float]:
        check_trains(self.plan)
        return self.step.eager_step(batches, lr, step, opt, counted)

    def optimizer_step(self, lr: float, step: int, opt: AdamWConfig, return_norm: bool = True) -> float | None:
        return self.step.optimizer_step(lr, step, opt, return_norm)

    def zero_grad(self) -> None:
        self.step.zero_grad()

    @property
    def group_norms_squared(self) -> list[float] | None:
        """With the optimizer in the backward, each gradient group's squared norm of the last step (Model)."""
        return self.step.group_norms_squared

    @group_norms_squared.setter
    def group_norms_squared(self, norms: list[float] | None) -> None:
        if self.plan.in_backward:
            self.step.group_norms_squared = norms

    def loss_and_norm(self) -> tuple[float, float]:
        """The step's mean loss and gradient norm, read from the device (a synchronization)."""
        return float(self.loss_total.download()[0]), float(np.sqrt(self.norm_squared.download()[0]))

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
            self.inputs.set_loss_scale(1.0 / counted)
        # the classifier weighs each token by 1 / N times this (1.0 when every target counts), or with sft by the
        # device scale 1 / counted times this
        ratio = 1.0 if self.plan.sft else tokens.size / counted
        self.inputs.upload(tokens, targets)
        self.shape, self.has_targets = tokens.shape, targets is not None
        self.loss_total.fill_zero()
        with_gradients = targets is not None and loss_scale is not None
        self.zero.begin(gather=self.zero.stale)
        self.launch_forward(loss_scale * ratio if with_gradients else None, targets is not None, ratio)
        if not with_gradients:
            self.zero.end(None)
        if targets is None or not return_loss:
            return None
        return float(self.loss_total.download()[0])

    def launch_forward(self, loss_scale: float | None, with_targets: bool, loss_weight: float) -> None:
        """The forward's launches for the uploaded batch of shape self.shape (captured by the step), each
        layer's after its weights are there (ZeRO: Zero.layer, Zero.use_weights)."""
        c, z, starts = self.config, self.zero, self.trained.layer_starts()  # each layer's first offset (ZeRO's buckets)
        b, t = self.shape
        N, H, KV, D = b * t, c.n_heads, c.n_kv_heads, c.head_dim
        layers, s = self._views(b, t)
        tokens = self.inputs.batch["tokens"].prefix(N)
        rope = (self.rope_cos, self.rope_sin, t, (H + KV) * D)

        self.linears.prepare()
        self._document_bounds(tokens.reshape(b, t))
        z.use_weights(0, prefetch=starts[0])
        ops.embedding_forward_bf16(layers[0]["x"], tokens, self.weight("tok_embeddings.weight"))
        for i, a in enumerate(layers):
            with z.layer(starts[i], prefetch=starts[i + 1]):
                self.block.attention_norm(i, a, layers[i - 1]["h"], s["branch"])  # x = h + the last layer's branch
                self.block.forward(i, a, s, N, rope)
        ops.rmsnorm_residual_forward_bf16(s["residual"], s["lnf"], s["rstdf"], layers[-1]["h"], s["branch"],
                                     self.master("norm.weight"), c.norm_eps)
        if with_targets:
            if not self.base:
                z.use_weights(self.layout.output().offset)
            self._classifier(s, N, loss_scale, loss_weight)

    def _classifier(self, s: dict, N: int, loss_scale: float | None, loss_weight: float) -> None:
        """Chunks of tokens: logits, losses and dlogits (over the logits); with loss_scale also the
        head's dX (into dln) and dW (not with adapters: the head is frozen) at once. Each token's loss counts loss_weight / N and its gradient
        loss_scale / N; with the plan's sft, times 1 / the step's counted targets instead of 1 / N, read from the
        device scalar loss_scale (set per step: a replayed graph reads the new value)."""
        C, V = self.config.dim, self.config.vocab_size
        w_out = self.weight(self.layout.output())
        dw_out = None if self.base or loss_scale is None else self.grad(self.layout.output())
        targets = self.inputs.batch["targets"]
        if self.plan.sft:
            dloss, weight, scale = loss_scale or 0.0, loss_weight, self.inputs.loss_scale
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
                if dw_out is not None:
                    self.gemm(dw_out, logits, lnf, trans_a=True, accumulate=True)
        ops.loss_accumulate_bf16(self.loss_total, s["losses"], weight, scale_at=scale)

    def backward(self) -> None:
        """Add the gradients of the last forward (run with loss_scale) into the gradients (the eager path:
        optimizer_step() after the step's last one). On several GPUs it ends the forward's ZeRO region: at
        stages 2-3 each bucket is reduce-scattered into the shard (added from the step's second micro-batch
        on) as soon as it is final; stage 1 reduces them all in optimizer_step()."""
        self.launch_backward(sync=False)
        self.zero.end(last=False)

    def launch_backward(self, sync: bool) -> None:
        """The backward's launches (captured by the step); with sync (the last micro-batch of a step, several
        GPUs) each bucket of final gradients is reduce-scattered while the backward goes on."""
        c, z, starts = self.config, self.zero, self.trained.layer_starts()
        b, t = self.shape
        N, H, KV = b * t, c.n_heads, c.n_kv_heads
        layers, s = self._views(b, t)
        dx, grad = s["dresidual"], self.grad
        dx.fill_zero()
        ops.rmsnorm_backward_bf16(dx, grad("norm.weight"), s["rms_scratch"], s["dln"], s["residual"],
                                  self.master("norm.weight"), s["rstdf"])
        self._gradients_final("norm.weight", sync)
        rope = (self.rope_cos, self.rope_sin, t, (H + KV) * c.head_dim)
        for i in reversed(range(c.n_layers)):
            with z.layer(starts[i], prefetch=starts[i - 1] if i else None, gradients=True):
                self.block.backward(i, layers[i], s, N, rope)
            self._gradients_final(f"layers.{i}.attention_norm.weight", sync, starts[i])
        if self.base:
            return  # the embedding is frozen
        ops.embedding_backward_bf16(grad("tok_embeddings.weight"), dx, self.inputs.batch["order"].prefix(N),
                                    self.inputs.batch["segments"].prefix(N, 4), self.embedding_scratch)
        self._gradients_final("tok_embeddings.weight", sync)

    def _gradients_final(self, name: str, sync: bool, adapters_from: int | None = None) -> None:
        """The gradients from this tensor to the end of the flat buffer are final: the step's to take on
        (reduce-scatter them on several GPUs, or update the group this tensor starts). With adapters, those from
        adapters_from on (a layer's first), nothing for a tensor of the frozen base."""
        if not self.base:
            self.step.gradients_final(self.layout.tensors[name].offset, sync)
        elif adapters_from is not None:
            self.step.gradients_final(adapters_from, sync)

    def token_losses(self) -> np.ndarray:
        """(b, t) fp32 cross-entropy of each target of the last forward() with targets (of its bf16 logits)."""
        if self.shape is None or not self.has_targets:
            raise RuntimeError("token_losses() needs a forward() with targets first")
        b, t = self.shape
        return self.buffers["losses"].prefix(b * t).download().reshape(b, t)

    def read_logits(self, position: int | np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """(b, t, V) logits of the last forward, or (len(rows), V) at one position of each of the rows (default
        all b; position an int, or one per row), as float32, from the final norm's output, which every forward
        keeps: a GEMM for a chunk of tokens (the logits buffer's), or for the rows' tokens gathered (logit_rows)."""
        if self.shape is None:
            raise RuntimeError("read_logits() needs a forward() first")
        (b, t), C, V = self.shape, self.config.dim, self.config.vocab_size
        w_out, lnf, logits = self.weight(self.layout.output()), self.buffers["lnf"], self.buffers["logits"]
        if position is None:
            out, chunk = np.empty((b * t, V), np.float32), logits.shape[0]
            for start in range(0, b * t, chunk):
                n = min(chunk, b * t - start)
                self.gemm(logits.prefix(n, V), lnf.view(start * C, (n, C)), w_out, trans_b=True)
                out[start:start + n] = logits.prefix(n, V).download()
            return out.reshape(b, t, V)
        rows = np.arange(b) if rows is None else np.asarray(rows)
        tokens = rows * t + np.broadcast_to(position, rows.shape) % t
        out, chunk = np.empty((len(rows), V), np.float32), min(self.B, logits.shape[0])
        for start in range(0, len(rows), chunk):
            n = min(chunk, len(rows) - start)
            for i, token in enumerate(tokens[start:start + n]):
                self.logit_rows.view(i * C, (C,)).copy_from(lnf.view(int(token) * C, (C,)))
            self.gemm(logits.prefix(n, V), self.logit_rows.prefix(n, C), w_out, trans_b=True)
            out[start:start + n] = logits.prefix(n, V).download()
        return out

    # ---- state for checkpoints: GPUModelBase's, and the norms' fp32 replica

    def set_state(self, params: np.ndarray | None, adam_m=None, adam_v=None) -> None:
        super().set_state(params, adam_m, adam_v)
        if self.norm_weights is not None and params is not None:
            self.norm_weights.set(params)

    def master_weights(self) -> DeviceArray:
        """The full flat fp32 weights on the device (gathered from every rank on several GPUs: all
        ranks call it), e.g. for a decoder; not with adapters, whose base is frozen in bf16 or NF4 (export the run
        with --merge, or --adapter, and generate from that)."""
        if self.base:
            raise ValueError("a model with adapters keeps no fp32 weights to decode from: export the run (--merge or "
                             "--adapter) and generate from the export")
        return self.zero.gather_flat(self.zero.master)
