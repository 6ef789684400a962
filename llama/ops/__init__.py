"""Every kernel's Python launcher, one module per op for all its precisions: `from llama import ops; ops.gemm(...)`.
Each op is kernels/<op>.cu, its launchers here in llama/ops/<op>.py, its numpy twin in llama/twins/<op>.py and
its tests in tests/gpu/test_<op>.py. ops.gemm and ops.matmul are the launchers; their modules, which those names
hide, are importlib.import_module("llama.ops.gemm") and ("llama.ops.matmul"). Only the kernel versions the plan
(llama/run/plan.py) can pick are here; the ladders' other rungs, with their launchers, runners and tests, live in
dev/cuda (README.md there).

common           kernel loading, the kernels' constants read from their source, argument checks, grid sizes
embedding        the token embedding (fp32, bf16)
rmsnorm          RMSNorm (fp32; bf16 fused with the residual add)
matmul           the fp32 path's matmul and linear layer
gemm             the bf16 GEMM's front: checks, split-K, the versions the plan picks from (GEMM_VERSIONS)
gemm_problem     one GEMM as its versions receive it
gemm_mma         GEMM version 1 (mma.sync, from sm_80) and the split-K reduce
gemm_wgmma       GEMM versions 5 to 8 (Hopper: wgmma fed by TMA)
rope             the fp32 path's RoPE with the split into heads (the bf16 path rotates in the GEMM's epilogue)
attention        the fp32 path's attention (matmuls around a causal softmax)
document_mask    the document mask's bounds from the BOS tokens, the form the attention launchers take it in
flash_attention  bf16 causal GQA flash attention reading the packed qkv projection
swiglu           SwiGLU (fp32, bf16)
residual         the fp32 path's residual add
classifier       softmax cross-entropy with its gradient (fp32, bf16) and the loss sum
global_norm      the gradient norm (fp32, bf16) and the optimizer-in-backward's clip estimate
adamw            AdamW (fp32, bf16, 8-bit moments) and its decay mask, a bit per weight
convert          fp32 <-> bf16
fp8              --dtype fp8: float8 e4m3 casts with power-of-two scales per row or column, the FP8 GEMM
lora             --lora's updates beside a linear layer's GEMM (the stacked adapters)
nf4              --qlora's frozen base: NF4 quantization (bitsandbytes' codes) and dequantization into bf16
gemv             the decoder's skinny GEMMs (1-16 sequences) with fused epilogues, and their scratch
decode           the decoder's embedding, cache write, flash-decoding attention and step end
sample           token sampling on the GPU (greedy, temperature, top-k, top-p; seeded)
init             the parameters' random initialization on the GPU (Philox; its twin llama/twins/init.py)
"""
# flake8: noqa: F401  (the package re-exports every launcher)

from .adamw import (ADAMW_SCALARS, adamw8bit_update_bf16, adamw_scalars, adamw_update, adamw_update_bf16,
                    decay_mask_range, pack_decay_mask, packed_mask_size, quantization_maps)
from .attention import attention_backward, attention_forward
from .classifier import fused_classifier, fused_classifier_bf16, loss_accumulate_bf16
from .convert import round_to_bf16, widen_bf16
from .decode import (MAX_HEAD_DIM, advance, attention_scratch_size, cache_write, decode_attention,
                     embed_tokens, last_residual)
from .document_mask import document_bounds
from .embedding import (embedding_backward, embedding_backward_bf16, embedding_bf16_scratch_size, embedding_forward,
                        embedding_forward_bf16, sort_tokens, token_segments)
from .flash_attention import (FlashSource, flash_attention_backward, flash_attention_forward,
                              flash_attention_scratch_size)
from .fp8 import cast_fp8, gemm_fp8
from .gemm import gemm
from .gemv import DecodeScratch, StreamNorm, gemv_logits, gemv_qkv_rope, gemv_residual, gemv_swiglu
from .global_norm import NORM_BLOCKS, clip_norm_estimate, global_norm_squared, global_norm_squared_bf16
from .init import fill_parameters, init_normal, init_parameters_on_gpu
from .lora import lora_add_bf16, lora_block_diagonal_bf16, lora_take_blocks_f32
from .matmul import matmul, matmul_backward, matmul_forward
from .nf4 import nf4_dequantize_bf16, nf4_quantize, nf4_sizes, nf4_tables
from .residual import residual_forward
from .rmsnorm import (RMSNORM_PARTS, rmsnorm_backward, rmsnorm_backward_bf16, rmsnorm_bf16_scratch_size,
                      rmsnorm_forward, rmsnorm_forward_bf16, rmsnorm_residual_forward_bf16)
from .rope import rope_backward, rope_forward
from .sample import sample_tokens
from .swiglu import swiglu_backward, swiglu_backward_bf16, swiglu_forward, swiglu_forward_bf16
