"""Train the same model twice, bf16 and fp32, from the same init on the same data, and compare the
loss curves: the mean train loss over the last 50 steps of each, their difference, and a PNG of
both (scripts/plot_log.py, where matplotlib is installed). Needs a GPU.

    python3 scripts/compare_dtypes.py [-o out/compare] [-- extra train_llama.py arguments]
"""

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_log import read_log  # noqa: E402

DEFAULT_RUN = ["-e", "d12", "-b", "8", "-t", "1024", "-x", "300", "-v", "0", "-s", "0", "-n", "0", "--seed", "0"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output-dir", default="out/compare")
    parser.add_argument("extra", nargs="*", help="more train_llama.py arguments (after --)")
    args = parser.parse_args()
    out = Path(args.output_dir)
    means = {}
    for dtype in ("bf16", "fp32"):
        run = [sys.executable, "train_llama.py", *DEFAULT_RUN, *args.extra, "--device", "cuda", "--dtype", dtype,
               "-o", str(out / dtype)]
        print(" ".join(run[1:]), flush=True)
        if subprocess.run(run).returncode != 0:
            return 1
        train, _ = read_log(out / dtype / "main.log")
        last = [train[s] for s in sorted(train)[-50:]]
        means[dtype] = sum(last) / len(last)
    print(f"mean train loss over the last 50 steps: bf16 {means['bf16']:.4f}, fp32 {means['fp32']:.4f}, "
          f"|difference| {abs(means['bf16'] - means['fp32']):.4f} nats")
    subprocess.run([sys.executable, str(Path(__file__).parent / "plot_log.py"), str(out / "bf16" / "main.log"),
                    str(out / "fp32" / "main.log"), "-o", str(out / "compare.png")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
