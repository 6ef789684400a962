"""Every kernel's Python launcher, by family: `from llama import ops; ops.gemm(...)`.

common           kernel loading, argument checks, grid sizes (what every launcher shares)
fp32             the exact fp32 path's layers, named like llama/model/reference.py's
bf16             the bf16 mixed-precision path's layers, the tensor-core GEMM among them
gemm_problem     one GEMM as its versions receive it
gemm_mma         GEMM version 1 (mma.sync, from sm_80) and the split-K reduce
gemm_wgmma       GEMM versions 2 and 3 (Hopper: wgmma fed by TMA)
flash_attention  bf16 causal GQA flash attention reading the packed qkv projection
decode           the KV-cache decoder's RoPE-and-cache-write and attention over the cache
"""
# flake8: noqa: F401  (the package re-exports every launcher)

from .bf16 import (ADAMW_SCALARS, adamw_scalars, adamw_update_bf16, embedding_backward_bf16,
                   embedding_bf16_scratch_size, embedding_forward_bf16, fused_classifier_bf16, gemm, global_norm_squared_bf16,
                   loss_accumulate_bf16, rmsnorm_backward_bf16, rmsnorm_bf16_scratch_size, rmsnorm_forward_bf16,
                   rmsnorm_residual_forward_bf16, swiglu_backward_bf16, swiglu_forward_bf16, token_segments)
from .common import NORM_BLOCKS
from .decode import decode_attention, last_positions, rope_kv_write
from .flash_attention import (FlashAttentionProblem, FlashSource, flash_attention_backward,
                              flash_attention_backward_atomic_dq, flash_attention_forward,
                              flash_attention_scratch_size)
from .fp32 import (RMSNORM_PARTS, adamw_update, attention_backward, attention_forward, embedding_backward,
                   embedding_forward, fused_classifier, global_norm_squared, matmul, matmul_backward, matmul_forward,
                   residual_forward, rmsnorm_backward, rmsnorm_forward, rope_backward, rope_forward, sort_tokens,
                   swiglu_backward, swiglu_forward)
