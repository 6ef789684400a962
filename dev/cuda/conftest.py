"""The ladders' tests, python3 -m pytest dev/cuda: those marked `gpu` run the rungs' kernels and skip where no CUDA
GPU is usable, as tests/gpu's do (tests/conftest.py)."""

import pytest

from tests.gpu_helpers import gpu_available

HERE = __file__.rsplit("/", 1)[0]


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU with pycuda here")
    for item in items:
        if "gpu" in item.keywords and str(item.path).startswith(HERE):
            item.add_marker(skip)
