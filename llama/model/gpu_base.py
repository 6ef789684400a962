"""What both GPU models share: the flat weights, gradients and optimizer state (through Zero, which is
all of it on one GPU and a shard of it per rank on several), the RoPE tables on the device, and the
checkpoint state interface."""

from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..runtime.cuda import BF16, DeviceArray, allocate, empty, runtime
from ..runtime.pinned import PinnedArrays
from ..params import ParameterLayout, model_parameters
from ..parallel.zero import Zero
from ..runtime.progress import phase
from .base import Model, rope_cos_sin
from .shapes import document_bounds, rope_tables

CU_STREAM_NON_BLOCKING = 1  # the driver's stream flag: no implicit synchronization with the legacy stream


class GPUModelBase(Model):
    def _setup(self, config: LlamaConfig, plan, batch: tuple[int, int], params: np.ndarray | None, seed: int, comm,
               weight_dtype, gradients: bool = True, trained=None) -> np.ndarray | None:
        """The shared part of a GPU model's __init__, from every model's arguments (llama/model/__init__.py):
        activations are sized for batches of up to batch (B, T); weight_dtype is that of the weights the forward
        reads (fp32, or the bf16 copy); gradients False: no full gradient buffer (the model keeps them a group at a
        time; so too when the plan has no optimizer: a model that only scores, with no moments either). From the
        plan: the moments' format (llama/optim.py OPTIMIZER_STATES), ZeRO's stage on several GPUs
        and its gradients' reduce-scatter dtype, the document mask's BOS (each forward then computes its batch's
        document bounds on the GPU: _document_bounds). params None: each GPU draws its part of a fresh
        initialization from seed (llama/ops/init.py; on several GPUs its shard of the master weights,
        Zero.fill_master). trained: the layout of what the optimizer trains when it is not the model's parameters
        (the adapters of --lora, llama/params.py AdapterLayout), params then theirs. Returns the starting flat fp32
        params: params checked, or None when drawn."""
        B, T = batch
        if T > config.max_seq_len:
            raise ValueError(f"T={T} exceeds max_seq_len {config.max_seq_len}")
        self.config, self.plan, self.B, self.T, self.comm = config, plan, B, T, comm
        self.doc_mask_bos = plan.doc_mask_bos
        if self.doc_mask_bos is not None:  # each token's document [start, end) in its row (ops.document_bounds)
            bounds = allocate(document_bounds(B, T))
            self.doc_start, self.doc_end = bounds["doc_start"], bounds["doc_end"]
        self.layout = ParameterLayout(config)
        self.trained = trained or self.layout  # what the optimizer (ZeRO) holds
        if trained is None and params is not None:
            params = model_parameters(self.layout, params, seed)
        reduce_dtype = BF16 if plan.reduce_dtype == "bf16" else np.float32
        # fp32 master weights, AdamW moments and the grads' shard: this rank's shard (all of it on one GPU)
        self.zero = Zero.for_model(self.trained, comm, params, weight_dtype, plan.optimizer,
                                   gradients and plan.optimizer is not None, plan.zero, reduce_dtype)
        if params is None:
            drawn = sum(end - start for _, start, end, _ in self.zero.layout.owned_flat(self.zero.rank))
            with phase("initializing the weights on the GPU", total=drawn, unit="param") as progress:
                self.zero.fill_master(
                    lambda out, start: ops.fill_parameters(out, self.layout, seed, start, progress.update))
        self.grads = self.zero.grads  # the whole flat gradients (stage 1; None at ZeRO-2 and 3, kept by bucket)
        tables = allocate(rope_tables(config, T))
        self.rope_cos, self.rope_sin = tables["rope_cos"], tables["rope_sin"]
        for table, values in zip((self.rope_cos, self.rope_sin), rope_cos_sin(config, T)):
            table.upload(values)
        self.shape, self.has_targets = None, False  # (b, t) of the last forward, and whether it had targets
        self.copy_stream = self.state_ready = None  # download_state's stream, and its start after the compute
        self.state_host = None  # download_state's page-locked host arrays (PinnedArrays), from reserve_state
        return params

    def _document_bounds(self, tokens: DeviceArray) -> None:
        """With the document mask, the document bounds of the (b, t) tokens on the device, from the uploaded
        tokens (in the forward: inside a captured graph, so a replay takes its batch's); nothing without."""
        if self.doc_mask_bos is not None:
            b, t = tokens.shape
            ops.document_bounds(self.doc_start.prefix(b, t), self.doc_end.prefix(b, t), tokens, self.doc_mask_bos)

    def _document_mask(self) -> dict:
        """The attention launchers' doc_start and doc_end keywords of the batch in flight (its shape self.shape),
        none without the document mask."""
        if self.doc_mask_bos is None:
            return {}
        b, t = self.shape
        return {"doc_start": self.doc_start.prefix(b, t), "doc_end": self.doc_end.prefix(b, t)}

    def grad(self, tensor) -> DeviceArray:
        """Where a tensor's gradient accumulates (a Tensor of the layout or its name)."""
        tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
        return self.zero.grad(tensor.offset, tensor.shape)

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    def set_weights_on_device(self, fill) -> None:
        """One GPU: fill(master) writes the flat fp32 params into the master weights (a DeviceArray of the
        layout's size), and the weights the forward reads follow."""
        self.zero.set_weights_on_device(fill)

    def weights_rms(self) -> float:
        """The root mean square of the fp32 master weights, summed on the device (one GPU: what the checkpoint
        guard judges, at the start and at each checkpoint, without a pass over the host copy)."""
        out, partial = empty(1), empty(ops.NORM_BLOCKS)
        ops.global_norm_squared(out, partial, self.zero.master.prefix(self.trained.size))
        return math.sqrt(float(out.download()[0]) / self.trained.size)

    # state for checkpoints: full arrays on rank 0, None elsewhere
    def get_params(self) -> np.ndarray | None:
        return self.zero.gather(self.zero.master)

    def get_optimizer_state(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        return self.zero.moments()

    def state_buffers(self) -> dict[str, DeviceArray]:
        """What a checkpoint holds of the state on the device: the fp32 master weights ('params') and the moments
        as the optimizer holds them (fp32 'adam_m' and 'adam_v', or 8-bit 'm_codes', 'v_codes', 'm_scales',
        'v_scales'), on one GPU, whose buffers have no padding."""
        z = self.zero
        moments = ({"m_codes": z.m_codes, "v_codes": z.v_codes, "m_scales": z.m_scales, "v_scales": z.v_scales}
                   if z.optimizer == "adamw8bit" else {"adam_m": z.m, "adam_v": z.v})
        return {"params": z.master, **moments}

    def reserve_state(self) -> None:
        """Start page-locking the host arrays of download_state in the background (one GPU; nothing on several,
        which gather their state instead), so that the first checkpoint finds them ready instead of pinning tens
        of GB while training waits."""
        if self.comm is None and self.state_host is None:
            self.state_host = PinnedArrays({name: (b.shape, b.dtype) for name, b in self.state_buffers().items()})

    def download_state(self, into: dict | None = None, wait: bool = True) -> dict[str, np.ndarray] | None:
        """state_buffers() copied at the bus's speed into page-locked host arrays: those of reserve_state (the same
        ones every call, so that `into`, the last call's, changes nothing), made now if it was not called, and
        waited for if they are not all pinned yet. None on several GPUs, whose state get_params and
        get_optimizer_state gather. The copies run on a stream of their own, after the work launched before; wait
        False returns at once, so that what the caller launches next runs beside them (it must not change the
        state: the guard's probe forward), and the arrays hold the state after wait_for_state()."""
        if self.comm is not None:
            return None
        drv = runtime().drv
        self.reserve_state()
        host = self.state_host.wait("the checkpoint's snapshot")
        if self.copy_stream is None:  # non-blocking: the legacy stream's copies (a loss read) do not wait for it
            self.copy_stream = drv.Stream(flags=CU_STREAM_NON_BLOCKING)
            self.state_ready = drv.Event(drv.event_flags.DISABLE_TIMING)
        self.state_ready.record(runtime().stream)
        self.copy_stream.wait_for_event(self.state_ready)
        for name, buffer in self.state_buffers().items():
            raw = host[name].reshape(-1).view(np.uint8)
            for start, end in self.state_host.pieces(name):  # each copy within one page-locked piece
                drv.memcpy_dtoh_async(raw[start:end], buffer.ptr + start, self.copy_stream)
        if wait:
            self.wait_for_state()
        return host

    def wait_for_state(self) -> None:
        """Wait for download_state's copies (before the state changes or its arrays are read)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def set_state(self, params: np.ndarray | None, adam_m=None, adam_v=None) -> None:
        """Weights (None: those the model was built from stay) and moments from a checkpoint: float32 moments,
        8-bit ones (Quantized) or None (zeros)."""
        if params is not None:
            self.zero.set_weights(params)
        self.zero.set_moments(adam_m, adam_v)
