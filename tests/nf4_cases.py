"""The tensors of the NF4 golden fixture (tests/data/golden/nf4_bnb.*): scripts/record_nf4_golden.py quantizes them
with bitsandbytes, tests/unit/test_nf4.py with our twin; both draw them here, from seeds."""

import ml_dtypes
import numpy as np

NF4_GOLDEN = "nf4_bnb"
RECORD_NF4_COMMAND = "PYTHONPATH=$PWD python3 scripts/record_nf4_golden.py tests/data/golden"
# name: (shape, dtype, seed). Rows scaled e^-6 .. e^6 spread the absmaxes over the dynamic map's decades;
# 77 x 33 is odd (a padded last nibble) and not whole blocks, and holds a block of zeros and one of subnormals
NF4_CASES = {"normal_64x128": ((64, 128), "bfloat16", 1), "rows_300x96": ((300, 96), "bfloat16", 2),
             "edges_77x33": ((77, 33), "bfloat16", 3), "rows_256x512": ((256, 512), "bfloat16", 4),
             "float32_96x64": ((96, 64), "float32", 5)}


def nf4_case_weights(name: str) -> np.ndarray:
    """The weights of a case, in its dtype (ml_dtypes.bfloat16 or float32)."""
    shape, dtype, seed = NF4_CASES[name]
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (shape[0], 1)))
    if name.startswith("edges"):
        flat = w.reshape(-1)
        flat[3 * 64:4 * 64] = 0.0
        flat[5 * 64:6 * 64] = rng.standard_normal(64) * 4e-39  # bf16 subnormals (below 1.18e-38)
    return w.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
