"""How much of the optimizer could hide under the next step's forward, measured before it is built.

One GPU, the bf16 (or FP8) model's captured graphs of one step: the micro-batch's forward and backward, and
the optimizer's (global norm, AdamW writing the new bf16 weights). Timed alone, one after the other as
train_step runs them, and launched together on two streams: of equal priority, and with the micro-batch's
stream at the device's greatest priority ("forward first": the optimizer's blocks take only what the
forward leaves). Together they race (the forward reads weights the optimizer is writing), so those lines are
timing only: they bound what an optimizer that updates the first layers first, under the next step's
forward, could save. The step's GEMMs hold all of a multiprocessor's
registers, so the optimizer's blocks run only where the forward's other kernels leave room.

    python3 scripts/bench_overlap.py [--runs llama3.2-1b:8:2048 d12:16:1024] [--dtype bf16|fp8] [--optimizer adamw8bit]
"""

from __future__ import annotations

import argparse
import ctypes
from types import SimpleNamespace

import numpy as np

from bench_step import CONFIGS, VOCAB, gpu_line, run_spec
from llama.runtime.cli import require
from llama.config import get_preset
from llama.runtime.cuda import check_driver, driver, runtime, time_ms
from llama.optim import AdamWConfig
from llama.options import RunOptions
from llama.run.plan import make_plan


def step_graphs(model):
    """The captured graphs of the model's only step shape: (the micro-batch's, the optimizer's)."""
    (micro_graphs, optimizer_graph), = model.step.graphs.values()
    micro_graph, = micro_graphs.values()
    return micro_graph, optimizer_graph


def stream_with_priority(priority: int | None) -> SimpleNamespace:
    """A new stream (blocking: it waits for the legacy default stream's timing events) with the device's least
    priority (None) or its greatest (-1), as llama.runtime.cuda.Runtime.launching_on takes it."""
    lib, least, greatest = driver(), ctypes.c_int(), ctypes.c_int()
    check_driver(lib.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
                 "cuCtxGetStreamPriorityRange")
    stream = ctypes.c_void_p()
    check_driver(lib.cuStreamCreateWithPriority(ctypes.byref(stream), 0, least if priority is None else greatest),
                 "cuStreamCreateWithPriority")
    return SimpleNamespace(handle=stream.value)


def overlap_times(name: str, B: int, T: int, dtype: str, optimizer: str, repeats: int) -> dict:
    """Device ms of the step's graphs: micro alone, optimizer alone, one after the other, together."""
    from llama.model.gpu_bf16 import GPUModelBF16
    c = get_preset(name).replace(vocab_size=VOCAB)
    model = GPUModelBF16(c, make_plan(c, RunOptions("cuda", dtype, None, optimizer)), (B, T))
    rng = np.random.default_rng(0)
    batch = [(rng.integers(0, c.vocab_size, (B, T)), rng.integers(0, c.vocab_size, (B, T)))]
    opt = AdamWConfig()
    for step in (1, 2):  # the first runs eagerly and captures the graphs, the second replays them
        model.train_step(batch, 1e-4, step, opt)
    micro, optimizer_graph = step_graphs(model)
    rt = runtime()
    least, greatest = stream_with_priority(None), stream_with_priority(-1)

    def in_order():
        micro.replay()
        optimizer_graph.replay()

    def together(first, second):  # both streams wait for the timing events on the legacy default stream
        def run():
            with rt.launching_on(first):
                micro.replay()
            with rt.launching_on(second):
                optimizer_graph.replay()
        return run

    runs = {"micro-batch": micro.replay, "optimizer": optimizer_graph.replay, "in order": in_order,
            "together": together(least, stream_with_priority(None)), "forward first": together(greatest, least)}
    times = {label: time_ms(fn, warmup=2, repeats=repeats, inner=1) for label, fn in runs.items()}
    del model
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", type=run_spec, default=[("llama3.2-1b", *CONFIGS["llama3.2-1b"])],
                        help="PRESET:B:T (default llama3.2-1b:8:2048)")
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default="adamw")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    require("scripts/bench_overlap.py", (), gpu=True)
    print(gpu_line())
    print(f"{'run':<24}{'micro ms':>10}{'opt ms':>8}{'in order':>10}{'together':>10}{'saved':>7}{'of opt':>8}"
          f"{'fwd first':>11}{'saved':>7}{'of opt':>8}")
    for name, B, T in args.runs:
        t = overlap_times(name, B, T, args.dtype, args.optimizer, args.repeats)
        line = f"{f'{name} B{B} T{T}':<24}{t['micro-batch']:>10.1f}{t['optimizer']:>8.1f}{t['in order']:>10.1f}"
        for label, width in (("together", 10), ("forward first", 11)):
            saved = t["in order"] - t[label]
            line += f"{t[label]:>{width}.1f}{saved:>7.1f}{saved / t['optimizer']:>8.0%}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
