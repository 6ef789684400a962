"""The bf16 model's training step with the optimizer after the backward (CapturedStep), as CUDA graphs, and its
ZeRO optimizer; the optimizer in the backward is bf16_in_backward.py's InBackwardStep. Either is a part of the
model (GPUModelBF16.step) that holds its own graphs and says where the gradients accumulate.

The first step of a shape runs eagerly and captures, at its end, a graph per micro-batch role (forward and
backward; the first micro-batch of a step gathers the new weights, the last reduce-scatters the gradients)
and one of the optimizer, kept by the key (b, t, micro-batches, opt); later steps of that key replay them.
Tokens upload asynchronously from pinned memory, lr and the bias corrections live in device memory, the loss
accumulates on the device and is read once. eager_step runs the same launches without graphs.
The optimizer is ZeRO (llama/parallel/zero.py) on the reduced gradient shard: the global norm, AdamW (fp32
or 8-bit moments) on this rank's shard writing the new bf16 copy in the same pass, and the norms' new fp32
masters to every rank; the next forward all-gathers the new bf16 weights as it needs them."""

from __future__ import annotations

import weakref

import numpy as np

from .. import ops
from ..optim import QUANT_BLOCK, AdamWConfig
from ..runtime.cuda import DeviceArray, Graph
from ..runtime.progress import phase
from .base import check_batch

CAPTURE = "capturing the step's CUDA graphs"  # a progress phase (llama/runtime/progress.py)


def adamw(model, start: int, grads: DeviceArray, opt: AdamWConfig) -> None:
    """AdamW, with the run's moments (fp32 or 8-bit), on the grads.size values of the model's shard from start,
    clipped by the norm whose square model.norm_squared holds; the new bf16 weights into the shard."""
    z, n = model.zero, grads.size

    def shard(a: DeviceArray) -> DeviceArray:
        return a.view(start, (n,))

    def blocks(a: DeviceArray) -> DeviceArray:  # one scale per QUANT_BLOCK values
        return a.view(start // QUANT_BLOCK, (-(-n // QUANT_BLOCK),))

    decay_mask = ops.decay_mask_range(z.decay_mask, start, n)
    scalars = model.inputs.scalars
    if z.optimizer == "adamw8bit":
        ops.adamw8bit_update_bf16(shard(z.master), shard(z.weight_shard), grads, shard(z.m_codes), blocks(z.m_scales),
                                  shard(z.v_codes), blocks(z.v_scales), decay_mask, model.norm_squared, scalars,
                                  z.maps, opt)
    else:
        ops.adamw_update_bf16(shard(z.master), shard(z.weight_shard), grads, shard(z.m), shard(z.v), decay_mask,
                              model.norm_squared, scalars, opt)


def set_loss_scale(model, counted: float | None) -> None:
    """With the plan's sft, 1 / counted (0 when the step counts no target) as the classifier's device scale; a model
    planned for sft takes counted (a step's loss divisor, Model.train_step) in every step, one planned without none."""
    if model.plan.sft != (counted is not None):
        raise ValueError(f"counted {counted}: a model planned with --sft takes each step's counted targets "
                         "(Model.train_step), one planned without takes none")
    if counted is not None:
        model.inputs.set_loss_scale(1.0 / counted if counted else 0.0)


class CapturedStep:
    """The step of `model` (GPUModelBF16): forward and backward per micro-batch, then the optimizer."""

    def __init__(self, model):
        self.model = weakref.proxy(model)  # the model holds this part
        self.graphs = {}  # (b, t, micro-batches, opt) -> ({(first, last): micro-batch graph}, optimizer graph)
        self.step_graphs, self.micro_index = None, 0

    # ---- where the gradients are

    def grad(self, tensor) -> DeviceArray:
        """Where a tensor's gradient accumulates: its view of the flat gradients (Zero)."""
        return self.model.zero.grad(tensor.offset, tensor.shape)

    def zero_grad(self) -> None:
        self.model.zero.zero_grad()

    def gradients_final(self, offset: int, sync: bool) -> None:
        """The gradients from this offset to the end of the flat buffer are final: reduce-scatter them (several
        GPUs; sync: the step's last micro-batch)."""
        self.model.zero.reduce_from(offset, last=sync)

    group_norms_squared = None  # only the optimizer in the backward estimates the norm from its groups'

    # ---- the step

    def train_step(self, batches: list, lr: float, step: int, opt: AdamWConfig, upcoming: tuple | None = None,
                   counted: float | None = None) -> tuple[float, float]:
        """Model.train_step: the step's graphs when this shape's exist (the first step of a shape runs eagerly and
        captures them at its end), a replay or eager run per micro-batch, the optimizer."""
        m = self.model
        micro, shapes = len(batches), {x.shape for x, _ in batches}
        key = (*batches[0][0].shape, micro, opt) if len(shapes) == 1 else None
        self.step_graphs, self.micro_index = (key, micro, self.graphs.get(key)), 0
        set_loss_scale(m, counted)
        self.zero_grad()
        m.loss_total.fill_zero()
        for i, (tokens, targets) in enumerate(batches):
            self.micro_step(tokens, targets, micro, last=i == micro - 1)
        return self.finish(lr, step, opt, upcoming)

    def micro_step(self, tokens: np.ndarray, targets: np.ndarray, micro: int, last: bool) -> None:
        m = self.model
        check_batch(tokens, targets, m.config.vocab_size, m.B, m.T)
        m.inputs.upload(tokens, targets)
        m.shape, m.has_targets = tokens.shape, True
        graphs, first = self.step_graphs[2], self.micro_index == 0
        if graphs is not None:
            graphs[0][first, last].replay()
        else:
            self.run_micro_batch(micro, first, last)
        self.micro_index += 1
        m.zero.stale = m.zero.stale and not first

    def finish(self, lr: float, step: int, opt: AdamWConfig, upcoming: tuple | None = None) -> tuple[float, float]:
        """The optimizer step, the next step's first micro-batch staged meanwhile, then the loss and norm read
        with one synchronization."""
        m = self.model
        key, micro, graphs = self.step_graphs
        m.inputs.set_scalars(lr, step, opt)
        if graphs is not None:
            graphs[1].replay()
        else:
            self.optimizer(opt)
        m.inputs.prepare(upcoming)
        loss, norm = m.loss_and_norm()
        if graphs is None and key is not None:  # everything is allocated and compiled now: a graph per role
            roles = {(i == 0, i == micro - 1) for i in range(micro)}  # (first, last) of the step's micro-batches
            with phase(CAPTURE):
                self.graphs[key] = ({role: Graph(lambda role=role: self.run_micro_batch(micro, *role))
                                     for role in roles}, Graph(lambda: self.optimizer(opt)))
        m.zero.stale = True
        return loss, norm

    def run_micro_batch(self, micro: int, first: bool, last: bool) -> None:
        """Forward and backward of one micro-batch; the first one of a step gathers the new weights, the
        last one reduce-scatters the gradients (several GPUs; at ZeRO-2 and 3 every one does). Each weighs 1 / micro,
        or with sft 1 (the classifier's device scale divides by the step's counted targets)."""
        m = self.model
        m.zero.begin(gather=first, first=first)
        weight = 1.0 if m.plan.sft else 1.0 / micro
        m.launch_forward(weight, True, weight)
        m.launch_backward(sync=last)
        m.zero.end(last)

    def optimizer(self, opt: AdamWConfig) -> None:
        """ZeRO on the reduced gradient shard: the global norm, AdamW on this rank's shard, and the norms' new
        fp32 masters to every rank."""
        m, z = self.model, self.model.zero
        ops.global_norm_squared_bf16(m.norm_squared, m.norm_scratch, z.grad_shard)
        z.sum_over_ranks(m.norm_squared)
        adamw(m, 0, z.grad_shard, opt)
        if m.norm_weights is not None:
            m.norm_weights.collect()
            z.sum_over_ranks(m.norm_weights.values)

    def optimizer_step(self, lr: float, step: int, opt: AdamWConfig, return_norm: bool = True) -> float | None:
        """After forward() and backward(): clip by global norm and take one AdamW step (step counts from 1)."""
        m = self.model
        m.zero.finish_reduce()
        m.inputs.set_scalars(lr, step, opt)
        self.optimizer(opt)
        m.zero.stale = True
        return float(np.sqrt(m.norm_squared.download()[0])) if return_norm else None

    def eager_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   counted: float | None = None) -> tuple[float, float]:
        """train_step's launches run eagerly, neither replaying nor capturing a CUDA graph (e.g. to time each
        launch): (mean loss, grad norm), the same bits as train_step's."""
        m = self.model
        set_loss_scale(m, counted)
        self.zero_grad()
        m.loss_total.fill_zero()
        for i, (tokens, targets) in enumerate(batches):
            check_batch(tokens, targets, m.config.vocab_size, m.B, m.T)
            m.inputs.upload(tokens, targets)
            m.shape, m.has_targets = tokens.shape, True
            self.run_micro_batch(len(batches), i == 0, i == len(batches) - 1)
        m.inputs.set_scalars(lr, step, opt)
        self.optimizer(opt)
        m.zero.stale = True
        return m.loss_and_norm()
