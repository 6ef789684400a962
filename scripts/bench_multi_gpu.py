"""The bf16 training step on 1 and N GPUs (data parallel, ZeRO stages 1-3 over NCCL): tok/s, scaling
efficiency, memory per GPU, and how much of the communication the step hides.

    python3 scripts/bench_multi_gpu.py [--gpus 1 2] [--zero 1 2 3] [--gemm static dynamic]
                                       [--configs d12 llama3.2-1b llama3.1-8b] [--steps 12] [--json out.json]
                                       [--trace DIR]

The driver starts one run per GPU count, stage and GEMM choice (this script with --worker, through llama.launch
when N > 1) with the same batch per GPU, so tokens per step grow with N; scaling efficiency = tok/s on N GPUs /
(N x tok/s of the one-GPU step with GEMM versions 5 and 6, the plan's there). Each run reports, from rank 0:
- ms per step: the median over timed steps of GPUModelBF16.train_step (CUDA graphs, one sync a step, the
  next step's first micro-batch staged meanwhile as the trainer does);
- memory per GPU: everything our allocations hold, and the optimizer state (fp32 master + AdamW moments).
  The 1-GPU figure is also what plain data parallelism without ZeRO holds per GPU (a full replica);
- on N > 1 GPUs, for each ZeRO stage, where the communication goes: the collectives timed alone (the
  reduce-scatter of every bucket; the all-gathers of a step: every bucket once at stages 1-2, at stage 3
  each layer's as the forward and the backward reach it), the same step with every collective skipped
  (the work without the communication; its numbers are wrong, its time is not) and with only the
  reduce-scatters skipped, and from them the exposed communication (step - step without collectives),
  the share hidden (1 - exposed / alone), that of the reduce-scatter alone (1 - (step - step without
  reduce-scatter) / reduce-scatter alone), and the share of the step spent waiting (exposed / step). At
  stage 3 the step without collectives reads weight slots nobody gathered, and its time is not a fair
  baseline either (docs/multi-gpu.md): its exposed, hidden and waiting columns print as -.
llama3.1-8b runs only on several GPUs at ZeRO-3, with the recipe that fits two 80 GB H100s (B1 x T8192 per GPU,
everything recomputed, 8-bit moments: 59.2 GiB of buffers a GPU, scripts/memory_plan.py), and prints its tok/s per
GPU (the target: torchtitan's 8B on 8 H100s, 6,667) and the collectives alone, not the steps without them (each
would build the model again: minutes on the host).
GEMMs: by default each GPU count runs the plan's versions (5 and 6 on one GPU; on several their twins 8 and 7,
which claim their tiles from a counter: GemmChooser(dynamic=True)); --gemm static dynamic runs both pairs on
every GPU count, a row each.
With --trace, every rank also writes the timeline of one eager step (CUDA events around every launcher and
collective on both streams, llama/runtime/timeline.py) to
DIR/<config>_<GPUs>gpus_zero<stage>_<gemm>_rank<rank>.json, in the Trace Event Format that chrome://tracing and
Perfetto open (load the ranks' files together), and the table is
followed, per run, by rank 0's communication with no compute beside it: its milliseconds by collective (kind and
size), and the longest stretches with the launcher that ran next (llama/runtime/timeline.py `Timeline.alone`).
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llama.runtime.cli import require  # noqa: E402
from llama.config import get_preset  # noqa: E402
from llama.optim import AdamWConfig  # noqa: E402
from llama.options import RunOptions  # noqa: E402



@dataclass(frozen=True)
class Bench:
    """A config's run: (B, T) per GPU, the memory recipe, the GPU counts and ZeRO stages it runs at (None: those
    asked for), and whether the steps without communication are timed too (breakdown)."""
    B: int
    T: int
    recompute: str | None = None  # None: the plan's
    optimizer: str | None = None
    min_gpus: int = 1
    stages: tuple | None = None
    breakdown: bool = True


CONFIGS = {"d12": Bench(16, 1024), "llama3.2-1b": Bench(8, 2048),
           "llama3.1-8b": Bench(1, 8192, "full", "adamw8bit", min_gpus=2, stages=(3,), breakdown=False)}
VOCAB = 128256
OPEN_SHOWN = 6  # --trace: the longest stretches of communication with no compute beside it, per run


def step_ms(config, bench: Bench, steps: int, comm, zero: int, gemm: str, built=None) -> tuple[float, dict, object]:
    """Median ms of a captured training step at ZeRO stage `zero` with the GEMM choice `gemm` ('static' or
    'dynamic'), the memory it holds, and the model; built() runs once the model exists (its weights gathered),
    before the first step."""
    from llama.runtime.cuda import allocated_bytes, time_ms
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.run.plan import make_plan
    B, T = bench.B, bench.T
    before = allocated_bytes()
    plan = make_plan(config, RunOptions("cuda", "bf16", bench.recompute, bench.optimizer,
                                        gpus=comm.world_size if comm else 1, zero=zero))
    plan = replace(plan, gemm=replace(plan.gemm, dynamic=gemm == "dynamic"))
    model = GPUModelBF16(config, plan, (B, T), comm=comm)
    if built is not None:
        built()
    rng = np.random.default_rng(comm.rank if comm else 0)
    batches = [[(rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T)))]
               for _ in range(4)]
    opt, done = AdamWConfig(), [0]

    def step():  # as the trainer runs it: the next step's first micro-batch staged while this one runs
        done[0] += 1
        model.train_step(batches[done[0] % 4], 1e-4, done[0], opt, upcoming=batches[(done[0] + 1) % 4][0])
        if comm is not None:
            comm.beat()

    for _ in range(3):  # the first step compiles and captures
        step()
    ms = time_ms(step, warmup=0, repeats=steps, inner=1)
    z = model.zero
    moments = (z.m_codes, z.v_codes, z.m_scales, z.v_scales) if z.optimizer == "adamw8bit" else (z.m, z.v)
    memory = {"total": allocated_bytes() - before, "optimizer": z.master.nbytes + sum(x.nbytes for x in moments)}
    return ms, memory, model


def step_gathers(z, layout) -> None:
    """The all-gathers of one step without its compute: every bucket (stages 1-2), or (stage 3) the embedding
    and head, then each layer's as the forward reaches it and again as the backward does."""
    starts = layout.layer_starts()
    z.begin(gather=True)
    for i in range(len(starts) - 1):
        with z.layer(starts[i], prefetch=starts[i + 1]):
            pass
    for i in reversed(range(len(starts) - 1)):
        with z.layer(starts[i], prefetch=starts[i - 1] if i else None):
            pass
    z.end(None)


def open_communication(timeline) -> dict:
    """From an eager step's timeline: the milliseconds of each collective (by kind and size) with no compute beside
    it, and the longest such stretches with the launcher that ran next (what waited for it)."""
    alone = timeline.alone()
    by_label = {}
    for span, ms, _ in alone:
        by_label[span.label] = by_label.get(span.label, 0.0) + ms
    longest = sorted(alone, key=lambda item: -item[1])[:OPEN_SHOWN]
    return {"total_ms": sum(ms for _, ms, _ in alone), "by_collective": by_label,
            "longest": [{"collective": span.label, "at_ms": round(span.start_ms, 2), "open_ms": round(ms, 3),
                         "next": after} for span, ms, after in longest]}


def worker(args) -> None:
    from llama.runtime.cuda import runtime, select_device, time_ms
    from llama.parallel.distributed import DistributedEnv
    env = DistributedEnv.from_environ()
    comm = None
    if env.world_size > 1:
        from llama.parallel.nccl import Communicator
        select_device(env.local_rank)
        comm = Communicator(env, timeout=900)
    bench = CONFIGS[args.config]
    B, T = bench.B, bench.T
    config = get_preset(args.config).replace(vocab_size=VOCAB)
    zero, gemm = args.zero[0], args.gemm[0]  # a worker runs one stage and GEMM choice
    ms, memory, model = step_ms(config, bench, args.steps, comm, zero, gemm)
    result = {"gpus": env.world_size, "zero": zero, "gemm": gemm, "B": B, "T": T, "ms": ms, "memory": memory,
              "device": runtime().name}
    if args.trace:
        from bench_step import kernel_breakdown  # scripts/bench_step.py: one eager step under a Timeline
        rng = np.random.default_rng(env.rank)
        batch = [(rng.integers(0, VOCAB, (B, T)), rng.integers(0, VOCAB, (B, T)))]
        timeline = kernel_breakdown(model, batch, AdamWConfig())
        path = Path(args.trace) / f"{args.config}_{env.world_size}gpus_zero{zero}_{gemm}_rank{env.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(timeline.chrome_trace(env.rank)))
        result["open_communication"] = open_communication(timeline)
    if comm is not None:
        z = model.zero
        result["reduce_scatter_ms"] = time_ms(z.reduce_all, warmup=1, repeats=args.steps, inner=1)
        result["all_gather_ms"] = time_ms(lambda: step_gathers(z, model.layout), warmup=1, repeats=args.steps, inner=1)
    if comm is not None and bench.breakdown:
        del model, z
        gc.collect()
        def skipping(*names):
            """step_ms's built(): from then on the collectives `names` do nothing. Only once the model has gathered
            its first weights: skipped before, each rank would train on its own shard and whatever the rest of the
            buffer held."""
            def skip():
                for name in names:
                    setattr(comm, name, lambda *a, **k: None)
            return skip
        result["no_reduce_ms"], _, model = step_ms(config, bench, args.steps, comm, zero, gemm,
                                                   skipping("reduce_scatter"))  # the step without its reductions
        del model
        gc.collect()
        result["no_comm_ms"], _, _ = step_ms(config, bench, args.steps, comm, zero, gemm,  # no communication
                                             skipping("all_gather", "all_reduce"))
    if env.is_main:
        Path(args.out).write_text(json.dumps(result))
    if comm is not None:
        model = z = None  # noqa: F841  (their CUDA graphs hold the communicator, which close() waits for)
        gc.collect()
        comm.close()


def run(gpus: int, config: str, steps: int, zero: int, gemm: str, trace: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        launch = [sys.executable, "-m", "llama.launch", "--nproc-per-node", str(gpus)] if gpus > 1 else [sys.executable]
        command = [*launch, __file__, "--worker", "--config", config, "--steps", str(steps), "--zero", str(zero),
                   "--gemm", gemm, "--out", str(out), *(["--trace", trace] if trace else [])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        subprocess.run(command, check=True, env=env, cwd=ROOT)
        print(out.read_text(), flush=True)  # each run's figures as soon as they exist
        return json.loads(out.read_text())


def print_table(results: dict) -> None:
    """The runs' figures, a line each (and into each result: tok_s, and on several GPUs what the step hides)."""
    first = next(r for by_run in results.values() for r in by_run.values())
    print(f"\ndevice: {first['device']}; bf16, CUDA graphs, ZeRO over NCCL (NCCL_NVLS_ENABLE=0); batch per GPU fixed")
    print(f"{'config':<13}{'GPUs':>5}{'ZeRO':>5}{'GEMM':>8}{'B x T':>10}{'ms/step':>9}{'tok/s':>11}{'tok/s/GPU':>10}"
          f"{'efficiency':>11}{'GB/GPU':>8}{'optim GB':>9}{'RS ms':>7}{'AG ms':>7}{'no-comm ms':>11}{'exposed ms':>11}"
          f"{'hidden':>7}{'RS hidden':>10}{'comm share':>11}")
    for name, by_run in results.items():
        for r in by_run.values():
            r["tok_s"] = r["gpus"] * r["B"] * r["T"] / r["ms"] * 1e3
        base = by_run.get("1x1_static")  # the plan's one-GPU step
        for r in by_run.values():
            g, tok_s = r["gpus"], r["tok_s"]
            eff = f"{tok_s / (g * base['tok_s']):.3f}" if base else "-"
            line = (f"{name:<13}{g:>5}{r['zero']:>5}{r['gemm']:>8}{r['B']:>4} x{r['T']:>5}{r['ms']:>9.1f}{tok_s:>11,.0f}"
                    f"{tok_s / g:>10,.0f}{eff:>11}{r['memory']['total'] / 1e9:>8.1f}{r['memory']['optimizer'] / 1e9:>9.2f}")
            if g > 1:
                line += f"{r['reduce_scatter_ms']:>7.2f}{r['all_gather_ms']:>7.2f}" + communication_columns(r)
            print(line)


def print_open_communication(results: dict) -> None:
    """--trace: per run on several GPUs, rank 0's collectives with no compute beside them in its eager step."""
    for name, by_run in results.items():
        for run_name, r in by_run.items():
            if "open_communication" not in r or r["gpus"] == 1:
                continue
            o = r["open_communication"]
            print(f"\n{name} {run_name}: {o['total_ms']:.2f} ms of communication with no compute beside it (rank 0's "
                  "eager step), by collective: " + ", ".join(f"{label} {ms:.2f}" for label, ms in
                                                            sorted(o["by_collective"].items(), key=lambda i: -i[1])))
            for x in o["longest"]:
                print(f"  at {x['at_ms']:8.2f} ms  {x['collective']:<26} {x['open_ms']:7.3f} ms open, then {x['next']}")


def communication_columns(r: dict) -> str:
    """The no-comm step, exposed ms, hidden shares and comm share of a run on several GPUs (- where not measured:
    no breakdown, or the stage-3 step without collectives, which reads weight slots nobody gathered)."""
    if "no_comm_ms" not in r:
        return f"{'-':>11}{'-':>11}{'-':>7}{'-':>10}{'-':>11}"
    r["reduce_hidden"] = 1 - (r["ms"] - r["no_reduce_ms"]) / r["reduce_scatter_ms"]
    if r["zero"] == 3:
        return f"{r['no_comm_ms']:>11.1f}{'-':>11}{'-':>7}{r['reduce_hidden']:>10.0%}{'-':>11}"
    exposed = r["ms"] - r["no_comm_ms"]
    r["exposed_ms"], r["hidden"] = exposed, 1 - exposed / (r["reduce_scatter_ms"] + r["all_gather_ms"])
    return (f"{r['no_comm_ms']:>11.1f}{exposed:>11.2f}{r['hidden']:>7.0%}{r['reduce_hidden']:>10.0%}"
            f"{exposed / r['ms']:>11.1%}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--configs", nargs="+", default=["d12", "llama3.2-1b"], choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--zero", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3],
                        help="the ZeRO stages to run on several GPUs (one GPU runs stage 1)")
    parser.add_argument("--gemm", nargs="+", choices=["static", "dynamic"],
                        help="GEMM versions 5/6 (static) or their twins 8/7 that claim tiles (dynamic), on every "
                             "GPU count (default: the plan's, static on one GPU and dynamic on several)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--trace", help="a folder for every rank's timeline of one eager step (Chrome trace JSON)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    require("scripts/bench_multi_gpu.py", ("pycuda",))  # no GPU context here: the workers run on the GPUs
    if args.worker:
        return worker(args)
    gemms = lambda g: args.gemm or (["static"] if g == 1 else ["dynamic"])  # noqa: E731
    stages = lambda name, g: [1] if g == 1 else CONFIGS[name].stages or args.zero  # noqa: E731
    trace = str(Path(args.trace).resolve()) if args.trace else None  # the workers run in the repository root
    results = {name: {f"{g}x{z}_{m}": run(g, name, args.steps, z, m, trace)
                      for g in args.gpus if g >= CONFIGS[name].min_gpus for m in gemms(g) for z in stages(name, g)}
               for name in args.configs}
    print_table(results)
    print_open_communication(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
