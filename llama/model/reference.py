"""Llama 3.1 in numpy: the whole model, exact, and its KV-cache decoder, built from the layers' numpy
twins (llama/twins/, one module per op, named like its kernel and launcher).

This is the oracle that the GPU models are tested against, and the CPU backend of the trainer.
Layouts and the attention's words: llama/twins/__init__.py.
"""

from __future__ import annotations

import numpy as np

from ..config import LlamaConfig
from ..optim import (OPTIMIZER_STATES, QUANT_BLOCK, AdamW8bitState, AdamWConfig, clip_norm_estimate, clip_scale,
                     global_norm, squared_norm)
from ..params import (LORA_GEMMS, LORA_TARGETS, AdapterLayout, ParameterLayout, init_adapters, model_parameters,
                      quantized_base)
from ..twins.attention import (attention_backward, attention_forward, document_attention_backward,
                               document_attention_forward, document_ids)
from ..twins.classifier import fused_classifier
from ..twins.embedding import embedding_backward, embedding_forward
from ..twins.fp8 import matmul_fp8_backward, matmul_fp8_forward
from ..twins.lora import adapter_backward, adapter_forward
from ..twins.matmul import matmul_backward, matmul_forward, matmul_input_backward
from ..twins.residual import residual_forward
from ..twins.rmsnorm import rmsnorm_backward, rmsnorm_forward
from ..twins.rope import rope_backward, rope_forward
from ..twins.swiglu import swiglu_backward, swiglu_forward
from .base import Model, check_batch, check_trains, counted_targets, mean_counted_loss, rope_cos_sin, step_share
from .sampling import HostSampling

# ----------------------------------------------------------------------------------------------
# The model


RECOMPUTED = {"none": (), "partial": ("ln1", "ln2", "ffn")}  # the activations a layer does not keep ("full": all but x)


class ReferenceBlock:
    """The transformer block on the CPU, defined once for the model and its decoder: the layers' forward
    (_layer_forward), its attention step over the sequence (_attention, the decoder's over its KV cache), and
    a block's linear layers (exact, or the FP8 twins), with LoRA adapters beside them or not. Its users hold
    config, layout, params (flat), p (the layout's views of params), dtype and fp8, and with adapters
    adapter_layout and adapters (flat) from _attach_adapters; the model also doc_ids, which this _attention reads
    (the batch's document ids (B, T), or None: attention spans the row; the decoder has its own _attention)."""
    adapter_layout = adapters = None  # without adapters

    def _matrix(self, flat: np.ndarray, tensor) -> np.ndarray:
        return flat[tensor.offset:tensor.offset + tensor.size].reshape(tensor.shape)

    def _gemm_weights(self, i: int) -> tuple:
        """Layer i's four GEMMs' weights (Tensors of the layout), in LORA_GEMMS' order: wqkv, wo, w13, w2."""
        L, pre = self.layout, f"layers.{i}."
        return L.wqkv(i), L.tensors[pre + "attention.wo.weight"], L.w13(i), L.tensors[pre + "feed_forward.w2.weight"]

    def _attach_adapters(self, layout: AdapterLayout, adapters: np.ndarray) -> None:
        """LoRA adapters (flat, in layout) beside the linear layers: self.adapted[i][g] lists, for GEMM g of layer i,
        each of its targets' output columns (a slice of the GEMM's output) with the Tensors of its A and B."""
        self.adapter_layout, self.adapters = layout, adapters
        pairs, self.adapted = layout.adapted(), []
        for i in range(self.config.n_layers):
            layer = []
            for gemm, targets in zip(self._gemm_weights(i), LORA_GEMMS):
                weights = [self.layout.tensors[f"layers.{i}.{LORA_TARGETS[t]}.weight"] for t in targets
                           if t in layout.spec.targets]
                rows = [(w.offset - gemm.offset) // gemm.shape[1] for w in weights]
                layer.append([(slice(row, row + w.shape[0]), *pairs[w.name]) for row, w in zip(rows, weights)])
            self.adapted.append(layer)

    def _gemm(self, a: dict, i: int, g: int, x_key: str) -> np.ndarray:
        """Layer i's GEMM g (LORA_GEMMS' order) on the activation a[x_key]; with adapters, each target's columns
        get scale * (x A^T) B^T (twins.lora.adapter_forward), x A^T kept in a for the backward."""
        x = a[x_key]
        out = self._linear_forward(x, self._matrix(self.params, self._gemm_weights(i)[g]))
        for t, (rows, lora_a, lora_b) in enumerate(self.adapted[i][g] if self.adapters is not None else ()):
            a_matrix, b_matrix = self._matrix(self.adapters, lora_a), self._matrix(self.adapters, lora_b)
            delta, a[f"xa{g}.{t}"] = adapter_forward(x, a_matrix, b_matrix, self.adapter_layout.spec.scale)
            out[..., rows] += delta
        return out

    def _linear_forward(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """A block's linear layer: matmul_forward, or its FP8 twin."""
        if self.fp8 is None:
            return matmul_forward(x, weight)
        return matmul_fp8_forward(x, weight, self.fp8).astype(self.dtype)

    def _attention(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Layer i's causal attention of the new positions' q, k, v (head-major), document-masked with doc_ids:
        (att, lse)."""
        if self.doc_ids is None:
            return attention_forward(q, k, v)
        return document_attention_forward(q, k, v, self.doc_ids)

    def _layer_forward(self, i: int, x: np.ndarray, rope) -> dict:
        """Layer i on its input x (B, T, C): every activation its backward reads, and its output "out"."""
        c, p, pre = self.config, self.p, f"layers.{i}."
        a = {"x": x}
        a["ln1"], a["rstd1"] = rmsnorm_forward(x, p[pre + "attention_norm.weight"], c.norm_eps)
        a["q"], a["k"], a["v"] = rope_forward(self._gemm(a, i, 0, "ln1"), *rope, c.n_heads, c.n_kv_heads)
        a["att"], a["lse"] = self._attention(i, a["q"], a["k"], a["v"])
        a["h"] = residual_forward(x, self._gemm(a, i, 1, "att"))
        a["ln2"], a["rstd2"] = rmsnorm_forward(a["h"], p[pre + "ffn_norm.weight"], c.norm_eps)
        a["gate_up"] = self._gemm(a, i, 2, "ln2")
        a["ffn"] = swiglu_forward(a["gate_up"])
        a["out"] = residual_forward(a["h"], self._gemm(a, i, 3, "ffn"))
        return a


class ReferenceModel(ReferenceBlock, Model):
    """Llama 3.1 on the CPU: forward, backward into one flat gradient buffer, AdamW (fp32 or 8-bit
    moments, llama/optim.py). recompute: what each layer keeps for the backward (RECOMPUTE): everything,
    all but its RMSNorm outputs and SwiGLU product (as the bf16 GPU model), or only its input, the
    backward running the layer's forward again; the gradients are the same bits either way.

    in_backward (optimizer-in-backward): the gradients never exist whole. The backward finishes the
    parameters in groups, from the end of the flat buffer to its start (the final norm and an untied
    head, then each layer from the last, then the embedding table, which a tied head also writes), and
    AdamW updates them as soon as they are final, whole QUANT_BLOCKs at a time (a block cut by a group
    boundary waits for the next group), so a step updates the same values as the plain path's one
    update. Clipping needs the global norm before the first update, when no gradient but the last
    group's exists: each update is clipped by an estimate (optim.clip_norm_estimate), the finished
    groups' squared norms of this step plus the others' of the last step (on the first step the finished
    groups' alone: Adam's first update does not depend on the gradient's scale anyway, up to eps). The last group's update sees this step's whole
    norm. Checkpoints keep the groups' norms (group_norms_squared). A step takes one micro-batch (no
    gradient accumulation).

    With the plan's dtype "fp8", the seven linear layers of each block multiply on FP8 casts of the plan's
    fp8_scaling ("row" or "tensor"; matmul_fp8_forward/backward), the twin of --dtype fp8; the head and everything
    else as without.

    With the plan's document mask, each forward derives document ids from its tokens (twins.attention.document_ids,
    documents starting at the plan's doc_mask_bos) and every layer's attention, forward and backward, is
    document-masked (a token sees the earlier tokens of its own document only); RoPE positions stay the row's.

    With the plan's lora (a LoraSpec), the model fine-tunes through LoRA adapters: params (or the seed's) are the
    frozen base (shared with the caller's array, never written; with the plan's qlora each block's seven linear
    weights replaced by their NF4 round trip, params.quantized_base), the adapters are init_adapters(seed) in their
    AdapterLayout, and they alone are trained: trainable, grads, the moments, get_params/set_state/download_state
    are the adapters'. Each targeted linear layer adds scale * (x A^T) B^T to its output (twins.lora); the backward
    gives dx through the frozen weight and the adapter, dA and dB, never a gradient of the base.

    Every model's arguments (llama/model/__init__.py): batch None takes any batch up to max_seq_len, (B, T) batches
    up to it; comm must be None (one process). dtype: float32, or float64 for the oracle's checks."""

    def __init__(self, config: LlamaConfig, plan, batch: tuple[int, int] | None = None,
                 params: np.ndarray | None = None,
                 seed: int = 0, comm=None, dtype=np.float32):
        if plan.device != "cpu" or comm is not None:
            raise ValueError(f"the numpy reference runs a CPU plan on one process, not {plan.summary()!r}"
                             + (" with a communicator" if comm is not None else ""))
        self.config, self.plan, self.batch = config, plan, batch
        self.dtype = np.dtype(dtype)
        self.recompute = plan.recompute
        self.fp8 = plan.fp8_scaling if plan.dtype == "fp8" else None
        self.doc_mask_bos = plan.doc_mask_bos
        self.doc_ids = None  # the last forward's document ids with doc_mask_bos
        self.layout = ParameterLayout(config)
        if plan.lora is None:
            self.params = model_parameters(self.layout, params, seed).astype(self.dtype, copy=True)
            self.trainable_layout, self.trainable = self.layout, self.params
        else:
            if plan.in_backward or plan.dtype != "fp32":
                raise ValueError("the reference trains adapters in fp32 with the optimizer after the backward")
            base = model_parameters(self.layout, params, seed)
            self.params = np.asarray(quantized_base(config, base) if plan.qlora else base, self.dtype)
            adapter_layout = AdapterLayout(config, plan.lora)
            self._attach_adapters(adapter_layout, init_adapters(adapter_layout, seed).astype(self.dtype))
            self.trainable_layout, self.trainable = adapter_layout, self.adapters
        self.in_backward = plan.in_backward
        scores_only = plan.optimizer is None  # evaluation_plan's: no gradients, no moments
        self.grads = None if self.in_backward or scores_only else np.zeros_like(self.trainable)
        self.optimizer = None if scores_only else OPTIMIZER_STATES[plan.optimizer](self.trainable_layout.size, self.dtype)
        self.decay_mask = None if scores_only else self.trainable_layout.decay_mask()
        self.p = self.layout.views(self.params)
        self.acts = None
        self.groups = self.layout.gradient_groups()
        self.open_groups = {}  # optimizer-in-backward: (start, end) -> the group's gradients while it is open
        self.update_settings = None  # optimizer-in-backward: (lr, step, opt) during train_step
        self.step_norms = None  # optimizer-in-backward: the groups' squared norms of this step
        self.group_norms_squared = None  # optimizer-in-backward: the last step's (zeros before the first)

    def _linear_backward(self, dout: np.ndarray, x: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A block's linear layer: matmul_backward, or its FP8 twin."""
        if self.fp8 is None:
            return matmul_backward(dout, x, weight)
        dx, dweight = matmul_fp8_backward(dout, x, weight, self.fp8)
        return dx.astype(self.dtype), dweight.astype(self.dtype)

    def _gemm_backward(self, dout: np.ndarray, a: dict, i: int, g: int, x_key: str) -> np.ndarray:
        """The backward of _gemm: dx; the weight's gradient added, or with adapters the adapters' (dA, dB: the frozen
        weight has none)."""
        tensor, x = self._gemm_weights(i)[g], a[x_key]
        weight = self._matrix(self.params, tensor)
        if self.adapters is None:
            dx, dw = self._linear_backward(dout, x, weight)
            self._grad(tensor)[...] += dw
            return dx
        dx = matmul_input_backward(dout, weight)
        for t, (rows, lora_a, lora_b) in enumerate(self.adapted[i][g]):
            a_matrix, b_matrix = self._matrix(self.adapters, lora_a), self._matrix(self.adapters, lora_b)
            dx_adapter, da, db = adapter_backward(dout[..., rows], x, a[f"xa{g}.{t}"], a_matrix, b_matrix,
                                                  self.adapter_layout.spec.scale)
            dx += dx_adapter
            self._grad(lora_a)[...] += da
            self._grad(lora_b)[...] += db
        return dx

    def _base_gradient(self, name: str, dw: np.ndarray) -> None:
        """Add a base tensor's gradient (none with adapters: the base is frozen)."""
        if self.adapters is None:
            self._grad(name)[...] += dw

    def _kept(self, a: dict) -> dict:
        """What a layer keeps for the backward under self.recompute."""
        if self.recompute == "full":
            return {"x": a["x"]}
        return {k: v for k, v in a.items() if k != "out" and k not in RECOMPUTED[self.recompute]}

    def _restored(self, i: int, a: dict, rope) -> dict:
        """A layer's kept activations with the recomputed ones back: the same functions on the same
        inputs, so the same bits."""
        if self.recompute == "full":
            return self._layer_forward(i, a["x"], rope)
        if self.recompute == "partial":
            c, p, pre = self.config, self.p, f"layers.{i}."
            a = a | {"ln1": rmsnorm_forward(a["x"], p[pre + "attention_norm.weight"], c.norm_eps)[0],
                     "ln2": rmsnorm_forward(a["h"], p[pre + "ffn_norm.weight"], c.norm_eps)[0],
                     "ffn": swiglu_forward(a["gate_up"])}
        return a

    def forward(self, tokens: np.ndarray, targets: np.ndarray | None = None) -> float | None:
        """Run the model on (B, T) tokens. With targets, returns the mean cross-entropy loss over the counted
        targets (those >= 0; 0 if none is) and keeps dlogits for backward(); the logits are kept either way
        (read_logits)."""
        max_b, max_t = self.batch or (None, self.config.max_seq_len)
        check_batch(tokens, targets, self.config.vocab_size, max_b, max_t)
        c, p, L = self.config, self.p, self.layout
        B, T = tokens.shape
        self.acts = None  # the last forward's activations go before this one's are made
        self.doc_ids = None if self.doc_mask_bos is None else document_ids(tokens, self.doc_mask_bos)
        rope = rope_cos_sin(c, T)  # for this batch's length only: max_seq_len may be 2^31
        x = embedding_forward(tokens, p["tok_embeddings.weight"]).astype(self.dtype)
        layers = []
        for i in range(c.n_layers):
            a = self._layer_forward(i, x, rope)
            x = a["out"]
            layers.append(self._kept(a))
        lnf, rstdf = rmsnorm_forward(x, p["norm.weight"], c.norm_eps)
        logits = matmul_forward(lnf, self._matrix(self.params, L.output())).reshape(B * T, -1)
        self.acts = {"tokens": tokens, "rope": rope, "layers": layers, "x": x, "lnf": lnf, "rstdf": rstdf,
                     "logits": logits}
        if targets is None:
            return None
        counted = counted_targets(targets)
        losses, self.acts["dlogits"] = fused_classifier(logits, targets.ravel(), 1.0 / max(counted, 1))
        self.acts["losses"] = losses.reshape(B, T)
        return mean_counted_loss(losses, counted)

    def token_losses(self) -> np.ndarray:
        """(B, T) cross-entropy of each target of the last forward with targets."""
        if self.acts is None or "losses" not in self.acts:
            raise RuntimeError("token_losses() needs a forward() with targets first")
        return self.acts["losses"].astype(np.float32)

    def read_logits(self, position: int | np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """(B, T, V) logits of the last forward, or (len(rows), V) at one position of each of the rows (default
        all B): an int, or one per row."""
        logits = self.acts["logits"].reshape(*self.acts["tokens"].shape, -1)
        if position is None:
            return logits
        rows = np.arange(logits.shape[0]) if rows is None else np.asarray(rows)
        return logits[rows, np.broadcast_to(position, rows.shape)]

    def zero_grad(self) -> None:
        if self.grads is not None:
            self.grads[:] = 0

    def backward(self, loss_scale: float = 1.0) -> None:
        """Add the gradient of loss_scale * (mean loss of the last forward) into self.grads."""
        if self.acts is None or "dlogits" not in self.acts:
            raise RuntimeError("backward() needs a forward() with targets first")
        c, p, L, acts = self.config, self.p, self.layout, self.acts
        tokens = acts["tokens"]
        B, T = tokens.shape
        dlogits = acts["dlogits"] * self.dtype.type(loss_scale)
        head = self._matrix(self.params, L.output())
        if self.adapters is None:
            dlnf, dw = matmul_backward(dlogits, acts["lnf"].reshape(B * T, -1), head)
            self._grad(L.output())[...] += dw
        else:
            dlnf = matmul_input_backward(dlogits, head)
        dx, dw = rmsnorm_backward(dlnf.reshape(B, T, -1), acts["x"], p["norm.weight"], acts["rstdf"])
        self._base_gradient("norm.weight", dw)
        self._gradients_final(self.groups[-1])
        for i in reversed(range(c.n_layers)):
            pre, a = f"layers.{i}.", self._restored(i, acts["layers"][i], acts["rope"])
            dgate_up = swiglu_backward(self._gemm_backward(dx, a, i, 3, "ffn"), a["gate_up"])
            dln2 = self._gemm_backward(dgate_up, a, i, 2, "ln2")
            dh, dw = rmsnorm_backward(dln2, a["h"], p[pre + "ffn_norm.weight"], a["rstd2"])
            self._base_gradient(pre + "ffn_norm.weight", dw)
            dx = dx + dh
            dq, dk, dv = self._attention_backward(self._gemm_backward(dx, a, i, 1, "att"), a)
            dln1 = self._gemm_backward(rope_backward(dq, dk, dv, *acts["rope"]), a, i, 0, "ln1")
            dxn, dw = rmsnorm_backward(dln1, a["x"], p[pre + "attention_norm.weight"], a["rstd1"])
            self._base_gradient(pre + "attention_norm.weight", dw)
            dx = dx + dxn
            self._gradients_final(self.groups[i + 1])
        if self.adapters is None:
            self._grad("tok_embeddings.weight")[...] += embedding_backward(dx, tokens, c.vocab_size)
        self._gradients_final(self.groups[0])

    def _attention_backward(self, datt: np.ndarray, a: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The backward of _attention on a layer's activations a: dq, dk, dv."""
        if self.doc_ids is None:
            return attention_backward(datt, a["q"], a["k"], a["v"], a["att"], a["lse"])
        return document_attention_backward(datt, a["q"], a["k"], a["v"], a["att"], a["lse"], self.doc_ids)

    def _grad(self, tensor) -> np.ndarray:
        """Where a tensor's gradient accumulates (a Tensor of the layout, or its name): its view of the flat
        gradients, or with in_backward of its group's gradients, opened at the group's first use."""
        tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
        if not self.in_backward:
            return self._matrix(self.grads, tensor)
        start, end = next(group for group in self.groups if group[0] <= tensor.offset < group[1])
        if (start, end) not in self.open_groups:
            self.open_groups[(start, end)] = np.zeros(end - start, self.dtype)
        at = tensor.offset - start
        return self.open_groups[(start, end)][at:at + tensor.size].reshape(tensor.shape)

    def _gradients_final(self, group: tuple[int, int]) -> None:
        """With in_backward: the group's gradients are final; AdamW takes the whole blocks from the group's
        start to where the last update stopped, the rest of the group waits for the next one."""
        if not self.in_backward:
            return
        if self.update_settings is None:
            raise RuntimeError("with the optimizer in the backward, the backward runs inside train_step")
        start, _ = group
        grads, g = self.open_groups.pop(group), self.groups.index(group)
        self.step_norms[g] = squared_norm(grads)
        self.pending = np.concatenate([grads, self.pending])  # the gradients from start up to the frontier
        first = -(-start // QUANT_BLOCK) * QUANT_BLOCK if start else 0
        if first < self.frontier:
            lr, step, opt = self.update_settings
            scale = clip_scale(np.sqrt(clip_norm_estimate(self.step_norms, self._group_norms, g)), opt.grad_clip)
            done = slice(first, self.frontier)
            self.optimizer.update(self.params[done], self.pending[first - start:], self.decay_mask[done], step, lr,
                                  opt, grad_scale=scale, start=first)
            self.pending, self.frontier = self.pending[:first - start].copy(), first

    def train_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   upcoming: tuple | None = None, counted: float | None = None) -> tuple[float, float]:
        """Model.train_step (nothing to stage: upcoming is ignored); with in_backward one forward and a backward
        that updates the weights as it goes, each update clipped by the norm estimated from the groups' norms so
        far and the last step's."""
        if not self.in_backward:
            return super().train_step(batches, lr, step, opt, upcoming, counted)
        check_trains(self.plan)
        if len(batches) != 1:
            raise ValueError(f"optimizer-in-backward takes one micro-batch a step, got {len(batches)}")
        share = 1.0 if counted is None else step_share(batches[0][1], counted)
        loss = self.forward(*batches[0]) * share
        if not np.isfinite(loss):
            return loss, float("nan")
        self.update_settings, self.step_norms = (lr, step, opt), np.zeros(len(self.groups))
        self.pending, self.frontier = np.zeros(0, self.dtype), self.layout.size
        try:
            self.backward(loss_scale=share)
        finally:
            self.update_settings = None
        self._group_norms = self.step_norms
        return loss, float(np.sqrt(self._group_norms.sum()))

    @property
    def group_norms_squared(self) -> list[float] | None:
        """With in_backward, each group's squared norm of the last step (Model)."""
        return [float(x) for x in self._group_norms] if self.in_backward else None

    @group_norms_squared.setter
    def group_norms_squared(self, norms: list[float] | None) -> None:
        if self.in_backward:
            self._group_norms = np.zeros(len(self.groups)) if norms is None else np.array(norms, np.float64)

    def optimizer_step(self, lr: float, step: int, opt: AdamWConfig) -> float:
        """Clip by global norm and take one AdamW step (step counts from 1); returns the norm."""
        norm = global_norm(self.grads)
        self.optimizer.update(self.trainable, self.grads, self.decay_mask, step, lr, opt,
                              grad_scale=clip_scale(norm, opt.grad_clip))
        return norm

    # state for checkpoints (same method names on the GPU model): the trained weights, the adapters with lora
    def get_params(self) -> np.ndarray:
        return self.trainable.astype(np.float32, copy=True)

    def base_params(self) -> np.ndarray:
        """A float32 copy of the weights the block computes with: with adapters the frozen base (QLoRA's NF4 round
        trip), else the trained weights themselves."""
        return self.params.astype(np.float32, copy=True)

    def get_optimizer_state(self) -> tuple[np.ndarray, np.ndarray]:
        return self.optimizer.moments()

    def download_state(self, into: dict | None = None, wait: bool = True) -> dict[str, np.ndarray]:
        """Copies of the weights and of the moments as the optimizer holds them (fp32 'adam_m' and 'adam_v', or
        8-bit 'm_codes', 'm_scales', 'v_codes', 'v_scales', as on the GPU), in `into` (the last call's) if given;
        made at once, whatever wait says."""
        opt = self.optimizer
        moments = ({"m_codes": opt.m_codes, "m_scales": opt.m_scales, "v_codes": opt.v_codes, "v_scales": opt.v_scales}
                   if isinstance(opt, AdamW8bitState) else {"adam_m": opt.m, "adam_v": opt.v})
        state = {"params": self.trainable, **moments}
        into = into or {name: np.empty(a.shape, np.uint8 if a.dtype == np.uint8 else np.float32)
                        for name, a in state.items()}
        for name, array in state.items():
            into[name][:] = array
        return into

    def set_state(self, params: np.ndarray | None, adam_m=None, adam_v=None) -> None:
        """Weights (None: they stay) and moments from a checkpoint: float32 moments, 8-bit ones (Quantized) or
        None (zeros)."""
        if params is not None:
            self.trainable[:] = params
        self.optimizer.load(adam_m, adam_v)


# ----------------------------------------------------------------------------------------------
# Generation with a KV cache (the decoder interface of llama/model/generate.py)


def decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, p0: int) -> np.ndarray:
    """Causal grouped-query attention of new queries over a KV cache, the twin of decode_attention in
    kernels/decode.cu (llama/ops/decode.py). q (B, H, n, D) at positions p0 .. p0 + n - 1; k, v (B, KV, p0 + n, D), the
    cached positions 0 .. p0 + n - 1 -> (B, n, H * D). Query i sees keys 0 .. p0 + i."""
    B, H, n, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    q_stacked = q.reshape(B, KV, H // KV * n, D)  # the query heads that share one kv head
    scores = (q_stacked @ k.swapaxes(-1, -2)).reshape(B, H, n, L) * q.dtype.type(1 / np.sqrt(D))
    future = np.arange(L)[None, :] > p0 + np.arange(n)[:, None]
    scores = np.where(future, -np.inf, scores)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = (probs.reshape(B, KV, H // KV * n, L) @ v).reshape(B, H, n, D)
    return out.transpose(0, 2, 1, 3).reshape(B, n, H * D)


class ReferenceDecoder(ReferenceBlock, HostSampling):
    """The model on the CPU with a KV cache: the model's block (ReferenceBlock) on the new positions only,
    attending over the cache. params is a flat array in the parameter layout (a ReferenceModel's .params:
    shared, not copied), and adapters, when given, a flat array of adapter_layout (a ReferenceModel's, shared)."""
    fp8 = None  # the exact linear layers

    def __init__(self, config: LlamaConfig, params: np.ndarray, batch: int = 1, max_len: int | None = None,
                 adapter_layout: AdapterLayout | None = None, adapters: np.ndarray | None = None):
        self.config, self.batch = config, batch
        self.max_len = min(max_len or config.max_seq_len, config.max_seq_len)
        self.layout = ParameterLayout(config)
        if params.shape != (self.layout.size,):
            raise ValueError(f"params must be a flat array of {self.layout.size} values, got shape {params.shape}")
        self.params, self.dtype = params, params.dtype
        self.p = self.layout.views(params)
        if adapters is not None:
            self._attach_adapters(adapter_layout, adapters)
        self.rope_cos, self.rope_sin = rope_cos_sin(config, self.max_len)
        shape = (batch, config.n_kv_heads, self.max_len, config.head_dim)
        self.k_cache = [np.zeros(shape, self.dtype) for _ in range(config.n_layers)]
        self.v_cache = [np.zeros(shape, self.dtype) for _ in range(config.n_layers)]
        self.position = 0

    def reset(self) -> None:
        self.position = 0

    def _attention(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, None]:
        """The new positions' k, v into layer i's cache, then their queries over it (no lse: nothing runs
        backward)."""
        p0, n = self.position, q.shape[2]
        self.k_cache[i][:, :, p0:p0 + n] = k
        self.v_cache[i][:, :, p0:p0 + n] = v
        return decode_attention(q, self.k_cache[i][:, :, :p0 + n], self.v_cache[i][:, :, :p0 + n], p0), None

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        c, p = self.config, self.p
        tokens = np.asarray(tokens)
        B, n = tokens.shape
        p0 = self.position
        if B != self.batch or p0 + n > self.max_len:
            raise ValueError(f"tokens {tokens.shape} do not fit: batch {self.batch}, {p0} of {self.max_len} "
                             "positions used")
        x = embedding_forward(tokens, p["tok_embeddings.weight"]).astype(self.dtype)
        for i in range(c.n_layers):
            x = self._layer_forward(i, x, (self.rope_cos[p0:], self.rope_sin[p0:]))["out"]
        self.position += n
        lnf, _ = rmsnorm_forward(x[:, -1], p["norm.weight"], c.norm_eps)
        return matmul_forward(lnf, self._matrix(self.params, self.layout.output()))
