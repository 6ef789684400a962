"""The divergence guard: which weights may become a checkpoint, and when a run has diverged.

At each checkpoint the trainer shows the guard the weights and their loss on a fixed probe batch:
- weights or a probe loss that are not finite stop the run at once;
- weights whose RMS grew more than JUMP-fold since the last good checkpoint (or the start), or whose
  probe loss is far above the best of the good checkpoints so far (`loss_limit`), are bad: that
  checkpoint is not written and training goes on, since early training is noisy and a spike on the
  probe batch passes. BAD_IN_A_ROW bad checkpoints in a row stop the run;
- all other weights are good, and become the checkpoint.
Every written checkpoint is good, so all the guard carries over a resume is the best probe loss
(state.json's best_probe_loss) and the RMS of the checkpoint's weights (recomputed from them).
The guard is shown host weights, or their RMS measured elsewhere (on one GPU, on the device: the host's
pass over 32 GB of 8B weights stalled each checkpoint for seconds).
"""

from __future__ import annotations

import math

import numpy as np

JUMP = 10.0  # how many times the RMS of the weights may grow between good checkpoints
BAD_IN_A_ROW = 3  # bad checkpoints in a row that stop the run
SAVE, SKIP, STOP = "save", "skip", "stop"


def loss_limit(best: float) -> float:
    """The highest probe loss a good checkpoint may have: the best so far plus 1 nat or plus half of
    it, whichever is more. A run that diverged to garbage (near or above ln(vocab)) is far above."""
    return best + max(1.0, 0.5 * best)


def weights_rms(params: np.ndarray, chunk: int = 1 << 20) -> float:
    """The root mean square of the weights (not finite when a weight is not): float32 dot products of
    chunks (BLAS, at memory speed: 30x numpy's float64 conversion, which took minutes for 8B and stalled
    each checkpoint) summed in float64; a chunk whose float32 sum overflows is summed again in float64."""
    total = 0.0
    for i in range(0, params.size, chunk):
        part = params[i:i + chunk]
        with np.errstate(over="ignore"):
            square = float(np.dot(part, part))
        if not math.isfinite(square):
            wide = part.astype(np.float64)
            square = float(np.dot(wide, wide))
        total += square
    return math.sqrt(total / params.size)


def rms_of(weights: np.ndarray | float) -> float:
    """The RMS of host weights, or the RMS itself when the caller measured it."""
    return weights if isinstance(weights, float) else weights_rms(weights)


class CheckpointGuard:
    """Judges the weights of each checkpoint (rank 0 of a run): start_rms is weights_rms of the weights the
    run starts from, best_probe_loss the best of the good checkpoints before (None: none yet)."""

    def __init__(self, start_rms: float, best_probe_loss: float | None = None):
        self.rms, self.best, self.bad_in_a_row = start_rms, best_probe_loss, 0

    def judge(self, weights: np.ndarray | float, probe_loss: float) -> tuple[str, str | None]:
        """(SAVE, None), or (SKIP or STOP, why the weights (host weights or their RMS) are not good); a good
        verdict becomes the guard's new reference."""
        rms = rms_of(weights)
        if not math.isfinite(rms):
            return STOP, "the weights are not finite"
        if not math.isfinite(probe_loss):
            return STOP, f"the loss of the weights on the probe batch is {probe_loss}, not finite"
        why = self._why_bad(rms, probe_loss)
        if why is None:
            self.rms, self.bad_in_a_row = rms, 0
            self.best = probe_loss if self.best is None else min(self.best, probe_loss)
            return SAVE, None
        self.bad_in_a_row += 1
        if self.bad_in_a_row >= BAD_IN_A_ROW:
            return STOP, f"{self.bad_in_a_row} bad checkpoints in a row, the last one because {why}"
        return SKIP, why

    def _why_bad(self, rms: float, probe_loss: float) -> str | None:
        if rms > JUMP * self.rms:
            return (f"the weights jumped: their RMS grew from {self.rms:.4g} at the last good checkpoint (or the "
                    f"start) to {rms:.4g}, more than {JUMP:g}-fold")
        if self.best is not None and probe_loss > loss_limit(self.best):
            return (f"the loss of the weights on the probe batch, {probe_loss:.4f}, is far above the best so far, "
                    f"{self.best:.4f} (limit {loss_limit(self.best):.4f})")
        return None
