"""What every model shares, whatever it runs on: the batch check, the RoPE tables, and the Model
interface the trainer drives, with the training step driven here, once, for every model.

A model (llama/model/reference.py, gpu_fp32.py, gpu_bf16.py) has:
  forward(tokens, targets=None)   the mean loss with targets (over the counted ones: a target < 0 is not
                                  counted, its loss and gradient 0); keeps what read_logits() needs without
  read_logits(position=None, rows=None)
                                  (b, t, V) logits of the last forward, or (len(rows), V) at one position of
                                  each of the rows (default all b; an int, or one per row)
  token_losses()                  (b, t) float32 cross-entropy of each target of the last forward with
                                  targets (what the mean loss averages; the evaluation's log-probs)
  train_step(batches, lr, step, opt, counted=None) -> (mean loss, grad norm), below
  get_params(), get_optimizer_state() -> (m, v), set_state(params, m, v): the state a checkpoint holds
  (full flat fp32 arrays; None on the ranks other than 0 of a multi-GPU run; set_state also takes 8-bit
  moments, llama/optim.py's Quantized, and params None, keeping the weights)
  group_norms_squared             with the optimizer in the backward, each gradient group's squared norm
                                  of the last step, from which the clipping norm is estimated (None
                                  otherwise; the trainer keeps it in checkpoints)
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from ..config import LlamaConfig
from ..optim import AdamWConfig

# ---- RoPE tables (Llama 3.1 scaling)


def apply_rope_scaling(freqs: np.ndarray, factor: float, low_freq_factor: float,
                       high_freq_factor: float, original_context: int) -> np.ndarray:
    """Llama 3.1's frequency scaling: keep high frequencies, divide low ones by `factor`,
    blend smoothly in between (Meta's apply_scaling)."""
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * np.pi / freqs
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    return np.where(wavelen < high_freq_wavelen, freqs,
                    np.where(wavelen > low_freq_wavelen, freqs / factor, blended))


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """(D/2,) rotation frequency of each pair (2i, 2i+1) of a head, float64."""
    d = config.head_dim
    freqs = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if config.use_scaled_rope:
        freqs = apply_rope_scaling(freqs, config.rope_scale_factor, config.rope_low_freq_factor,
                                   config.rope_high_freq_factor, config.rope_original_context)
    return freqs


def rope_cos_sin(config: LlamaConfig, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of t * freq for t < seq_len, each (seq_len, D/2), float64."""
    angles = np.outer(np.arange(seq_len, dtype=np.float64), rope_frequencies(config))
    return np.cos(angles), np.sin(angles)



# ---- the parts of a model


def weakly(method):
    """A bound method that does not keep its object alive: what a model's parts call back into the model with, so
    that a model is freed (its device memory with it) as soon as the last reference to it goes."""
    reference = weakref.WeakMethod(method)
    return lambda *args: reference()(*args)


# ---- the batch

def check_batch(tokens: np.ndarray, targets: np.ndarray | None, vocab_size: int, max_b: int | None,
                max_t: int) -> None:
    """A (b, t) batch of ids that fits the model (both backends check inputs with this); a target may be < 0,
    not counted in the loss."""
    if tokens.ndim != 2 or (max_b is not None and tokens.shape[0] > max_b) or tokens.shape[1] > max_t:
        limit = f"b <= {max_b}, t <= {max_t}" if max_b is not None else f"t <= max_seq_len {max_t}"
        raise ValueError(f"tokens must be (b, t) with {limit}; got shape {tokens.shape}")
    for name, ids in (("tokens", tokens), ("targets", targets)):
        if ids is None:
            continue
        if ids.shape != tokens.shape:
            raise ValueError(f"{name} shape {ids.shape} differs from tokens shape {tokens.shape}")
        if ids.size and (ids.max() >= vocab_size or (name == "tokens" and ids.min() < 0)):
            allowed = f"[0, {vocab_size})" if name == "tokens" else f"(-inf, {vocab_size}) (< 0: not counted)"
            raise ValueError(f"{name} hold ids outside {allowed}")


def counted_targets(targets: np.ndarray) -> int:
    """How many targets count in the loss: those >= 0."""
    return int(np.count_nonzero(targets >= 0))


def mean_counted_loss(losses: np.ndarray, counted: int) -> float:
    """The mean of per-target losses (0 where a target is not counted) over the counted targets; 0 when none is
    (when all are: np.mean's bits)."""
    return float(np.mean(losses, dtype=np.float64)) * (losses.size / counted) if counted else 0.0


def step_share(targets: np.ndarray, counted: float) -> float:
    """A micro-batch's weight in a step whose loss is divided by `counted`: its counted targets / counted (0 when
    the step counts none), so that its mean loss times this adds sum(its losses) / counted."""
    return counted_targets(targets) / counted if counted else 0.0



# ---- the training step


def check_trains(plan) -> None:
    """A model planned to score only (llama/run/plan.py evaluation_plan) has no gradients or optimizer to step."""
    if plan.optimizer is None:
        raise ValueError("this model only scores: its plan (evaluation_plan's) has no optimizer; a model that "
                         "trains is built from make_plan's")


class Model:
    """The training step every model takes: zero the gradients, a forward and backward per
    micro-batch, then clip, AdamW and read the loss and norm. The three parts below run eagerly (the
    reference and the fp32 GPU model); the bf16 GPU model replays them as captured CUDA graphs."""
    group_norms_squared: list[float] | None = None
    counted: float | None = None  # the loss divisor of the step being taken (train_step)

    def train_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   upcoming: tuple | None = None, counted: float | None = None) -> tuple[float, float]:
        """One optimizer step over the micro-batches [(tokens, targets), ...] (step counts from 1):
        (mean loss, grad norm). upcoming: the next step's first micro-batch, if known: the bf16 GPU model
        does its host work while this step runs, and skips it when the same arrays (unchanged) come back.
        counted None: the loss is the mean of the micro-batches' mean losses. Else (--sft, targets < 0 not
        counted) the loss divisor on this rank: the counted targets of the whole step over all ranks divided by
        the number of ranks (whose gradients are averaged); this rank's loss is the sum of its counted losses
        / counted, and the mean over ranks the mean over every counted target of the step, whatever the
        accumulation and the number of GPUs (0 when none is counted)."""
        check_trains(self.plan)
        self.counted = counted
        self.start_step(batches, opt)
        for i, (tokens, targets) in enumerate(batches):
            self.micro_step(tokens, targets, len(batches), last=i == len(batches) - 1)
        return self.finish_step(lr, step, opt, upcoming)

    def start_step(self, batches: list, opt: AdamWConfig) -> None:
        self.zero_grad()
        self.step_loss = 0.0

    def micro_step(self, tokens: np.ndarray, targets: np.ndarray, micro: int, last: bool) -> None:
        """Forward and backward of one of `micro` micro-batches, each weighted 1 / micro (with counted, by its
        share of the step's counted targets)."""
        if self.counted is None:
            self.step_loss += self.forward(tokens, targets) / micro
            self.backward(loss_scale=1.0 / micro)
            return
        share = step_share(targets, self.counted)
        self.step_loss += self.forward(tokens, targets) * share
        self.backward(loss_scale=share)

    def download_state(self, into: dict | None = None, wait: bool = True) -> dict[str, np.ndarray] | None:
        """A checkpoint's snapshot of the training state in host memory (page-locked on one GPU), the moments as
        the optimizer holds them; None where get_params and get_optimizer_state make the copies (several GPUs).
        wait False: the copies may still run until wait_for_state()."""
        return None

    def wait_for_state(self) -> None:
        """Wait for the copies of download_state(wait=False) (none run here)."""

    def finish_step(self, lr: float, step: int, opt: AdamWConfig, upcoming: tuple | None = None) -> tuple[float, float]:
        """Clip and AdamW; a non-finite loss skips the update and gives a NaN norm (upcoming: train_step's)."""
        norm = self.optimizer_step(lr, step, opt) if math.isfinite(self.step_loss) else float("nan")
        return self.step_loss, norm
