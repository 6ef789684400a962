"""The bf16 model's per-step inputs from the host, staged in pinned memory and copied in asynchronously in
stream order, so that a captured step reads them from fixed device buffers: the batch (tokens, targets, and
the token segments of the embedding's backward), in two pinned sets used in turn, the optimizer's lr and
bias corrections, and --sft's loss scale (1 / the step's counted targets). While a step runs, the host may
stage the next step's first micro-batch (prepare)."""

from __future__ import annotations

import numpy as np

from .. import ops
from ..runtime.cuda import allocate, runtime
from .shapes import step_inputs
from ..optim import AdamWConfig


class PinnedInputs:
    """The device's inputs of a step: `batch` (tokens, targets, order, segments: ops.token_segments), `scalars`
    (ops.ADAMW_SCALARS: lr and the bias corrections, which the AdamW kernels read) and `loss_scale` (1,), the
    classifier's scale under --sft."""

    def __init__(self, N: int):
        """Device buffers for batches of up to N tokens, two sets of pinned host buffers used in turn, the
        scalars' and the loss scale's pinned buffers, and an event per pinned buffer that says when its last copy
        has run."""
        shapes = step_inputs(N)
        self.scalars = allocate({"scalars": shapes.pop("scalars")}, zeroed=True)["scalars"]
        loss_scale = shapes.pop("loss_scale")
        self.batch = allocate(shapes)
        drv = runtime().drv
        self.pinned = [{k: drv.pagelocked_empty(a.shape, np.int32) for k, a in self.batch.items()} for _ in range(2)]
        self.pinned_scalars = drv.pagelocked_empty(ops.ADAMW_SCALARS, np.float32)
        self.loss_scale = allocate({"loss_scale": loss_scale}, zeroed=True)["loss_scale"]
        self.pinned_loss_scale = drv.pagelocked_empty(1, np.float32)
        self.pinned_free = [drv.Event() for _ in range(4)]  # one per input set, the scalars, the loss scale
        for event in self.pinned_free:
            event.record(runtime().stream)
        self.turn = 0
        self.staged = None  # the (tokens, targets) whose host work the pinned set of this turn holds already

    def upload(self, tokens: np.ndarray, targets: np.ndarray | None) -> None:
        """Stage the batch in pinned memory (unless prepare staged these very arrays) and copy it in
        asynchronously, in stream order."""
        if self.staged is None or self.staged[0] is not tokens or self.staged[1] is not targets:
            self._stage(tokens, targets)
        self.staged = None
        N, pinned = tokens.size, self.pinned[self.turn]
        for name in ["tokens"] + (["targets", "order", "segments"] if targets is not None else []):
            self.batch[name].prefix(*pinned[name][:N].shape).upload_async(pinned[name][:N])
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

    def prepare(self, upcoming: tuple | None) -> None:
        """While the step runs on the GPU: the host work of the next step's first micro-batch (tokens,
        targets), which the next upload of the same arrays skips (Model.train_step's upcoming)."""
        if upcoming is not None:
            self._stage(*upcoming)
            self.staged = upcoming

    def set_scalars(self, lr: float, step: int, opt: AdamWConfig) -> None:
        """lr and the bias corrections of this step into device memory, where the AdamW kernel reads them."""
        self.pinned_free[2].synchronize()
        self.pinned_scalars[:] = ops.adamw_scalars(step, lr, opt)
        self.scalars.upload_async(self.pinned_scalars)
        self.pinned_free[2].record(runtime().stream)

    def set_loss_scale(self, value: float) -> None:
        """The classifier's scale of each counted target's loss and gradient into device memory (--sft)."""
        self.pinned_free[3].synchronize()
        self.pinned_loss_scale[0] = value
        self.loss_scale.upload_async(self.pinned_loss_scale)
        self.pinned_free[3].record(runtime().stream)
