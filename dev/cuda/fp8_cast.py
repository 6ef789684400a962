"""Run the FP8 cast's versions on each layout a training step casts: check each against the twin
(llama/twins/fp8.py's quantize_fp8) bit for bit on a (512, C) input with its outputs poisoned first
(tests/gpu/test_fp8.py checks many more), then time it at (R, C) on rotating inputs and print its GB/s
(the bytes it moves: each pass's read of x, and the writes) next to a device-to-device copy of x timed the same
way, and the milliseconds a single pass at copy speed would take.

    python3 dev/cuda/fp8_cast.py                          # the llama3.2-1b step's casts at 16,384 tokens
    python3 dev/cuda/fp8_cast.py --shapes 16384x4096 16384x14336 --layouts rows

Layouts: rows (the forward's input, along its rows), cols (the backward's input, transposed, for dW), both (the
output's gradient, for dX and dW). v1: fp8_amax then fp8_cast (two passes over x, the amax scratch zeroed first);
v2: fp8_cast_rows_<V>, rows only (one pass, a block a row in registers); v3: fp8_cast alone, from the maxima
x's producer wrote (gate+up's gradient, whose maxima SwiGLU's backward writes: its cost is timed after the
table). llama/ops/fp8.py's cast_fp8 runs v2 where it applies, v3 where the producer gives the maxima.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from llama.runtime.cuda import BF16, FP8, empty, time_ms, to_device  # noqa: E402
from llama import ops  # noqa: E402
from llama.ops.fp8 import cast_from_amax, cast_rows_one_pass, cast_two_passes  # noqa: E402
from llama.twins.fp8 import quantize_fp8  # noqa: E402

# (layout, version): (launch(x, outputs), passes over x); outputs as cast_fp8 names them
CASES = {("rows", "v1"): (lambda x, o: cast_two_passes(x, o["rows"], o["row_scales"], None, None, None, "row"), 2),
         ("rows", "v2"): (lambda x, o: cast_rows_one_pass(x, o["rows"], o["row_scales"]), 1),
         ("cols", "v1"): (lambda x, o: cast_two_passes(x, None, None, o["cols"], o["col_scales"], None, "row"), 2),
         ("both", "v1"): (lambda x, o: cast_two_passes(x, o["rows"], o["row_scales"], o["cols"], o["col_scales"], None,
                                                       "row"), 2),
         ("both", "v3"): (lambda x, o: cast_from_amax(x, o["rows"], o["row_scales"], o["cols"], o["col_scales"],
                                                      o["amax"], "row"), 1)}
# the llama3.2-1b step at 16,384 tokens: its linear inputs (2048, 8192) and output gradients (3072, 2048, 16384)
SHAPES = ["16384x2048", "16384x8192", "16384x3072", "16384x16384"]
ROTATE = 4  # input sets cycled through while timing, so that L2 does not hold the next one
CHECKED_ROWS = 512


def shape(text: str) -> tuple[int, int]:
    R, C = text.split("x")
    return int(R), int(C)


def outputs(R: int, C: int, layout: str) -> dict:
    """The layout's outputs, poisoned (0x7F is NaN in e4m3fn)."""
    out = {}
    if layout in ("rows", "both"):
        out["rows"], out["row_scales"] = empty((R, C), FP8), empty((R,))
    if layout in ("cols", "both"):
        out["cols"], out["col_scales"] = empty((C, R), FP8), empty((C,))
    for name, array in out.items():
        array.upload(np.full(array.shape, 0x7F, np.uint8).view(FP8) if array.dtype == FP8
                     else np.full(array.shape, np.nan, np.float32))
    return out


def is_twin(host: np.ndarray, out: dict) -> bool:
    """out holds quantize_fp8's bits of host for each layout it has."""
    exact, want = host.astype(np.float32), {}
    if "rows" in out:
        want["rows"], want["row_scales"] = quantize_fp8(exact, -1, "row")
    if "cols" in out:
        values, want["col_scales"] = quantize_fp8(exact, 0, "row")
        want["cols"] = np.ascontiguousarray(values.T)
    return all(np.array_equal(out[name].download().view(np.uint8 if out[name].dtype == FP8 else np.uint32),
                              want[name].view(np.uint8 if want[name].dtype == FP8 else np.uint32)) for name in out)


def amax_of(host: np.ndarray):
    """The row then column maxima of |host| as float bits on the device, as a producer writes them (v3 reads them)."""
    magnitudes = np.abs(host.astype(np.float32))
    return to_device(np.concatenate([magnitudes.max(axis=1), magnitudes.max(axis=0)]).view(np.uint32))


def swiglu_amax_cost(N: int, F: int) -> None:
    """SwiGLU's bf16 backward at (N, F) alone and writing its gradient's maxima (what v3's amax costs its producer)."""
    rng = np.random.default_rng(1)
    gate_up, dout = (to_device(rng.standard_normal(shape, np.float32).astype(BF16)) for shape in ((N, 2 * F), (N, F)))
    dgate_up, amax = empty((N, 2 * F), BF16), empty((N + 2 * F,), np.uint32)
    plain = time_ms(lambda: ops.swiglu_backward_bf16(dgate_up, dout, gate_up))
    fused = time_ms(lambda: ops.swiglu_backward_bf16(dgate_up, dout, gate_up, amax=amax))
    moved = N * F * 2 * 5  # bytes: gate, up and dout read, dgate and dup written
    print(f"swiglu backward {N}x{F}: {plain * 1e3:.1f} us ({moved / plain / 1e6:.0f} GB/s), with its gradient's amax "
          f"{fused * 1e3:.1f} us ({moved / fused / 1e6:.0f} GB/s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=shape, default=[shape(s) for s in SHAPES])
    parser.add_argument("--layouts", nargs="+", choices=("rows", "cols", "both"), default=["rows", "cols", "both"])
    parser.add_argument("--swiglu", type=shape, default=(16384, 8192), help="N x F of the SwiGLU backward timed")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'R x C':>14}{'layout':>7}{'version':>8}{'us':>9}{'GB/s':>7}{'of copy':>8}{'1 pass at copy us':>19}")
    for R, C in args.shapes:
        host = (rng.standard_normal((R, C), np.float32) * np.exp(rng.uniform(-8, 8, (R, 1)))).astype(BF16)
        small = host[:CHECKED_ROWS]
        xs, small_x = [to_device(host) for _ in range(ROTATE)], to_device(small)
        turn = [0]

        def rotating(fn):
            def run():
                turn[0] += 1
                fn(xs[turn[0] % ROTATE])
            return run

        copy_out = empty((R, C), BF16)
        copy_bandwidth = R * C * 4 / time_ms(rotating(lambda x: copy_out.copy_from(x))) / 1e6  # GB/s
        for (layout, version), (launch, passes) in CASES.items():
            if layout not in args.layouts:
                continue
            checked = outputs(len(small), C, layout)
            launch(small_x, checked | {"amax": amax_of(small)})
            if not is_twin(small, checked):
                print(f"{layout} {version} at {len(small)}x{C}: not the twin's bits")
                return 1
            out = outputs(R, C, layout)
            maxima = {"amax": amax_of(host)} if version == "v3" else {}  # the inputs rotate, their maxima not: timing
            ms = time_ms(rotating(lambda x: launch(x, out | maxima)))
            written = sum(array.nbytes for array in out.values())
            moved, single = passes * R * C * 2 + written, R * C * 2 + written
            print(f"{R:>7}x{C:<6}{layout:>7}{version:>8}{ms * 1e3:>9.1f}{moved / ms / 1e6:>7.0f}"
                  f"{moved / ms / 1e6 / copy_bandwidth:>8.0%}{single / copy_bandwidth / 1e3:>19.1f}", flush=True)
    swiglu_amax_cost(*args.swiglu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
