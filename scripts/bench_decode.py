"""Generation speed on the GPU: prefill and decode tokens/s of the KV-cache decoder for model shapes
with random weights, at batch 1 and 8 (the logits are copied to the host every step, as when sampling).

    python scripts/bench_decode.py [--presets d12 llama3.2-1b] [--batches 1 8] [--prompt 128] [--steps 128]
                                   [--cache bf16] [--json out.json]

Decode reads every weight once per step, so its bound is (fp32 weight bytes) / (memory bandwidth);
the table shows the weight bytes read per second next to the speed.
"""

import argparse
import json
import time

import numpy as np

from llama.config import get_preset
from llama.cuda import BF16, runtime, to_device
from llama.model.gpu_decoder import GPUDecoder
from llama.params import ParameterLayout


def random_params(size: int) -> np.ndarray:
    """Small random weights without drawing billions of normals: one random block, repeated."""
    block = (0.02 * np.random.default_rng(0).standard_normal(1 << 20)).astype(np.float32)
    return np.resize(block, size)


def bench(preset: str, batch: int, prompt: int, steps: int, cache) -> dict:
    config = get_preset(preset)
    params = to_device(random_params(ParameterLayout(config).size))
    decoder = GPUDecoder(config, params, batch=batch, max_len=prompt + steps + 1, cache_dtype=cache)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, config.vocab_size, (batch, prompt))
    decoder.forward(tokens)  # warm-up: compiles the kernels
    decoder.reset()
    t0 = time.perf_counter()
    logits = decoder.forward(tokens)
    t1 = time.perf_counter()
    for _ in range(steps):
        logits = decoder.forward(np.argmax(logits, axis=-1)[:, None])
    t2 = time.perf_counter()
    weight_bytes = 4 * ParameterLayout(config).size
    return {"preset": preset, "batch": batch, "prompt": prompt, "steps": steps,
            "prefill_tok_s": batch * prompt / (t1 - t0), "decode_tok_s": batch * steps / (t2 - t1),
            "decode_ms_per_step": 1e3 * (t2 - t1) / steps, "weights_gb_s": weight_bytes * steps / (t2 - t1) / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["d12", "llama3.2-1b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=128, help="decode steps")
    p.add_argument("--cache", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    cache = BF16 if args.cache == "bf16" else np.float32
    print(f"{runtime().name}, {args.cache} KV cache, fp32 weights; prompt {args.prompt}, {args.steps} decode steps")
    print(f"{'preset':<14}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'ms/step':>9}{'weights GB/s':>14}")
    rows = []
    for preset in args.presets:
        for batch in args.batches:
            r = bench(preset, batch, args.prompt, args.steps, cache)
            rows.append(r)
            print(f"{preset:<14}{batch:>6}{r['prefill_tok_s']:>15,.0f}{r['decode_tok_s']:>14,.1f}"
                  f"{r['decode_ms_per_step']:>9.2f}{r['weights_gb_s']:>14,.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
