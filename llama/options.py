"""Every option list of a run, in one dependency-free module: the command line offers these, the plan
(llama/plan.py) checks against them, the models and the optimizer accept them. Nothing here imports the
rest of the package, so any layer can read it.
"""

DEVICES = ("cuda", "cpu")
DTYPES = ("bf16", "fp8", "fp32")  # GPU precision: mixed bf16, bf16 with FP8 linear layers, the exact fp32 path
RECOMPUTE = ("none", "partial", "full")  # what the backward recomputes: nothing, the norms and SwiGLU, every layer
OPTIMIZERS = ("adamw", "adamw8bit")  # AdamW with fp32 moments, or 8-bit block-wise moments (llama/optim.py)
SCHEDULES = ("cosine", "linear", "constant", "wsd")  # the learning-rate schedules (llama/optim.py)
FP8_SCALINGS = ("row", "tensor")  # --dtype fp8: one scale per slice along K, or one per tensor
ZERO_STAGES = (1, 2, 3)  # ZeRO: the optimizer state sharded; and the gradients; and the weights
REDUCE_DTYPES = ("fp32", "bf16")  # several GPUs: the gradients' reduce-scatter
