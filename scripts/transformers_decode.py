"""The PyTorch side of scripts/bench_decode.py: transformers' LlamaForCausalLM of exactly our model's shape
(llama.io.hf.transformers_config, SDPA attention, the head tied where the preset ties it), random bf16 weights
on the GPU, and its `generate` timed greedily with a static KV cache, the forward compiled as transformers
documents for static-cache generation where that works (eager otherwise; the result says which).
bench_decode.py runs it as a process of its own per row (torch and PyCUDA apart), which prints one JSON line:

    python3 scripts/transformers_decode.py PRESET BATCH PROMPT STEPS [--eager]

How the forward is compiled depends on the installed transformers. From 4.47 on, generate() compiles the
decode steps itself when the cache is static (generation_config.compile_config, a CompileConfig; the prefill
runs eager), and we set CompileConfig(fullgraph=True, mode="reduce-overhead"); eager there means
generation_config.disable_compile (4.49 on). Before 4.47 the documented recipe replaces the forward,
model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True), prefill included.
"""

import argparse
import gc
import json
import statistics
import sys
import time

from llama.config import LlamaConfig, get_preset
from llama.io.hf import hf_name, transformers_config
from llama.params import ParameterLayout, parameter_shapes

WARMUP = 2  # full generate() calls before timing: compilation and CUDA graph capture happen in these
TTFT_REPEATS = 5
FULL_REPEATS = 3


def _note(message: str) -> None:
    print(f"transformers_decode: {message}", file=sys.stderr, flush=True)


def _build_model(config: LlamaConfig):
    """LlamaForCausalLM of config's shape on the GPU: bf16 parameters drawn N(0, 0.02) (norms 1) from a
    seeded generator, as our training init; eval mode."""
    import torch
    import transformers

    hf_config = transformers_config(config, "sdpa")
    hf_config.bos_token_id = None  # no special ids: generation never stops early
    hf_config.eos_token_id = None
    hf_config.pad_token_id = 0
    hf_config.use_cache = True
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built straight in bf16 on the GPU (the RoPE buffer stays fp32)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default)
    head, table = model.lm_head, model.model.embed_tokens
    if config.tie_embeddings and head.weight is not table.weight:
        head.weight = table.weight
    with torch.no_grad():
        generator = torch.Generator(device="cuda").manual_seed(0)
        for p in model.parameters():  # each once: a tied head is the embedding table
            if p.dtype != torch.bfloat16:
                p.data = p.data.to(torch.bfloat16)
            p.normal_(0.0, 0.02, generator=generator) if p.dim() == 2 else p.fill_(1.0)
    _check_shape(model, config)
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "sdpa":
        _note(f"attention implementation is {attn!r}, not 'sdpa'")
    return model.eval()


def _check_shape(model, config: LlamaConfig) -> None:
    """Every tensor of ours is there under its HF name with our shape, and nothing else is."""
    named = dict(model.named_parameters(remove_duplicate=False))
    for name, shape in parameter_shapes(config):
        hf = hf_name(name)
        if hf not in named or tuple(named[hf].shape) != shape:
            found = tuple(named[hf].shape) if hf in named else "missing"
            raise RuntimeError(f"transformers model differs from ours at {hf}: {found}, ours {shape}")
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    total = sum(p.numel() for p in model.parameters())
    if tied != config.tie_embeddings or total != ParameterLayout(config).size:
        raise RuntimeError(f"transformers model has {total:,} parameters (head tied: {tied}), ours "
                           f"{ParameterLayout(config).size:,} (tied: {config.tie_embeddings})")


def _generation_config(auto_compile: bool, compile: bool):
    """Greedy, no special ids (no early stop), static KV cache; the compile options where generate has them."""
    import transformers
    from transformers import GenerationConfig

    kwargs = dict(do_sample=False, num_beams=1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                  cache_implementation="static", use_cache=True)
    if auto_compile:
        if compile:
            CompileConfig = getattr(transformers, "CompileConfig", None)
            if CompileConfig is None:
                from transformers.generation.configuration_utils import CompileConfig
            kwargs.update(compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"), disable_compile=False)
        else:
            kwargs.update(disable_compile=True)
    return GenerationConfig(**kwargs)


def _set_eager(model, auto_compile: bool) -> None:
    """Undo either compile path so that generate() runs the plain forward."""
    from transformers import GenerationConfig

    model.generation_config = _generation_config(auto_compile, False)
    if auto_compile:
        if "disable_compile" not in GenerationConfig().__dict__:  # 4.47, 4.48: no flag; generate compiles through
            model.get_compiled_call = lambda *args, **kwargs: model.__call__  # get_compiled_call, now the eager one
        model.__dict__.pop("_compiled_call", None)
    model.__dict__.pop("forward", None)  # the class's forward again, where the old recipe replaced it
    _reset_compiled()


def _generate(model, ids, mask, new_tokens: int) -> float:
    """Wall seconds of one generate() of exactly new_tokens ids per sequence, synchronized on both sides."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if tuple(out.shape) != (ids.shape[0], ids.shape[1] + new_tokens):
        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected "
                           f"{(ids.shape[0], ids.shape[1] + new_tokens)}")
    return seconds


def _warm_up(model, ids, mask, steps: int) -> None:
    for _ in range(WARMUP):
        _generate(model, ids, mask, steps)
    _generate(model, ids, mask, 1)


def _reset_compiled() -> None:
    import torch

    torch._dynamo.reset()
    try:  # the CUDA graphs' memory pools (reduce-overhead)
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees
        reset_cudagraph_trees()
    except Exception:  # noqa: BLE001  (private API: best effort)
        pass


def transformers_decode_speed(config: LlamaConfig, batch: int, prompt: int, steps: int, compile: bool = True) -> dict:
    """Speeds of transformers' generate on `batch` random prompts of `prompt` ids, greedy, static cache, bf16:
    {"prefill_tok_s", "decode_tok_s", "ttft_ms", "decode_ms_per_step", "mode"} with mode "compile" or "eager".

    After WARMUP generate() calls of `steps` new ids and one of 1 (compilation happens there), TTFT is the
    median wall time of generate(max_new_tokens=1) over TTFT_REPEATS calls and `full` the median of
    generate(max_new_tokens=steps) over FULL_REPEATS calls, each between torch.cuda.synchronize() calls;
    prefill tok/s = batch * prompt / TTFT, decode tok/s = batch * (steps - 1) / (full - TTFT)."""
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (decode speed is the steps after the first), got {steps}")
    import torch  # here, so that --help works without torch
    import transformers

    _reset_compiled()  # a fresh compile cache per model: several presets and batches run in one process
    model = None
    try:
        model = _build_model(config)
        auto_compile = hasattr(model, "get_compiled_call")  # transformers >= 4.47: generate compiles itself
        ids = torch.randint(0, config.vocab_size, (batch, prompt), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(1))
        mask = torch.ones_like(ids)
        mode = "eager"
        if compile:
            try:
                model.generation_config = _generation_config(auto_compile, True)
                if not auto_compile:
                    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                _warm_up(model, ids, mask, steps)
                if auto_compile and not hasattr(model, "_compiled_call"):
                    raise RuntimeError(f"transformers {transformers.__version__}'s generate did not compile the "
                                       "forward (its auto-compile criteria were not met)")
                mode = "compile"
            except Exception as e:  # noqa: BLE001  (a failed compile leaves the eager model to time)
                first = (str(e).strip().splitlines() or [""])[0][:300]
                _note(f"torch.compile failed ({type(e).__name__}: {first}); timing eager")
        if mode == "eager":
            _set_eager(model, auto_compile)
            _warm_up(model, ids, mask, steps)
        with torch.no_grad():
            ttft = statistics.median(_generate(model, ids, mask, 1) for _ in range(TTFT_REPEATS))
            full = statistics.median(_generate(model, ids, mask, steps) for _ in range(FULL_REPEATS))
    finally:
        if model is not None:
            model.__dict__.pop("forward", None)  # the compiled forward holds the model: break the cycle
            del model
        gc.collect()
        _reset_compiled()
        gc.collect()
        torch.cuda.empty_cache()
    decode = full - ttft
    return {"prefill_tok_s": batch * prompt / ttft, "decode_tok_s": batch * (steps - 1) / decode,
            "ttft_ms": 1e3 * ttft, "decode_ms_per_step": 1e3 * decode / (steps - 1), "mode": mode}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("preset")
    p.add_argument("batch", type=int)
    p.add_argument("prompt", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("--eager", action="store_true", help="do not compile")
    args = p.parse_args(argv)
    config = get_preset(args.preset)
    config = config.replace(max_seq_len=max(config.max_seq_len, args.prompt + args.steps + 1))
    print(json.dumps(transformers_decode_speed(config, args.batch, args.prompt, args.steps, not args.eager)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
