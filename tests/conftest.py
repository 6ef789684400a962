"""GPU tests carry the `gpu` marker and skip themselves where no CUDA device is usable."""

import functools

import pytest


@functools.cache
def gpu_available() -> bool:
    try:
        import pycuda.driver as drv
        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU with pycuda here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
