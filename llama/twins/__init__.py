"""Every layer's numpy twin, exact in float32 or float64: the oracle each CUDA kernel is tested against,
and the layers of the CPU model (llama/model/reference.py). One module per op, named like the kernel
in kernels/<op>.cu and its launcher in llama/ops/<op>.py, each layer a pair `<layer>_forward` /
`<layer>_backward` with the kernels' layouts, so the three can be read side by side. Functions compute
in the dtype of their inputs.

Layouts (B batch, T time, C dim, H query heads, KV key/value heads, D head_dim, F ffn hidden):
  residual stream (B, T, C); fused q|k|v projection (B, T, (H + 2*KV) * D);
  q (B, H, T, D) and k, v (B, KV, T, D), head-major; attention log-sum-exp (B, H, T) (the saved
  state: the backward recomputes the probabilities from it, as the flash attention kernels do);
  fused gate|up projection (B, T, 2F); logits (B*T, V).
Query head h reads key/value head h // (H // KV): the H // KV query heads of one kv head are
adjacent, so in the head-major layout they stack into one (H // KV * T, D) matrix per kv head.
Attention's words, here and in the kernels, launchers and GPU models: `out` its output (B, T, H * D),
kept in a model's activations as `att`; `probs` the softmax probabilities (B, H, T, T); `lse` the
log-sum-exp of each row of scaled scores. unpack_qkv/pack_qkv (rope) move between the packed projection
and head-major q, k, v; the merge_heads/split_heads kernels between (B, H, T, D) and (B, T, H * D).

embedding        embedding_forward/backward
residual         residual_forward
rmsnorm          rmsnorm_forward/backward, rmsnorm_residual_forward/backward (the add fused with the norm)
matmul           matmul_forward/backward (the linear layer, fp32 matmul and the bf16 GEMM), matmul_input_backward
                 (a frozen weight's: dx only)
fp8              quantize_fp8/dequantize_fp8 (the FP8 casts) and matmul_fp8_forward/backward
rope             rope_forward/backward, rotate_pairs, unpack_qkv/pack_qkv
attention        attention_forward/backward, attention_probabilities; document_attention_forward/backward
                 and document_ids (the document-masked attention, reference only so far)
flash_attention  flash_attention_forward/backward (on the packed projection, inverse RoPE fused)
swiglu           swiglu_forward/backward
classifier       fused_classifier (softmax cross-entropy and its gradient)
lora             lora_forward/backward (the adapter beside a frozen linear layer), adapter_forward/backward (the
                 adapter's part alone, beside the frozen product), lora_init (PEFT's)
nf4              quantize/dequantize: QLoRA's NF4 with double-quantized absmaxes, bitsandbytes' bits
The optimizer's and the grad norm's twins are llama/optim.py's.
"""
