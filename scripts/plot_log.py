"""Plot train and val loss from llm.c-style main.log files into a PNG (needs matplotlib: pip install -e ".[plot]"),
and beside them, on a second axis, the accuracy of each task of an in-loop evaluation (--eval: s:<step> <task>:<acc>
lines, hellaswag's as llm.c's hella, and with --eval suite the suite's mean centered accuracy).

    python3 scripts/plot_log.py out [-o loss.png]                    # a run folder, or its main.log
    python3 scripts/plot_log.py out/bf16/main.log out/fp32/main.log -o compare.png   # runs side by side
    python3 scripts/plot_log.py out/fp8/main.log out/bf16/main.log --smooth 20   # train loss as a 20-step mean

A resumed run appends to main.log; for a step logged twice the later line wins.
"""

import argparse
import re
import sys
from pathlib import Path

from llama.runtime.cli import ArgumentParser, positive_int

LINE = re.compile(r"^s:(\d+) (trl|tel):([-+0-9.eEinfa]+)")
# an --eval line: s:<step> <task>:<acc> [<task>_norm:<acc_norm>] [<task>_ppl:<perplexity>] (the suite's may be < 0)
EVAL_LINE = re.compile(r"^s:(\d+) (?!trl:|tel:)(\w+):(-?[0-9.]+)(?: \2_norm:([0-9.]+))?")


def read_log(path: str) -> tuple[dict, dict]:
    """{step: train loss}, {step: val loss}."""
    train, val = {}, {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                (train if m[2] == "trl" else val)[int(m[1])] = float(m[3])
    return train, val


def read_eval_log(path: str) -> dict[str, dict]:
    """{task key: {step: accuracy}} of the --eval lines (their acc)."""
    evals = {}
    with open(path) as f:
        for line in f:
            if m := EVAL_LINE.match(line):
                evals.setdefault(m[2], {})[int(m[1])] = float(m[3])
    return evals


def log_of(path: str) -> str:
    """A run folder's main.log (as every other script takes a run folder), or the log file given."""
    return str(Path(path) / "main.log") if Path(path).is_dir() else path


def trailing_mean(values: list[float], n: int) -> list[float]:
    """Each value replaced by the mean of it and the n - 1 before it (fewer at the start)."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return [(sums[i + 1] - sums[max(0, i + 1 - n)]) / (i + 1 - max(0, i + 1 - n)) for i in range(len(values))]


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", help="main.log paths or run folders; with several, each run is labelled by "
                        "its folder")
    parser.add_argument("-o", "--output", default=None, help="PNG path (default: next to the log)")
    parser.add_argument("--smooth", type=positive_int, default=1, metavar="N",
                        help="plot the train loss as the mean of the last N steps (default 1: as logged)")
    args = parser.parse_args(argv)
    args.logs = [log_of(path) for path in args.logs]
    runs = []
    for log in args.logs:
        try:
            train, val = read_log(log)
            evals = read_eval_log(log)
        except OSError as e:
            print(f"error: cannot read {log}: {e.strerror}", file=sys.stderr)
            return 2
        if not train and not val:
            print(f"error: {log} has no s:<step> trl:/tel: lines", file=sys.stderr)
            return 2
        runs.append((Path(log).parent.name + " " if len(args.logs) > 1 else "", train, val, evals))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('error: plotting needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    output = args.output or args.logs[0].rsplit(".", 1)[0] + ".png"
    fig, ax = plt.subplots(figsize=(8, 5))
    accuracy = ax.twinx() if any(evals for *_, evals in runs) else None
    for label, train, val, evals in runs:
        if train:
            steps = sorted(train)
            ax.plot(steps, trailing_mean([train[s] for s in steps], args.smooth), linewidth=1,
                    label=label + ("train" if args.smooth == 1 else f"train ({args.smooth}-step mean)"))
        if val:
            ax.plot(sorted(val), [val[s] for s in sorted(val)], "o-", label=label + "val")
        for key, values in evals.items():
            accuracy.plot(sorted(values), [values[s] for s in sorted(values)], "s--", label=f"{label}{key} acc")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if accuracy is not None:
        accuracy.set_ylabel("accuracy")
        accuracy.legend(loc="upper right")
    ax.legend(loc="upper left" if accuracy is not None else "best")
    fig.savefig(output, dpi=120, bbox_inches="tight")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
