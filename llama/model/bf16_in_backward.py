"""The bf16 model's optimizer in the backward (one GPU; the plan's in_backward): each group of weights (the
embedding table, each layer, the final norm and head, as the reference's) is updated as soon as the backward
finishes its gradients, which live in the embedding's buffer and one buffer the other groups use in turn.
Each update is clipped by the norm estimated from this step's group norms so far and the last step's
(ops.clip_norm_estimate), as the reference does; a step takes one micro-batch and is one captured CUDA graph,
kept by the key (b, t, "in backward", opt). Without the optimizer in the backward, the gradients of a finished
tensor onwards are reduce-scattered instead (ZeRO, several GPUs)."""

from __future__ import annotations

import numpy as np

from .. import ops
from ..runtime.cuda import DeviceArray, Graph, zeros
from ..optim import AdamWConfig
from ..runtime.progress import phase
from .base import check_batch
from .bf16_step import CAPTURE, CapturedStep


class OptimizerInBackward(CapturedStep):
    """Its user holds in_backward, layout and zero, and CapturedStep's (whose step it is without in_backward)."""

    def _allocate_groups(self) -> None:
        """The gradient groups, the embedding's gradients (a tied head adds to them in the forward) and one
        buffer that each other group uses in turn, and the groups' squared norms of this step and of the last."""
        self.groups = self.layout.gradient_groups()
        self.embedding_grads = zeros(self.groups[0][1])
        self.group_grads = zeros(max(end - start for start, end in self.groups[1:]))
        self.step_group_norms, self.group_norms = zeros(len(self.groups)), zeros(len(self.groups))

    def grad(self, tensor) -> DeviceArray:
        """Where a tensor's gradient accumulates (a Tensor of the layout or its name): its view of the flat
        gradients, or with the optimizer in the backward of its group's buffer."""
        if not self.in_backward:
            return super().grad(tensor)
        tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
        group = next(g for g, (start, end) in enumerate(self.groups) if start <= tensor.offset < end)
        buffer = self.embedding_grads if group == 0 else self.group_grads
        return buffer.view(tensor.offset - self.groups[group][0], tensor.shape)

    def zero_grad(self) -> None:
        if not self.in_backward:
            return super().zero_grad()
        self.embedding_grads.fill_zero()
        self.group_grads.fill_zero()

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

    def train_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   upcoming: tuple | None = None, counted: float | None = None) -> tuple[float, float]:
        """Model.train_step; with the optimizer in the backward one forward and a backward that updates
        each group of weights as soon as its gradients are final. The first step of a shape runs eagerly
        and captures."""
        if not self.in_backward:
            return super().train_step(batches, lr, step, opt, upcoming, counted)
        tokens, targets = self._one_batch(batches)
        self._step_loss_scale(counted)
        self._set_scalars(lr, step, opt)
        self._upload(tokens, targets)
        self.shape, key = tokens.shape, (*tokens.shape, "in backward", opt)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self._step_in_backward(opt)
        self._prepare(upcoming)
        loss, norm = self._loss_and_norm()
        if graph is None:
            with phase(CAPTURE):
                self.graphs[key] = Graph(lambda: self._step_in_backward(opt))
        return loss, norm

    def eager_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   counted: float | None = None) -> tuple[float, float]:
        """CapturedStep.eager_step; with the optimizer in the backward train_step's launches, uncaptured."""
        if not self.in_backward:
            return super().eager_step(batches, lr, step, opt, counted)
        tokens, targets = self._one_batch(batches)
        self._step_loss_scale(counted)
        self._set_scalars(lr, step, opt)
        self._upload(tokens, targets)
        self.shape, self.has_targets = tokens.shape, True
        self._step_in_backward(opt)
        return self._loss_and_norm()

    def _one_batch(self, batches: list) -> tuple:
        """The step's one micro-batch (tokens, targets), checked."""
        if len(batches) != 1:
            raise ValueError(f"optimizer-in-backward takes one micro-batch a step, got {len(batches)}")
        tokens, targets = batches[0]
        check_batch(tokens, targets, self.config.vocab_size, self.B, self.T)
        return tokens, targets

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
