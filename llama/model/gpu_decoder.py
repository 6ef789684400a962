"""Generation on the GPU with a KV cache: the decoder interface of llama/generate.py on our kernels.

The weights are the fp32 master weights in a model's flat parameter buffer (GPUModel.params, or
any device array in the llama/params.py layout), read in place. Each forward step runs the
training kernels of llama/ops.py (embedding, RMSNorm, matmuls, SwiGLU, residual) on the new
positions only, and kernels/decode.cu for RoPE at the absolute positions with the cache write and
for attention over the cache. The caches, (B, KV, max_len, D) per layer and for k and v, are bf16
by default (fp32 on request). Prefill is the same step over the prompt, in chunks of `chunk`
positions; decode is a step of one position.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..cuda import BF16, DeviceArray, empty, to_device, zeros
from ..params import ParameterLayout
from .reference import rope_cos_sin

F32, I32 = ops.F32, ops.I32
CACHE_KERNELS = {F32: "f32", BF16: "bf16"}
ATTENTION_BLOCK = 256


def _cache_suffix(k_cache: DeviceArray, v_cache: DeviceArray) -> str:
    if k_cache.dtype not in CACHE_KERNELS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must both be float32 or bfloat16, got {k_cache.dtype} and {v_cache.dtype}")
    return CACHE_KERNELS[k_cache.dtype]


def rope_kv_write(q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, qkv: DeviceArray, cos: DeviceArray,
                  sin: DeviceArray, p0: int) -> None:
    """qkv (B, n, (H + 2KV) * D) -> q (B, H, n, D) rotated at positions p0.., and k (rotated), v
    written into the caches (B, KV, T_max, D) at p0 .. p0 + n - 1."""
    B, H, n, D = q.shape
    _check_cache(k_cache, v_cache, B, D)
    KV, T_max = k_cache.shape[1], k_cache.shape[2]
    ops._check("q", q, (B, H, n, D))
    ops._check("qkv", qkv, (B, n, (H + 2 * KV) * D))
    if not 0 <= p0 <= T_max - n or cos.shape[0] < p0 + n or cos.shape[1:] != (D // 2,) or sin.shape != cos.shape:
        raise ValueError(f"positions {p0}..{p0 + n - 1} do not fit the cache ({T_max}) or cos/sin {cos.shape}")
    suffix = _cache_suffix(k_cache, v_cache)
    ops._kernel("decode", f"rope_kv_write_{suffix}", "PPPPPPiiiiiii")(
        ops._blocks(qkv.size // 2), ops.BLOCK, q.ptr, k_cache.ptr, v_cache.ptr, qkv.ptr, cos.ptr, sin.ptr,
        B, n, H, KV, D, p0, T_max)


def decode_attention(out: DeviceArray, q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, p0: int) -> None:
    """out (B, n, H * D): query i of q (B, H, n, D), at position p0 + i, attends to cached keys 0 .. p0 + i."""
    B, H, n, D = q.shape
    _check_cache(k_cache, v_cache, B, D)
    KV, T_max = k_cache.shape[1], k_cache.shape[2]
    if KV == 0 or H % KV:
        raise ValueError(f"attention: {H} query heads cannot share {KV} kv heads")
    if D > ATTENTION_BLOCK or D % 2:
        raise ValueError(f"head_dim {D} must be even and at most {ATTENTION_BLOCK}")
    if not 0 <= p0 <= T_max - n:
        raise ValueError(f"positions {p0}..{p0 + n - 1} do not fit the cache ({T_max})")
    ops._check("out", out, (B, n, H * D))
    shared = 4 * (D + ATTENTION_BLOCK + ATTENTION_BLOCK // D * D)
    ops._kernel("decode", f"decode_attention_{_cache_suffix(k_cache, v_cache)}", "PPPPiiiiii")(
        (n, H, B), ATTENTION_BLOCK, out.ptr, q.ptr, k_cache.ptr, v_cache.ptr, n, H, KV, D, p0, T_max, shared=shared)


def last_positions(out: DeviceArray, x: DeviceArray) -> None:
    """out (B, C) = x (B, n, C)[:, n - 1]."""
    B, n, C = x.shape
    ops._check("out", out, (B, C))
    ops._kernel("decode", "last_positions", "PPiii")(ops._blocks(B * C), ops.BLOCK, out.ptr, x.ptr, B, n, C)


def _check_cache(k_cache: DeviceArray, v_cache: DeviceArray, B: int, D: int) -> None:
    if len(k_cache.shape) != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be (B={B}, KV, T_max, D={D}), got {k_cache.shape} and {v_cache.shape}")


class GPUDecoder:
    """The decoder interface of llama/generate.py with our kernels; see the module docstring."""

    def __init__(self, config: LlamaConfig, params: DeviceArray, batch: int = 1, max_len: int | None = None,
                 chunk: int = 256, cache_dtype=BF16):
        self.config, self.batch = config, batch
        self.max_len = min(max_len or config.max_seq_len, config.max_seq_len)
        self.layout = ParameterLayout(config)
        if not isinstance(params, DeviceArray) or params.dtype != F32 or params.size != self.layout.size:
            raise ValueError(f"params must be a float32 device array of {self.layout.size} values")
        self.params = params
        self.chunk = min(chunk, self.max_len)
        c, B = config, batch
        cache = (B, c.n_kv_heads, self.max_len, c.head_dim)
        self.k_cache = [zeros(cache, cache_dtype) for _ in range(c.n_layers)]
        self.v_cache = [zeros(cache, cache_dtype) for _ in range(c.n_layers)]
        cos, sin = rope_cos_sin(config, self.max_len)
        self.rope_cos, self.rope_sin = to_device(cos.astype(np.float32)), to_device(sin.astype(np.float32))
        self.buffers = {name: empty(shape) for name, shape in self._shapes(self.chunk).items()}
        self.tokens = empty(B * self.chunk, np.int32)
        self.position = 0

    def _shapes(self, n: int) -> dict:
        """Activation shapes of a step of n positions per sequence (allocated for n = chunk; a shorter
        step uses a prefix of each buffer)."""
        c, B = self.config, self.batch
        N, H, KV, D, F = B * n, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_hidden_dim
        return {"x": (N, c.dim), "ln": (N, c.dim), "rstd": (N,), "qkv": (N, (H + 2 * KV) * D), "q": (B, H, n, D),
                "att": (N, H * D), "h": (N, c.dim), "branch": (N, c.dim), "gate_up": (N, 2 * F), "ffn": (N, F),
                "last": (B, c.dim), "lnf": (B, c.dim), "rstdf": (B,), "logits": (B, c.vocab_size)}

    def reset(self) -> None:
        self.position = 0

    def _matrix(self, tensor) -> DeviceArray:
        return self.params.view(tensor.offset, tensor.shape)

    def _param(self, name: str) -> DeviceArray:
        return self._matrix(self.layout.tensors[name])

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens)
        B, n = tokens.shape
        if B != self.batch or n == 0 or self.position + n > self.max_len:
            raise ValueError(f"tokens {tokens.shape} do not fit: batch {self.batch}, {self.position} of "
                             f"{self.max_len} positions used")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"tokens hold ids outside [0, {self.config.vocab_size})")
        for start in range(0, n, self.chunk):
            self._step(tokens[:, start:start + self.chunk])
        s, c = self.buffers, self.config
        ops.rmsnorm_forward(s["lnf"], s["rstdf"], s["last"], self._param("norm.weight"), c.norm_eps)
        ops.matmul_forward(s["logits"], s["lnf"], self._matrix(self.layout.output()))
        return s["logits"].download()

    def _step(self, tokens: np.ndarray) -> None:
        """n <= chunk new positions through every layer; leaves their last hidden state in 'last'."""
        c, L, B, p0 = self.config, self.layout, self.batch, self.position
        n = tokens.shape[1]
        N, H, D = B * n, c.n_heads, c.head_dim
        s = {name: self.buffers[name].prefix(*shape) for name, shape in self._shapes(n).items()}
        tokens_d = self.tokens.prefix(N)
        tokens_d.upload(tokens.astype(np.int32).ravel())
        x = s["x"]
        ops.embedding_forward(x, tokens_d, self._param("tok_embeddings.weight"))
        for i in range(c.n_layers):
            pre = f"layers.{i}."
            ops.rmsnorm_forward(s["ln"], s["rstd"], x, self._param(pre + "attention_norm.weight"), c.norm_eps)
            ops.matmul_forward(s["qkv"], s["ln"], self._matrix(L.wqkv(i)))
            rope_kv_write(s["q"], self.k_cache[i], self.v_cache[i], s["qkv"].reshape(B, n, -1), self.rope_cos,
                          self.rope_sin, p0)
            decode_attention(s["att"].reshape(B, n, H * D), s["q"], self.k_cache[i], self.v_cache[i], p0)
            ops.matmul_forward(s["h"], s["att"], self._param(pre + "attention.wo.weight"))
            ops.residual_forward(s["h"], x, s["h"])
            ops.rmsnorm_forward(s["ln"], s["rstd"], s["h"], self._param(pre + "ffn_norm.weight"), c.norm_eps)
            ops.matmul_forward(s["gate_up"], s["ln"], self._matrix(L.w13(i)))
            ops.swiglu_forward(s["ffn"], s["gate_up"])
            ops.matmul_forward(s["branch"], s["ffn"], self._param(pre + "feed_forward.w2.weight"))
            ops.residual_forward(x, s["h"], s["branch"])
        last_positions(s["last"], x.reshape(B, n, c.dim))
        self.position += n
