"""The models: the numpy reference (the oracle and the CPU backend), the GPU models in fp32 and bf16, and the GPU
decoder.

Every model is built the same way, from the same facts:
    Model(config, plan, batch, params=None, seed=0, comm=None)
the config (llama/config.py), the plan (llama/run/plan.py, made by the caller: what runs where, the memory recipe,
the document mask's BOS, the SFT loss mask), the batch shape (B, T) the activations are sized for (the reference
takes any batch up to the config's max_seq_len when it is None), the flat fp32 parameters or None to draw them from
seed, and the NCCL communicator of a multi-GPU run (None on one process). build_model picks the class the plan says.
"""

from __future__ import annotations


def build_model(config, plan, batch: tuple[int, int] | None, params=None, seed: int = 0, comm=None):
    """The model the plan says runs: the numpy reference on the CPU, else the GPU model of the plan's dtype (bf16,
    fp8: the bf16 model with FP8 linear layers, fp32)."""
    if plan.device == "cpu":
        from .reference import ReferenceModel
        return ReferenceModel(config, plan, batch, params, seed, comm)
    if plan.dtype in ("bf16", "fp8"):
        from .gpu_bf16 import GPUModelBF16
        return GPUModelBF16(config, plan, batch, params, seed, comm)
    from .gpu_fp32 import GPUModelFP32
    return GPUModelFP32(config, plan, batch, params, seed, comm)
