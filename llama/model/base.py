"""What every model shares, whatever it runs on: the batch check, the RoPE tables, and the Model
interface the trainer drives, with the training step driven here, once, for every model.

A model (llama/model/reference.py, gpu_fp32.py, gpu_bf16.py) has:
  forward(tokens, targets=None)   the mean loss with targets; keeps what read_logits() needs without
  read_logits(position=None)      (b, t, V) logits of the last forward, or (b, V) at one position
  token_losses()                  (b, t) float32 cross-entropy of each target of the last forward with
                                  targets (what the mean loss averages; the evaluation's log-probs)
  train_step(batches, lr, step, opt) -> (mean loss, grad norm), below
  get_params(), get_optimizer_state() -> (m, v), set_state(params, m, v): the state a checkpoint holds
  (full flat fp32 arrays; None on the ranks other than 0 of a multi-GPU run; set_state also takes 8-bit
  moments, llama/optim.py's Quantized, and params None, keeping the weights)
  group_norms_squared             with the optimizer in the backward, each gradient group's squared norm
                                  of the last step, from which the clipping norm is estimated (None
                                  otherwise; the trainer keeps it in checkpoints)
"""

from __future__ import annotations

import math

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



# ---- the batch

def check_batch(tokens: np.ndarray, targets: np.ndarray | None, vocab_size: int, max_b: int | None,
                max_t: int) -> None:
    """A (b, t) batch of ids that fits the model (both backends check inputs with this)."""
    if tokens.ndim != 2 or (max_b is not None and tokens.shape[0] > max_b) or tokens.shape[1] > max_t:
        limit = f"b <= {max_b}, t <= {max_t}" if max_b is not None else f"t <= max_seq_len {max_t}"
        raise ValueError(f"tokens must be (b, t) with {limit}; got shape {tokens.shape}")
    for name, ids in (("tokens", tokens), ("targets", targets)):
        if ids is None:
            continue
        if ids.shape != tokens.shape:
            raise ValueError(f"{name} shape {ids.shape} differs from tokens shape {tokens.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{name} hold ids outside [0, {vocab_size})")



# ---- the training step


class Model:
    """The training step every model takes: zero the gradients, a forward and backward per
    micro-batch, then clip, AdamW and read the loss and norm. The three parts below run eagerly (the
    reference and the fp32 GPU model); the bf16 GPU model replays them as captured CUDA graphs."""
    group_norms_squared: list[float] | None = None

    def train_step(self, batches: list, lr: float, step: int, opt: AdamWConfig,
                   upcoming: tuple | None = None) -> tuple[float, float]:
        """One optimizer step over the micro-batches [(tokens, targets), ...] (step counts from 1):
        (mean loss, grad norm). upcoming: the next step's first micro-batch, if known: the bf16 GPU model
        does its host work while this step runs, and skips it when the same arrays (unchanged) come back."""
        self.start_step(batches, opt)
        for i, (tokens, targets) in enumerate(batches):
            self.micro_step(tokens, targets, len(batches), last=i == len(batches) - 1)
        return self.finish_step(lr, step, opt, upcoming)

    def start_step(self, batches: list, opt: AdamWConfig) -> None:
        self.zero_grad()
        self.step_loss = 0.0

    def micro_step(self, tokens: np.ndarray, targets: np.ndarray, micro: int, last: bool) -> None:
        """Forward and backward of one of `micro` micro-batches, each weighted 1 / micro."""
        self.step_loss += self.forward(tokens, targets) / micro
        self.backward(loss_scale=1.0 / micro)

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
