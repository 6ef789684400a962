"""The PyTorch side of scripts/bench_step.py: our architecture written in PyTorch (RMSNorm, RoPE, SDPA
with GQA, SwiGLU, the head tied to the embedding where the preset ties it), and one training step of
it timed with bf16 autocast (or in fp32), fused AdamW (or torchao's AdamW8bit), global-norm clipping and
torch.compile, with activation checkpointing of every block as an option.
bench_step.py imports it once its arguments are parsed, so that --help works where torch is not
installed."""

import torch
import torch.nn.functional as F

from llama.runtime.cuda import time_ms
from llama.model.base import rope_cos_sin


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        D, H, KV = c.head_dim, c.n_heads, c.n_kv_heads
        self.attention_norm = torch.nn.Parameter(torch.ones(c.dim))
        self.wqkv = torch.nn.Linear(c.dim, (H + 2 * KV) * D, bias=False)
        self.wo = torch.nn.Linear(H * D, c.dim, bias=False)
        self.ffn_norm = torch.nn.Parameter(torch.ones(c.dim))
        self.w13 = torch.nn.Linear(c.dim, 2 * c.ffn_hidden_dim, bias=False)
        self.w2 = torch.nn.Linear(c.ffn_hidden_dim, c.dim, bias=False)

    def forward(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        D, H, KV = c.head_dim, c.n_heads, c.n_kv_heads
        qkv = self.wqkv(F.rms_norm(x, (c.dim,), self.attention_norm, c.norm_eps)).view(B, T, H + 2 * KV, D)
        q, k, v = qkv.split([H, KV, KV], dim=2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
        h = x + self.wo(y.transpose(1, 2).reshape(B, T, H * D))
        gate, up = self.w13(F.rms_norm(h, (c.dim,), self.ffn_norm, c.norm_eps)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)


def rope(x, cos, sin):
    """Meta's interleaved pairs: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos); cos, sin (T, D/2)."""
    x0, x1 = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).type_as(x)


class TorchLlama(torch.nn.Module):
    def __init__(self, c, T, checkpoint=False):
        """checkpoint: each block keeps its input only and runs again in the backward."""
        super().__init__()
        self.c, self.checkpoint = c, checkpoint
        self.tok_embeddings = torch.nn.Embedding(c.vocab_size, c.dim)
        self.layers = torch.nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = torch.nn.Parameter(torch.ones(c.dim))
        self.output = torch.nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:  # as Meta's Llama 3.2 and our presets: one (vocab, dim) matrix for both
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cos_sin(c, T)
        self.register_buffer("cos", torch.tensor(cos, dtype=torch.float32))
        self.register_buffer("sin", torch.tensor(sin, dtype=torch.float32))

    def forward(self, tokens, targets):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, self.cos, self.sin, use_reentrant=False)
            else:
                x = layer(x, self.cos, self.sin)
        logits = self.output(F.rms_norm(x, (self.c.dim,), self.norm, self.c.norm_eps))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def training_step(c, B, T, dtype="bf16", checkpoint=False, optimizer="adamw", float8=False):
    """(step, model): one training step of a fresh compiled model on a fixed random batch (see bench_torch)."""
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized on the GPU: an 8B model's host init would take minutes
        model = TorchLlama(c, T, checkpoint)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda module, name: name != "output")
    if optimizer == "adamw8bit":
        from torchao.optim import AdamW8bit
        opt = AdamW8bit(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    compiled = torch.compile(model)
    tokens = torch.randint(0, c.vocab_size, (B, T), device="cuda")
    targets = torch.randint(0, c.vocab_size, (B, T), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = compiled(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, model


def bench_torch(c, B, T, steps, dtype="bf16", checkpoint=False, optimizer="adamw", float8=False):
    """ms per step and peak allocated bytes; dtype 'bf16' (autocast over fp32 weights) or 'fp32';
    optimizer 'adamw' (fused) or 'adamw8bit' (torchao.optim.AdamW8bit, block-wise 8-bit moments); float8:
    the blocks' linear layers in torchao's float8 training with row-wise scales (the head stays bf16)."""
    step, model = training_step(c, B, T, dtype, checkpoint, optimizer, float8)
    for _ in range(3):  # compiles
        step()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step, warmup=0, repeats=steps, inner=1)
    peak = torch.cuda.max_memory_allocated()
    del step, model
    torch.cuda.empty_cache()
    return ms, peak
