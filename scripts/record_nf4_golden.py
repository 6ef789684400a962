"""Record what bitsandbytes' CUDA kernels make of tests/nf4_cases.py's tensors, the golden fixture of our NF4 twin
(llama/twins/nf4.py; checked by tests/unit/test_nf4.py without torch). Run on the GPU machine with torch and
bitsandbytes installed (`pip install /path/to/bitsandbytes-*.whl`), from the repository root, and commit
tests/data/golden/nf4_bnb.json and .npz:

    PYTHONPATH=$PWD python3 scripts/record_nf4_golden.py tests/data/golden

For each case: quantize_4bit(w, blocksize=64, quant_type="nf4") without (the plain absmaxes) and with
compress_statistics (codes, absmax codes, their scales and offset, and the two maps), and dequantize_4bit's
output in w's dtype (as its bits). --device cpu records bitsandbytes' CPU backend instead, for a dry run of this script:
the test refuses that fixture (its CPU kernels quantize the absmaxes on a 65536-bin table and its bf16
dequantizer cuts blocks per row, so they are not the CUDA kernels' bits).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

from tests.hf_helpers import sha256, write_fixture
from tests.nf4_cases import NF4_CASES, NF4_GOLDEN, nf4_case_weights


def to_torch(w: np.ndarray, device: str):
    import torch

    if w.dtype == np.float32:
        return torch.from_numpy(w.copy()).to(device)
    return torch.from_numpy(w.view(np.int16).copy()).view(torch.bfloat16).to(device)


def float32_of(t) -> np.ndarray:
    """A torch tensor's values as float32 numpy (exact for bf16 and float32)."""
    return t.detach().float().cpu().numpy()


def bits_of(w: np.ndarray) -> type:
    """The unsigned integers as wide as w's dtype: the fixture keeps bf16 values as their bits."""
    return np.uint16 if w.dtype.itemsize == 2 else np.uint32


def record_case(name: str, device: str) -> tuple[dict, dict[str, np.ndarray]]:
    import bitsandbytes.functional as F

    w = nf4_case_weights(name)
    t = to_torch(w, device)
    _, plain = F.quantize_4bit(t, blocksize=64, quant_type="nf4", compress_statistics=False)
    packed, state = F.quantize_4bit(t, blocksize=64, quant_type="nf4", compress_statistics=True)
    dequantized = F.dequantize_4bit(packed, state)
    arrays = {f"{name}.codes": packed.cpu().numpy().reshape(-1), f"{name}.absmax": float32_of(plain.absmax),
              f"{name}.absmax_codes": state.absmax.cpu().numpy(),
              f"{name}.absmax_scales": float32_of(state.state2.absmax),
              f"{name}.offset": np.float32(state.offset.item()).reshape(1),
              f"{name}.dequantized": float32_of(dequantized).astype(w.dtype).reshape(w.shape).view(bits_of(w)),
              f"{name}.nf4_levels": float32_of(state.code), f"{name}.dynamic_map": float32_of(state.state2.code)}
    facts = {"sha256": sha256(w.astype(np.float32)), "dtype": str(w.dtype), "shape": list(w.shape),
             "dequantized_dtype": str(dequantized.dtype)}
    return facts, arrays


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("out_dir", type=Path, help="where the fixture goes (tests/data/golden)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    import bitsandbytes
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device for torch; record on the GPU machine (or --device cpu for a dry run)",
              file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    facts = {"made_by": "scripts/record_nf4_golden.py", "device": args.device,
             "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
             "cpu_capability": torch.backends.cpu.get_cpu_capability(),
             "versions": {"torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__,
                          "numpy": np.__version__, "python": sys.version.split()[0]}, "cases": {}}
    arrays = {}
    for name in NF4_CASES:
        facts["cases"][name], case_arrays = record_case(name, args.device)
        arrays.update(case_arrays)
    write_fixture(args.out_dir, NF4_GOLDEN, facts, arrays)
    print(f"recorded {NF4_GOLDEN} ({len(NF4_CASES)} cases, bitsandbytes {bitsandbytes.__version__} on "
          f"{facts['device_name']}) in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
