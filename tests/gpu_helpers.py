"""Helpers for the GPU tests: device arrays from numpy, NaN-poisoned outputs, and an error log
that conftest.py prints as a table at the end of the run."""

import numpy as np

ERRORS: list[tuple[str, float]] = []


def dev(x):
    from llama.cuda import to_device
    x = np.asarray(x)
    return to_device(x.astype(np.int32 if x.dtype.kind in "iu" else np.float32))


def poisoned(shape, dtype=np.float32):
    from llama.cuda import to_device
    return to_device(np.full(shape, np.nan, dtype=dtype))


def check(name: str, device_array, expected: np.ndarray, tol: float = 1e-5) -> float:
    """‖out − ref‖ / ‖ref‖ of a device array against a float64 reference; NaN (unwritten) fails."""
    out = device_array.download().astype(np.float64).reshape(expected.shape)
    assert np.isfinite(out).all(), f"{name}: output has NaN/inf (unwritten elements?)"
    err = float(np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-300))
    ERRORS.append((name, err))
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"
    return err
