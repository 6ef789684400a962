"""GPU tests carry the `gpu` marker and skip themselves where no CUDA device is usable.
Tiers: tests/unit (fast CPU), tests/system (whole programs, CPU), tests/gpu (marker `gpu`); marker `slow`: about 1 s
or more on a 2-core CPU. `python3 -m pytest -q` runs everything, `python3 -m pytest -q -m "not slow"` the fast tier."""

import pytest

from llama.runtime import kernel_build
from llama.data.datasets import prepare_tinyshakespeare
from llama.data.tokenizer import ByteTokenizer
from tests.gpu_helpers import gpu_available
from tests.runs import TEXT


@pytest.fixture(autouse=True, scope="session")
def no_package_index():
    """No test reaches the network: the tokenizer fetch's pip gets an index on a closed local port
    unless the test serves one itself (session-wide, so that module fixtures are covered too)."""
    closed = "http://127.0.0.1:9/simple/"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("llama.data.tokenizer_fetch.INDEX_URL", closed)
        patch.setenv("LLAMA_PACKAGE_INDEX", closed)  # trainers started as subprocesses
        yield


@pytest.fixture(autouse=True, scope="session")
def session_cache(tmp_path_factory):
    """The tokenizer and the built-in corpus go to a cache of the tests' own ($LLAMA_CUDA_CACHE, read by
    llama/cache.py and by the trainers started as subprocesses), so that the user's cache neither
    changes what the tests see nor is changed by them: this one for module fixtures, own_cache's for tests. The
    compiled kernels stay in the user's kernel cache (entries are keyed by their sources and options), so that
    the tests do not compile every kernel again."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(kernel_build.CACHE_ENV, str(kernel_build.cache_dir()))
        patch.setenv("LLAMA_CUDA_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """An empty cache for each test: a tokenizer one test fetches is not another test's default."""
    monkeypatch.setenv("LLAMA_CUDA_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """Byte-tokenized shards in tmp_path/data, and tmp_path as the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input.txt").write_text(TEXT)
    train, val = prepare_tinyshakespeare(tmp_path / "input.txt", tmp_path / "data", ByteTokenizer())
    return ["-i", str(train), "-j", str(val)]


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
