"""Train the same model from the same init on the same data in two or more ways, and compare the
loss curves: the mean train loss over the last 50 steps (--last) of each run, the largest difference from the
first run, and a PNG of all of them (scripts/plot_log.py, where matplotlib is installed).

    python3 scripts/compare_runs.py dtype bf16 fp32 [-o runs/compare] [-- extra train_llama.py arguments]
    python3 scripts/compare_runs.py dtype fp8 bf16 -- -x 500
    python3 scripts/compare_runs.py gpus 1 8 [-o runs/scaling] [-- extra train_llama.py arguments]
    python3 scripts/compare_runs.py recipe plain adamw8bit in-backward full [--device cpu] [-- ...]
    python3 scripts/compare_runs.py fp8-scaling row tensor [--device cpu] [-- ...]

A difference of a few hundredths of a nat can be the trajectory's, not the change's: `--seeds 0 1 2 3`
trains every way from each seed (initialization and data order) and averages the differences.

`dtype` runs each precision on one GPU, or fp32 and fp8 on the CPU (the reference and its FP8 twin) with
--device cpu. `gpus` runs each GPU count (llama.launch) at the same global
batch: every run has B sequences per micro-batch, and B x T x the largest count tokens per step, so
fewer GPUs accumulate more micro-batches. `recipe` runs each memory recipe (RECIPES below) on one GPU,
or on the CPU with --device cpu (then pass a CPU-sized model after --, e.g. -e small -b 8 -t 64).
`fp8-scaling` runs --dtype fp8 with each scaling of its casts (row-wise, tensor-wise), on one GPU or with
--device cpu the FP8 twin.
"""

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_log import read_log  # noqa: E402

from llama.options import DEVICES, DTYPES, FP8_SCALINGS  # noqa: E402

B, T = 8, 1024
TRAIN = str(Path(__file__).resolve().parents[1] / "train_llama.py")
RECIPES = {"plain": [], "partial": ["--recompute", "partial"], "full": ["--recompute", "full"],
           "adamw8bit": ["--optimizer", "adamw8bit"], "in-backward": ["--optimizer-in-backward"]}
DEFAULT_RUN = ["-e", "d12", "-b", str(B), "-t", str(T), "-x", "300", "-v", "0", "-s", "0", "-n", "0"]


def command(vary: str, value: str, values: list[str]) -> list[str]:
    if vary == "dtype":
        return [sys.executable, TRAIN, *DEFAULT_RUN, "--dtype", value]
    if vary == "recipe":
        return [sys.executable, TRAIN, *DEFAULT_RUN, *RECIPES[value]]
    if vary == "fp8-scaling":
        return [sys.executable, TRAIN, *DEFAULT_RUN, "--dtype", "fp8", "--fp8-scaling", value]
    launch = [sys.executable, "-m", "llama.launch", "--nproc-per-node", value, TRAIN]
    return [*launch, *DEFAULT_RUN, "-d", str(B * T * max(int(v) for v in values))]


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("vary", choices=("dtype", "gpus", "recipe", "fp8-scaling"))
    parser.add_argument("values", nargs="+", help=f"{' '.join(DTYPES)}, GPU counts, recipes: {', '.join(RECIPES)}, "
                                                  f"or FP8 scalings: {', '.join(FP8_SCALINGS)}")
    parser.add_argument("-o", "--output-dir", default="runs/compare")
    parser.add_argument("--device", choices=DEVICES, default="cuda",
                        help="cpu: recipes, or dtype fp32 and fp8 (the reference and its FP8 twin)")
    parser.add_argument("--last", type=int, default=50, help="steps at the end whose train loss is averaged")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0],
                        help="train every way from each seed; the differences are averaged over them")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1:]  # after --: train_llama.py arguments
    allowed = {"dtype": lambda v: v in DTYPES, "gpus": lambda v: v.isdigit() and int(v) > 0,
               "recipe": lambda v: v in RECIPES, "fp8-scaling": lambda v: v in FP8_SCALINGS}[args.vary]
    if not all(map(allowed, args.values)):
        parser.error(f"{args.vary} takes " + {"dtype": ", ".join(DTYPES), "gpus": "GPU counts",
                                              "recipe": ", ".join(RECIPES),
                                              "fp8-scaling": ", ".join(FP8_SCALINGS)}[args.vary])
    if args.device == "cpu" and args.vary == "gpus":
        parser.error("--device cpu: comparing GPU counts needs GPUs")
    if args.device == "cpu" and args.vary == "dtype" and "bf16" in args.values:
        parser.error("--device cpu: bf16 needs a GPU (the CPU runs fp32 and fp8)")
    out, first = Path(args.output_dir), args.values[0]
    differences = {value: [] for value in args.values[1:]}
    for seed in args.seeds:
        folder = out if len(args.seeds) == 1 else out / f"seed{seed}"
        means = compare(args, extra, seed, folder)
        if means is None:
            return 1
        for value in differences:
            differences[value].append(means[value] - means[first])
    if len(args.seeds) > 1:
        print(f"over {len(args.seeds)} seeds, the mean difference from {args.vary} {first}: " + ", ".join(
            f"{args.vary} {v} {sum(d) / len(d):+.4f} (each {' '.join(f'{x:+.4f}' for x in d)})"
            for v, d in differences.items()))
    return 0


def compare(args, extra: list[str], seed: int, out: Path) -> dict[str, float] | None:
    """Every run of one seed, its line of mean losses and its PNG; the means (None if a run failed)."""
    means, logs = {}, []
    for value in args.values:
        log = out / f"{args.vary}_{value}"
        run = [*command(args.vary, value, args.values), "--seed", str(seed), *extra, "--device", args.device,
               "-o", str(log)]
        print(" ".join(run[1:]), flush=True)
        if subprocess.run(run).returncode != 0:
            return None
        train, _ = read_log(log / "main.log")
        last = [train[s] for s in sorted(train)[-args.last:]]
        means[value], logs = sum(last) / len(last), logs + [str(log / "main.log")]
    first = args.values[0]
    print(f"seed {seed}: mean train loss over the last {args.last} steps: "
          + ", ".join(f"{args.vary} {v} {m:.4f}" for v, m in means.items())
          + f" | largest |difference| from {args.vary} {first}: "
          f"{max(abs(m - means[first]) for m in means.values()):.4f} nats", flush=True)
    subprocess.run([sys.executable, str(Path(__file__).parent / "plot_log.py"), *logs, "-o", str(out / "compare.png")])
    return means


if __name__ == "__main__":
    sys.exit(main())
