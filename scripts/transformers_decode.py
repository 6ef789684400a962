"""The transformers side of scripts/bench_decode.py: LlamaForCausalLM of exactly our model's shape
(llama.io.hf.transformers_config, SDPA attention), random bf16 weights on the GPU, and its `generate`
timed greedily with a static KV cache, the forward compiled by torch.compile where that works (eager
otherwise; the result says which). bench_decode.py runs it as its own process per row (torch and PyCUDA
apart), and reads the JSON line it prints:

    python scripts/transformers_decode.py PRESET BATCH PROMPT STEPS
"""

import json
import sys
import time

import torch

from llama.config import get_preset
from llama.io.hf import transformers_config


def _generate(model, prompt, new_tokens: int) -> float:
    """Seconds of one greedy generate() of new_tokens ids (no early stop), synchronized."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, cache_implementation="static", eos_token_id=None,
                   pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def transformers_decode_speed(config, batch: int, prompt: int, steps: int, compile: bool = True) -> dict:
    """{prefill_tok_s, decode_tok_s, ttft_ms, decode_ms_per_step, mode} of transformers' generate on
    `batch` random prompts of `prompt` ids: TTFT is a generate() of one id, decode the rest of one of
    `steps` ids (median of 3 each, after warm-up calls that compile)."""
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(transformers_config(config, "sdpa")).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() == 2 else p.fill_(1.0)
    ids = torch.randint(0, config.vocab_size, (batch, prompt), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    mode = "eager"
    if compile:
        try:
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            for _ in range(2):
                _generate(model, ids, steps)
            mode = "compile"
        except Exception as e:  # noqa: BLE001  (a failed compile leaves the eager model to time)
            print(f"transformers: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); timing eager")
            model.forward = model.__class__.forward.__get__(model)
    with torch.no_grad():
        if mode == "eager":
            _generate(model, ids, steps)
        ttft = _median([_generate(model, ids, 1) for _ in range(3)])
        full = _median([_generate(model, ids, steps) for _ in range(3)])
    del model
    torch.cuda.empty_cache()
    return {"prefill_tok_s": batch * prompt / ttft, "decode_tok_s": batch * (steps - 1) / (full - ttft),
            "ttft_ms": 1e3 * ttft, "decode_ms_per_step": 1e3 * (full - ttft) / (steps - 1), "mode": mode}


if __name__ == "__main__":
    preset, batch, prompt, steps = sys.argv[1], *map(int, sys.argv[2:5])
    config = get_preset(preset).replace(max_seq_len=prompt + steps + 1)
    print(json.dumps(transformers_decode_speed(config, batch, prompt, steps)))
