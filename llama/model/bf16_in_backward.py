"""The bf16 model's optimizer in the backward (one GPU; the plan's in_backward), a part of the model
(GPUModelBF16.step) as bf16_step.py's CapturedStep is without it: each group of weights (the embedding table,
each layer, the final norm and head, as the reference's) is updated as soon as the backward finishes its
gradients, which live in the embedding's buffer and one buffer the other groups use in turn. Each update is
clipped by the norm estimated from this step's group norms so far and the last step's (ops.clip_norm_estimate),
as the reference does; a step takes one micro-batch and is one captured CUDA graph, kept by the key
(b, t, "in backward", opt)."""

from __future__ import annotations

import weakref

import numpy as np

from .. import ops
from ..optim import AdamWConfig
from ..runtime.cuda import DeviceArray, Graph, allocate
from ..runtime.progress import phase
from .base import check_batch
from .bf16_step import CAPTURE, adamw, set_loss_scale
from .shapes import gradient_groups


class InBackwardStep:
    """The step of `model` (GPUModelBF16) with the optimizer in its backward, and the gradient groups' buffers."""

    def __init__(self, model):
        """The gradient groups, the embedding's gradients (a tied head adds to them in the forward) and one
        buffer that each other group uses in turn, and the groups' squared norms of this step and of the last."""
        self.model, self.layout = weakref.proxy(model), model.layout  # the model holds this part
        self.groups = self.layout.gradient_groups()
        buffers = allocate(gradient_groups(self.layout), zeroed=True)
        self.embedding_grads, self.group_grads = buffers["embedding_grads"], buffers["group_grads"]
        self.step_group_norms, self.group_norms = buffers["step_group_norms"], buffers["group_norms"]
        self.graphs = {}  # (b, t, "in backward", opt) -> the step's graph
        self.step_opt = None

    # ---- where the gradients are

    def grad(self, tensor) -> DeviceArray:
        """Where a tensor's gradient accumulates: its view of its group's buffer."""
        group = next(g for g, (start, end) in enumerate(self.groups) if start <= tensor.offset < end)
        buffer = self.embedding_grads if group == 0 else self.group_grads
        return buffer.view(tensor.offset - self.groups[group][0], tensor.shape)

    def zero_grad(self) -> None:
        self.embedding_grads.fill_zero()
        self.group_grads.fill_zero()

    def gradients_final(self, offset: int, sync: bool) -> None:
        """The group starting at this offset has its final gradients: update it."""
        self.update_group(next(g for g, (start, _) in enumerate(self.groups) if start == offset))

    def update_group(self, g: int) -> None:
        """AdamW on group g's weights from its final gradients: its squared norm into step_group_norms[g],
        clipped by the norm estimated from this step's and the last step's group norms (norm_squared), and
        the shared buffer zeroed for the group the backward does next."""
        m = self.model
        start, end = self.groups[g]
        grads = (self.embedding_grads if g == 0 else self.group_grads).prefix(end - start)
        ops.global_norm_squared_bf16(self.step_group_norms.view(g, (1,)), m.norm_scratch, grads)
        ops.clip_norm_estimate(m.norm_squared, self.step_group_norms, self.group_norms, g)
        adamw(m, start, grads, self.step_opt)
        if g > 1:
            self.group_grads.prefix(self.groups[g - 1][1] - self.groups[g - 1][0]).fill_zero()

    # ---- the step

    def train_step(self, batches: list, lr: float, step: int, opt: AdamWConfig, upcoming: tuple | None = None,
                   counted: float | None = None) -> tuple[float, float]:
        """Model.train_step: one forward and a backward that updates each group of weights as soon as its
        gradients are final. The first step of a shape runs eagerly and captures."""
        m = self.model
        tokens, targets = self.one_batch(batches)
        set_loss_scale(m, counted)
        m.inputs.set_scalars(lr, step, opt)
        m.inputs.upload(tokens, targets)
        m.shape, key = tokens.shape, (*tokens.shape, "in backward", opt)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self.run(opt)
        m.inputs.prepare(upcoming)
        loss, norm = m.loss_and_norm()
        if graph is None:
            with phase(CAPTURE):
                self.graphs[key] = Graph(lambda: self.run(opt))
        return loss, norm

    def eager_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   counted: float | None = None) -> tuple[float, float]:
        """train_step's launches, uncaptured."""
        m = self.model
        tokens, targets = self.one_batch(batches)
        set_loss_scale(m, counted)
        m.inputs.set_scalars(lr, step, opt)
        m.inputs.upload(tokens, targets)
        m.shape, m.has_targets = tokens.shape, True
        self.run(opt)
        return m.loss_and_norm()

    def optimizer_step(self, lr: float, step: int, opt: AdamWConfig, return_norm: bool = True) -> float | None:
        raise RuntimeError("with the optimizer in the backward the weights are updated inside train_step")

    def one_batch(self, batches: list) -> tuple:
        """The step's one micro-batch (tokens, targets), checked."""
        if len(batches) != 1:
            raise ValueError(f"optimizer-in-backward takes one micro-batch a step, got {len(batches)}")
        tokens, targets = batches[0]
        m = self.model
        check_batch(tokens, targets, m.config.vocab_size, m.B, m.T)
        return tokens, targets

    def run(self, opt: AdamWConfig) -> None:
        """The launches of one step with the optimizer in the backward (captured by train_step)."""
        m = self.model
        self.step_opt = opt
        self.zero_grad()
        m.loss_total.fill_zero()
        m.launch_forward(1.0, True, 1.0)
        m.launch_backward(sync=False)  # the last group's update leaves this step's squared norm in norm_squared
        self.group_norms.copy_from(self.step_group_norms)

    @property
    def group_norms_squared(self) -> list[float]:
        """Each gradient group's squared norm of the last step, from which the norm each update is clipped by is
        estimated; checkpoints keep it."""
        return [float(x) for x in self.group_norms.download()]

    @group_norms_squared.setter
    def group_norms_squared(self, norms: list[float] | None) -> None:
        self.group_norms.upload(np.zeros(len(self.groups), np.float32) if norms is None
                                else np.asarray(norms, np.float32))
