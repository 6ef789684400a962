"""Build the CUDA kernels ahead into the persistent cache (llama/runtime/kernel_build.py), for a GPU architecture: on a
machine without a GPU too (a container image's build, a login node before a job is queued).

    python3 scripts/build_kernels.py --arch sm_90a        # what training (and its sampler) can launch there
    python3 scripts/build_kernels.py --arch sm_90a --all  # every unit of kernels/*.cu

The cache is $LLAMA_KERNEL_CACHE, else $XDG_CACHE_HOME/llama-cuda/kernels, else ~/.cache/llama-cuda/kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama.runtime.kernel_build import (KernelBuildError, build, cache_dir, kernel_dir, kernels_for,  # noqa: E402
                                        units_of)
from llama.run.plan import ATTENTION, ATTENTION_HOPPER, GemmChooser, Plan  # noqa: E402


def training_plans(code: str) -> list[Plan]:
    """The plans make_plan can choose on a GPU of this code: each dtype, on one GPU and on several."""
    hopper = code == "sm_90a"
    attention = (ATTENTION_HOPPER if hopper else ATTENTION)[0]
    return [Plan("cuda", dtype, code, GemmChooser(hopper, dynamic=several), attention,
                 fp8_gemm=GemmChooser(hopper, fp8=True) if dtype == "fp8" else None)
            for dtype in (("bf16", "fp8", "fp32") if hopper else ("bf16", "fp32")) for several in (False, True)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90a", help="the GPU's code, e.g. sm_90a (H100, H200) or sm_80 (A100)")
    parser.add_argument("--all", action="store_true", help="every unit of kernels/*.cu, not only training's")
    args = parser.parse_args(argv)
    if args.all:
        units = [unit for source in sorted(kernel_dir().glob("*.cu")) for unit in units_of(source, args.arch)]
    else:
        units = [unit for plan in training_plans(args.arch) for unit in kernels_for(plan, args.arch, decoder=True)]
    try:
        build(units)
    except KernelBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{len(dict.fromkeys(units))} kernels for {args.arch} in {cache_dir()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
