"""Every kernel's Python launcher, by family: `from llama import ops; ops.gemm(...)`.

common           kernel loading, argument checks, grid sizes (what every launcher shares)
fp32             the exact fp32 path's layers, named like llama/model/reference.py's
bf16             the bf16 mixed-precision path's layers, the tensor-core GEMM among them
gemm_problem     one GEMM as its versions receive it
gemm_mma         GEMM version 1 (mma.sync, from sm_80) and the split-K reduce
gemm_wgmma       GEMM versions 2 to 8 (Hopper: wgmma fed by TMA)
flash_attention  bf16 causal GQA flash attention reading the packed qkv projection
fp8              --dtype fp8: float8 e4m3 casts with power-of-two scales per row or column, the FP8 GEMM
gemv             the decoder's skinny GEMMs (1-16 sequences) with fused epilogues, and their scratch
decode           the decoder's embedding, cache write, flash-decoding attention and step end
sample           token sampling on the GPU (greedy, temperature, top-k, top-p; seeded)
init             the parameters' random initialization on the GPU (Philox, llama/params.py's twin)
"""
# flake8: noqa: F401  (the package re-exports every launcher)

from .bf16 import (ADAMW_SCALARS, adamw8bit_update_bf16, adamw_scalars, adamw_update_bf16, clip_norm_estimate,
                   embedding_backward_bf16,
                   embedding_bf16_scratch_size, embedding_forward_bf16, fused_classifier_bf16, gemm, global_norm_squared_bf16,
                   loss_accumulate_bf16, rmsnorm_backward_bf16, rmsnorm_bf16_scratch_size, rmsnorm_forward_bf16,
                   quantization_maps, rmsnorm_residual_forward_bf16, round_to_bf16, swiglu_backward_bf16,
                   swiglu_forward_bf16, token_segments, widen_bf16)
from .common import NORM_BLOCKS
from .decode import (MAX_HEAD_DIM, advance, attention_scratch_size, cache_write, decode_attention,
                     embed_tokens, last_residual)
from .flash_attention import (FlashAttentionProblem, FlashSource, flash_attention_backward,
                              flash_attention_backward_atomic_dq, flash_attention_forward,
                              flash_attention_scratch_size)
from .fp8 import cast_fp8, gemm_fp8
from .fp32 import (RMSNORM_PARTS, adamw_update, attention_backward, attention_forward, embedding_backward,
                   embedding_forward, fused_classifier, global_norm_squared, matmul, matmul_backward, matmul_forward,
                   residual_forward, rmsnorm_backward, rmsnorm_forward, rope_backward, rope_forward, sort_tokens,
                   swiglu_backward, swiglu_forward)
from .init import fill_parameters, init_normal, init_parameters_on_gpu
from .gemv import DecodeScratch, StreamNorm, gemv_logits, gemv_qkv_rope, gemv_residual, gemv_swiglu
from .sample import sample_tokens
