"""Generation speed on the GPU: our decoder (bf16 weights, bf16 KV cache, one CUDA graph per token, sampling
on the GPU) against transformers' generate on the same model shape, prompt and batch, in the same run.

    python3 scripts/bench_decode.py [--presets d12 llama3.2-1b] [--batches 1 8 16] [--prompt 128] [--steps 128]
                                   [--prefill-prompt 2048] [--no-transformers] [--json out.json]

Random weights (decode speed does not depend on them). Per row: time to first token (prefill of the
prompt and the first draw), prefill tokens/s, decode tokens/s and ms per step (greedy, ids read back once
per 32 steps), the bytes a decode step must read (every weight matrix in bf16 (the head, not the
embedding table, where untied), the norms, the KV cache at the mean length) per second, and that as a
fraction of the device's copy bandwidth (read + write of a 1 GiB device-to-device copy, measured here).
transformers runs bf16 with a static cache and torch.compile where it works (scripts/transformers_decode.py).
A last table gives prefill tokens/s at --prefill-prompt tokens, batch 1.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llama.runtime.cli import require
from llama.config import get_preset
from llama.runtime.cuda import DEPENDENT_LAUNCHES, empty, runtime, to_device
from llama.model.sampling import Sampling
from llama.model.gpu_decoder import GPUDecoder
from llama.options import RunOptions
from llama.run.plan import make_plan
from llama.params import ParameterLayout

BURST = 32  # decode steps between reads of the drawn ids


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second moved (read + write) by a device-to-device copy of nbytes, median of 10."""
    drv = runtime().drv
    src, dst = empty(nbytes // 4), empty(nbytes // 4)
    times = []
    for _ in range(12):
        start, end = drv.Event(), drv.Event()
        start.record(runtime().stream)
        drv.memcpy_dtod_async(dst.ptr, src.ptr, nbytes, runtime().stream)
        end.record(runtime().stream)
        end.synchronize()
        times.append(end.time_since(start) / 1e3)
    return 2 * nbytes / float(np.median(times[2:]))


def random_params(size: int) -> np.ndarray:
    """Small random weights without drawing billions of normals: one random block, repeated."""
    block = (0.02 * np.random.default_rng(0).standard_normal((1 << 20) + 7)).astype(np.float32)
    return np.resize(block, size)


def step_bytes(config, batch: int, context: float) -> float:
    """Bytes a decode step reads: the bf16 matrices it multiplies, the fp32 norms, the bf16 KV cache."""
    layout = ParameterLayout(config)
    matrices = sum(t.size for t in layout.tensors.values() if len(t.shape) == 2)
    if not config.tie_embeddings:  # the embedding table is read one row per sequence, the head whole
        matrices -= layout.tensors["tok_embeddings.weight"].size
    norms = sum(t.size for t in layout.tensors.values() if len(t.shape) == 1)
    cache = config.n_layers * 2 * batch * config.n_kv_heads * context * config.head_dim
    return 2 * matrices + 4 * norms + 2 * cache


def bench_ours(config, params, batch: int, prompt: int, steps: int) -> dict:
    plan = make_plan(config, RunOptions("cuda"))
    decoder = GPUDecoder(config, plan, params, batch=batch, max_len=prompt + steps + 1)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (batch, prompt))
    greedy = Sampling(temperature=0)
    for _ in range(2):  # warm-up: the kernels compile and the decode graph is captured
        decoder.reset()
        decoder.prefill(tokens, greedy)
        decoder.decode(2, greedy)
    ttft = []
    for _ in range(3):
        decoder.reset()
        runtime().synchronize()  # reset() remakes the bf16 weights on the GPU: not part of the first token
        t0 = time.perf_counter()
        decoder.prefill(tokens, greedy)  # returns the drawn ids: synchronized
        ttft.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for done in range(0, steps, BURST):
        decoder.decode(min(BURST, steps - done), greedy)
    seconds = time.perf_counter() - t0
    return {"ttft_ms": 1e3 * float(np.median(ttft)), "prefill_tok_s": batch * prompt / float(np.median(ttft)),
            "decode_tok_s": batch * steps / seconds, "decode_ms_per_step": 1e3 * seconds / steps}


def bench_prefill(config, params, prompt: int) -> float:
    """Prefill tokens/s of one sequence of `prompt` tokens (median of 9, after a warm-up)."""
    decoder = GPUDecoder(config, make_plan(config, RunOptions("cuda")), params, batch=1, max_len=prompt + 1)
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, (1, prompt))
    times = []
    for _ in range(10):
        decoder.reset()
        runtime().synchronize()
        t0 = time.perf_counter()
        decoder.prefill(tokens, Sampling(temperature=0))
        times.append(time.perf_counter() - t0)
    return prompt / float(np.median(times[1:]))


def transformers_row(preset: str, batch: int, prompt: int, steps: int) -> dict:
    """transformers' speeds from scripts/transformers_decode.py in a process of its own (torch and
    PyCUDA apart); {"mode": "failed ..."} when it fails."""
    script = Path(__file__).with_name("transformers_decode.py")
    done = subprocess.run([sys.executable, str(script), preset, str(batch), str(prompt), str(steps)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"mode": f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["d12", "llama3.2-1b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=128, help="decode steps")
    p.add_argument("--prefill-prompt", type=int, default=2048, help="prompt of the prefill table (0: none)")
    p.add_argument("--no-transformers", action="store_true", help="leave transformers' generate out")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--ordinary-launches", action="store_true",
                   help="launch the decode kernels one after another, not as programmatic dependents")
    args = p.parse_args(argv)
    require("scripts/bench_decode.py", gpu=True)
    DEPENDENT_LAUNCHES["on"] = not args.ordinary_launches
    copy = copy_bandwidth()
    print(f"{runtime().name}: device copy {copy / 1e9:,.0f} GB/s (read + write); prompt {args.prompt}, "
          f"{args.steps} greedy decode steps; bf16 weights and KV cache; "
          f"{'ordinary' if args.ordinary_launches else 'programmatic dependent'} launches")
    print(f"{'preset':<13}{'batch':>6}{'TTFT ms':>9}{'prefill tok/s':>15}{'decode tok/s':>14}{'ms/step':>9}"
          f"{'GB/s':>8}{'of copy':>9}{'HF tok/s':>10}{'HF TTFT':>9}{'x HF':>7}  HF mode")
    rows, prefill_rows = [], []
    for preset in args.presets:
        config = get_preset(preset).replace(max_seq_len=max(args.prompt + args.steps + 1, args.prefill_prompt + 1))
        params = to_device(random_params(ParameterLayout(config).size))
        for batch in args.batches:
            r = {"preset": preset, "batch": batch, "prompt": args.prompt, "steps": args.steps,
                 **bench_ours(config, params, batch, args.prompt, args.steps)}
            r["bytes_per_step"] = step_bytes(config, batch, args.prompt + args.steps / 2)
            r["gb_s"] = r["bytes_per_step"] / r["decode_ms_per_step"] / 1e6
            r["of_copy"] = r["gb_s"] * 1e9 / copy
            hf = ""
            if not args.no_transformers:
                r["transformers"] = t = transformers_row(preset, batch, args.prompt, args.steps)
                hf = (f"{t['decode_tok_s']:>10,.1f}{t['ttft_ms']:>9.1f}{r['decode_tok_s'] / t['decode_tok_s']:>7.2f}"
                      f"  {t['mode']}" if "decode_tok_s" in t else f"  {t['mode']}")
            rows.append(r)
            print(f"{preset:<13}{batch:>6}{r['ttft_ms']:>9.1f}{r['prefill_tok_s']:>15,.0f}{r['decode_tok_s']:>14,.1f}"
                  f"{r['decode_ms_per_step']:>9.3f}{r['gb_s']:>8,.0f}{r['of_copy']:>9.1%}{hf}", flush=True)
        if args.prefill_prompt:
            prefill_rows.append({"preset": preset, "prompt": args.prefill_prompt,
                                 "prefill_tok_s": bench_prefill(config, params, args.prefill_prompt)})
        del params
    for r in prefill_rows:
        print(f"prefill {r['preset']}, batch 1, prompt {r['prompt']}: {r['prefill_tok_s']:,.0f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": copy, "decode": rows, "prefill": prefill_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
