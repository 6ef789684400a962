"""RoPE's fp32 kernels (kernels/rope.cu, llama/ops/rope.py) against their float64 twins (llama/twins/rope.py)
at GQA ratios 1, 2, 4 and 8. The rotation in the GEMM epilogue: tests/gpu/test_gemm.py; in the decode GEMV:
tests/gpu/test_decode.py; the flash attention backward's inverse: tests/gpu/test_flash_attention.py."""

import numpy as np
import pytest

from llama import ops
from llama.config import get_preset
from llama.model.base import rope_cos_sin
from llama.twins.rope import rope_backward, rope_forward
from tests.gpu_helpers import check, dev, poisoned, randn

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)


GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # ratios 1, 2, 4, 8


@pytest.mark.parametrize("H, KV", GQA)
@pytest.mark.parametrize("B, T, D", [(1, 5, 8), (2, 33, 64)])
def test_rope(H, KV, B, T, D):
    config = get_preset("llama3.1-8b").replace(dim=H * D, n_heads=H, n_kv_heads=KV, rope_original_context=16)
    cos, sin = rope_cos_sin(config, T + 3)
    qkv = randn(rng, B, T, (H + 2 * KV) * D)
    q, k, v = poisoned((B, H, T, D)), poisoned((B, KV, T, D)), poisoned((B, KV, T, D))
    cos_d, sin_d = dev(cos), dev(sin)
    ops.rope_forward(q, k, v, dev(qkv), cos_d, sin_d)
    rq, rk, rv = rope_forward(qkv, cos, sin, H, KV)
    for name, got, want in (("q", q, rq), ("k", k, rk), ("v", v, rv)):
        check(f"rope_forward_{name}", got, want)
    dq, dk, dv = randn(rng, B, H, T, D), randn(rng, B, KV, T, D), randn(rng, B, KV, T, D)
    dqkv = poisoned((B, T, (H + 2 * KV) * D))
    ops.rope_backward(dqkv, dev(dq), dev(dk), dev(dv), cos_d, sin_d)
    check("rope_backward", dqkv, rope_backward(dq, dk, dv, cos, sin))
