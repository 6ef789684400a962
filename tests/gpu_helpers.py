"""Helpers for the GPU tests: whether (and how many) GPUs are usable, device arrays from numpy,
NaN-poisoned outputs, and an error log that conftest.py prints as a table at the end of the run."""

import functools

import numpy as np

ERRORS: list[tuple[str, float]] = []


@functools.cache
def gpu_available() -> bool:
    try:
        import pycuda.driver as drv
        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False


@functools.cache
def gpu_count() -> int:
    if not gpu_available():
        return 0
    import pycuda.driver as drv
    return drv.Device.count()


def dev(x):
    from llama.runtime.cuda import to_device
    x = np.asarray(x)
    return to_device(x.astype(np.int32 if x.dtype.kind in "iu" else np.float32))


def dev_bf16(x):
    """A bf16 device array holding x rounded to bf16."""
    from llama.runtime.cuda import BF16, to_device
    return to_device(np.asarray(x).astype(BF16))


def bf16_round(x):
    """x rounded to bf16, back in float64: the inputs a bf16 kernel really sees."""
    from llama.runtime.cuda import BF16
    return np.asarray(x).astype(BF16).astype(np.float64)


def poisoned(shape, dtype=np.float32):
    from llama.runtime.cuda import to_device
    return to_device(np.full(shape, np.nan, dtype=np.float32).astype(dtype))


def check(name: str, device_array, expected: np.ndarray, tol: float = 1e-5) -> float:
    """‖out − ref‖ / ‖ref‖ of a device array against a float64 reference; NaN (unwritten) fails."""
    out = device_array.download().astype(np.float64).reshape(expected.shape)
    assert np.isfinite(out).all(), f"{name}: output has NaN/inf (unwritten elements?)"
    err = float(np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-300))
    ERRORS.append((name, err))
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"
    return err


def randn(rng, *shape, scale: float = 1.0, dtype=np.float32):
    """Normal values (times scale) rounded to dtype, as float64: the exact inputs a kernel of that precision
    sees, which its float64 twin is given too."""
    return (rng.standard_normal(shape) * scale).astype(dtype).astype(np.float64)


def randn_bf16(rng, *shape, scale: float = 1.0):
    """randn rounded to bf16: the inputs of the bf16 kernels."""
    from llama.runtime.cuda import BF16
    return randn(rng, *shape, scale=scale, dtype=BF16)


def poisoned_bf16(shape):
    """A bf16 output full of NaN, so that an element the kernel leaves unwritten fails the check."""
    from llama.runtime.cuda import BF16, to_device
    return to_device(np.full(shape, np.nan, dtype=BF16))


def bits(device_array) -> np.ndarray:
    """The raw bits of a downloaded array, to compare bit for bit."""
    host = device_array.download()
    return host.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[host.dtype.itemsize])


def check_increment(name: str, device_array, before: np.ndarray, increment: np.ndarray, tol: float) -> float:
    """An accumulated (+=) output: ‖(out − before) − increment‖ / ‖increment‖."""
    got = device_array.download().astype(np.float64)
    assert np.isfinite(got).all(), f"{name}: output has NaN/inf"
    err = float(np.linalg.norm((got - before) - increment) / max(np.linalg.norm(increment), 1e-300))
    ERRORS.append((name, err))
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"
    return err


def one_step_losses(cpu, gpu, tokens, targets, tag: str) -> None:
    """One batch through the float64 reference `cpu` and the bf16 GPU model `gpu`, each with its backward at loss
    scale 0.5: their losses agree within 1% (logged as TAG_loss_rel); the gradients are left in cpu.grads and
    gpu.grads."""
    cpu_loss = cpu.forward(tokens, targets)
    cpu.backward(loss_scale=0.5)
    gpu.zero_grad()
    gpu_loss = gpu.forward(tokens, targets, loss_scale=0.5)
    gpu.backward()
    ERRORS.append((f"{tag}_loss_rel", abs(gpu_loss - cpu_loss) / cpu_loss))
    assert abs(gpu_loss - cpu_loss) < 1e-2 * cpu_loss
