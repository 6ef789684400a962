"""The bf16 model's training step (llama/model/base.py drives it: start_step, micro_step, finish_step) as
CUDA graphs, and its ZeRO optimizer.

The first step of a shape runs eagerly and captures, at its end, a graph per micro-batch role (forward and
backward; the first micro-batch of a step gathers the new weights, the last reduce-scatters the gradients)
and one of the optimizer, kept by the key (b, t, micro-batches, opt); later steps of that key replay them.
Tokens upload asynchronously from pinned memory, lr and the bias corrections live in device memory, the loss
accumulates on the device and is read once. eager_step runs the same launches without graphs.
The optimizer is ZeRO (llama/parallel/zero.py) on the reduced gradient shard: the global norm, AdamW (fp32
or 8-bit moments) on this rank's shard writing the new bf16 copy in the same pass, and the norms' new fp32
masters to every rank; the next forward all-gathers the new bf16 weights as it needs them."""

from __future__ import annotations

import numpy as np

from .. import ops
from ..runtime.cuda import DeviceArray, Graph
from ..optim import QUANT_BLOCK, AdamWConfig
from ..runtime.progress import phase
from .base import check_batch


CAPTURE = "capturing the step's CUDA graphs"  # a progress phase (llama/runtime/progress.py)

class CapturedStep:
    """Its user holds config, plan, B, T, zero, norm_weights, the device's norm_squared, norm_scratch,
    adam_scalars and loss_total, graphs ({} at first), and the launches _forward and _backward; PinnedInputs'
    methods (and its loss_scale, which the classifier reads with the plan's sft)."""

    def optimizer_step(self, lr: float, step: int, opt: AdamWConfig, return_norm: bool = True) -> float | None:
        """Clip by global norm and take one AdamW step (step counts from 1), updating the bf16 copy."""
        self.zero.finish_reduce()
        self._set_scalars(lr, step, opt)
        self._optimizer(opt)
        self.zero.stale = True
        return float(np.sqrt(self.norm_squared.download()[0])) if return_norm else None

    def _optimizer(self, opt: AdamWConfig) -> None:
        """ZeRO on the reduced gradient shard: the global norm, AdamW on this rank's shard, and the norms' new
        fp32 masters to every rank."""
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

        decay_mask = ops.decay_mask_range(z.decay_mask, start, n)

        if z.optimizer == "adamw8bit":
            ops.adamw8bit_update_bf16(shard(z.master), shard(z.weight_shard), grads, shard(z.m_codes), blocks(z.m_scales),
                                      shard(z.v_codes), blocks(z.v_scales), decay_mask, self.norm_squared,
                                      self.adam_scalars, z.maps, opt)
        else:
            ops.adamw_update_bf16(shard(z.master), shard(z.weight_shard), grads, shard(z.m), shard(z.v),
                                  decay_mask, self.norm_squared, self.adam_scalars, opt)

    def start_step(self, batches: list, opt: AdamWConfig) -> None:
        """The captured graphs of this step's shape when they exist (the first step of a shape runs
        eagerly and captures them at its end); the gradients and the loss zeroed; the loss scale of
        train_step's counted (--sft)."""
        micro, shapes = len(batches), {x.shape for x, _ in batches}
        key = (*batches[0][0].shape, micro, opt) if len(shapes) == 1 else None
        self.step_graphs, self.micro_index = (key, micro, self.graphs.get(key)), 0
        self._step_loss_scale(self.counted)
        self.zero_grad()
        self.loss_total.fill_zero()

    def micro_step(self, tokens: np.ndarray, targets: np.ndarray, micro: int, last: bool) -> None:
        check_batch(tokens, targets, self.config.vocab_size, self.B, self.T)
        self._upload(tokens, targets)
        self.shape, self.has_targets = tokens.shape, True
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
        loss, norm = self._loss_and_norm()
        if graphs is None and key is not None:  # everything is allocated and compiled now: a graph per role
            roles = {(i == 0, i == micro - 1) for i in range(micro)}  # (first, last) of the step's micro-batches
            with phase(CAPTURE):
                self.graphs[key] = ({role: Graph(lambda role=role: self._micro_step(micro, *role)) for role in roles},
                                    Graph(lambda: self._optimizer(opt)))
        self.zero.stale = True
        return loss, norm

    def _micro_step(self, micro: int, first: bool, last: bool) -> None:
        """Forward and backward of one micro-batch; the first one of a step gathers the new weights, the
        last one reduce-scatters the gradients (several GPUs; at ZeRO-2 and 3 every one does). Each weighs 1 / micro,
        or with sft 1 (the classifier's device scale divides by the step's counted targets)."""
        self.zero.begin(gather=first, first=first)
        weight = 1.0 if self.plan.sft else 1.0 / micro
        self._forward(weight, True, weight)
        self._backward(sync=last)
        self.zero.end(last)

    def _step_loss_scale(self, counted: float | None) -> None:
        """With the plan's sft, 1 / counted (0 when the step counts no target) as the classifier's device scale;
        a model planned for sft takes counted in every step, one planned without takes none."""
        if self.plan.sft != (counted is not None):
            raise ValueError(f"counted {counted}: a model planned with --sft takes each step's counted targets "
                             "(Model.train_step), one planned without takes none")
        if counted is not None:
            self._set_loss_scale(1.0 / counted if counted else 0.0)

    def _loss_and_norm(self) -> tuple[float, float]:
        """The step's mean loss and gradient norm, read from the device (a synchronization)."""
        return float(self.loss_total.download()[0]), float(np.sqrt(self.norm_squared.download()[0]))

    def eager_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   counted: float | None = None) -> tuple[float, float]:
        """train_step's launches run eagerly, neither replaying nor capturing a CUDA graph (e.g. to time each
        launch): (mean loss, grad norm), the same bits as train_step's."""
        self._step_loss_scale(counted)
        self.zero_grad()
        self.loss_total.fill_zero()
        for i, (tokens, targets) in enumerate(batches):
            check_batch(tokens, targets, self.config.vocab_size, self.B, self.T)
            self._upload(tokens, targets)
            self.shape, self.has_targets = tokens.shape, True
            self._micro_step(len(batches), i == 0, i == len(batches) - 1)
        self._set_scalars(lr, step, opt)
        self._optimizer(opt)
        self.zero.stale = True
        return self._loss_and_norm()
