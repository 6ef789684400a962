"""What both GPU models share: the flat weights, gradients and optimizer state (through Zero, which is
all of it on one GPU and a shard of it per rank on several), the RoPE tables on the device, and the
checkpoint state interface."""

from __future__ import annotations

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..cuda import DeviceArray, runtime, to_device, zeros
from ..params import ParameterLayout, model_parameters
from ..parallel.zero import Zero
from .base import Model, rope_cos_sin


class GPUModelBase(Model):
    def _setup(self, config: LlamaConfig, B: int, T: int, params: np.ndarray | None, seed: int, comm,
               weight_dtype, optimizer: str = "adamw", gradients: bool = True, stage: int = 1,
               reduce_dtype=np.float32) -> np.ndarray:
        """The shared part of a GPU model's __init__: activations are sized for batches of up to (B, T);
        weight_dtype is that of the weights the forward reads (fp32, or the bf16 copy); optimizer: the
        moments' format (llama/optim.py OPTIMIZER_STATES); gradients False: no full gradient buffer (the
        model keeps them a group at a time); stage: ZeRO's on several GPUs, reduce_dtype that of its gradients'
        reduce-scatter. Returns the starting flat fp32 params (params, or a fresh
        initialization from seed)."""
        if T > config.max_seq_len:
            raise ValueError(f"T={T} exceeds max_seq_len {config.max_seq_len}")
        self.config, self.B, self.T, self.comm = config, B, T, comm
        self.layout = ParameterLayout(config)
        params = model_parameters(self.layout, params, seed)
        # fp32 master weights, AdamW moments and the grads' shard: this rank's shard (all of it on one GPU)
        self.zero = Zero.for_model(self.layout, comm, params, weight_dtype, optimizer, gradients, stage, reduce_dtype)
        self.grads = self.zero.grads  # the whole flat gradients (stage 1; None at ZeRO-2 and 3, kept by bucket)
        cos, sin = rope_cos_sin(config, T)
        self.rope_cos, self.rope_sin = to_device(cos.astype(np.float32)), to_device(sin.astype(np.float32))
        self.shape, self.has_targets = None, False  # (b, t) of the last forward, and whether it had targets
        self.rms_out, self.rms_scratch = zeros(1), zeros(ops.NORM_BLOCKS + 1, np.float64)  # master_rms's sum
        return params

    def grad(self, tensor) -> DeviceArray:
        """Where a tensor's gradient accumulates (a Tensor of the layout or its name)."""
        tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
        return self.zero.grad(tensor.offset, tensor.shape)

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    # state for checkpoints: full arrays on rank 0, None elsewhere
    def get_params(self) -> np.ndarray | None:
        return self.zero.gather(self.zero.master)

    def get_optimizer_state(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        return self.zero.moments()

    def download_state(self, into: dict | None = None) -> dict[str, np.ndarray] | None:
        """The fp32 master weights ('params') and the optimizer state as the GPU holds it (fp32 'adam_m' and
        'adam_v', or 8-bit 'm_codes', 'v_codes', 'm_scales', 'v_scales'; padded), copied at the bus's speed
        into page-locked host arrays: `into`, what the last call returned, or new ones on the first call.
        None on several GPUs, whose state get_params and get_optimizer_state gather."""
        if self.comm is not None:
            return None
        z = self.zero
        moments = ({"m_codes": z.m_codes, "v_codes": z.v_codes, "m_scales": z.m_scales, "v_scales": z.v_scales}
                   if z.optimizer == "adamw8bit" else {"adam_m": z.m, "adam_v": z.v})
        buffers, drv = {"params": z.master, **moments}, runtime().drv
        into = into or {name: drv.pagelocked_empty(b.shape, b.dtype) for name, b in buffers.items()}
        for name, buffer in buffers.items():
            drv.memcpy_dtoh(into[name], buffer.ptr)
        return into

    def master_rms(self) -> float | None:
        """The RMS of the fp32 master weights, their squares summed on the device in a fixed order (so the
        checkpoint guard needs no pass over 32 GB of 8B weights on the host; not finite when a weight is not,
        or when the sum overflows fp32, past an RMS of 1e14); None on several GPUs, where each holds a shard."""
        if self.comm is not None:
            return None
        ops.global_norm_squared_bf16(self.rms_out, self.rms_scratch, self.zero.master.prefix(self.layout.size))
        return float(np.sqrt(np.float64(self.rms_out.download()[0]) / self.layout.size))

    def set_state(self, params: np.ndarray | None, adam_m=None, adam_v=None) -> None:
        """Weights (None: those the model was built from stay) and moments from a checkpoint: float32 moments,
        8-bit ones (Quantized) or None (zeros)."""
        if params is not None:
            self.zero.set_weights(params)
        self.zero.set_moments(adam_m, adam_v)
