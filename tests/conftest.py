"""GPU tests carry the `gpu` marker and skip themselves where no CUDA device is usable."""

import functools

import pytest


@pytest.fixture(autouse=True, scope="session")
def no_package_index():
    """No test reaches the network: the tokenizer fetch's pip gets an index on a closed local port
    unless the test serves one itself (session-wide, so that module fixtures are covered too)."""
    closed = "http://127.0.0.1:9/simple/"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("llama.data.tokenizer_fetch.INDEX_URL", closed)
        patch.setenv("LLAMA_PACKAGE_INDEX", closed)  # trainers started as subprocesses
        yield


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


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU with pycuda here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    from tests.gpu_helpers import ERRORS
    if not ERRORS:
        return
    worst = {}
    for name, err in ERRORS:
        kernel = name.split("[")[0]
        worst[kernel] = max(worst.get(kernel, 0.0), err)
    terminalreporter.write_sep("-", "GPU: worst ||out - ref|| / ||ref|| per check (float64 reference)")
    for kernel, err in worst.items():
        terminalreporter.write_line(f"{kernel:<40s} {err:.2e}")
