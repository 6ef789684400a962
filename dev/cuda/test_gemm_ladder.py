"""The GEMM ladder's rungs that the plan does not pick (dev/cuda/gemm_ladder.py: versions 2, 3 and 4, FP8's version
5), checked by the production versions' own tests (tests/gpu/test_gemm.py, test_gemm_fp8.py), imported here with
the fixtures that name the rungs: against the float64 product, every layout and epilogue, split-K inside the
kernel, determinism. Hopper (sm_90a) only."""

import functools

import pytest

from dev.cuda.gemm_ladder import FP8_RUNGS, FP8_VERSIONS, RUNGS, VERSIONS
from tests.gpu.test_gemm import (test_gemm, test_gemm_accumulate, test_gemm_deterministic,  # noqa: F401
                                 test_gemm_rope_epilogue, test_gemm_split_in_kernel)
from tests.gpu.test_gemm_fp8 import (test_gemm_fp8, test_gemm_fp8_is_deterministic,  # noqa: F401
                                     test_gemm_fp8_rope_epilogue)

pytestmark = pytest.mark.gpu


def hopper() -> None:
    from llama.runtime.cuda import runtime
    if runtime().device.compute_capability() != (9, 0):
        pytest.skip("the wgmma rungs need sm_90a")


@pytest.fixture(params=list(RUNGS))
def version(request):
    hopper()
    return request.param


@pytest.fixture(params=[name for name, rung in RUNGS.items() if rung.splits_in_kernel])
def splitting_version(request):
    hopper()
    return request.param


@pytest.fixture(params=list(FP8_RUNGS))
def fp8_version(request):
    hopper()
    return request.param


@pytest.fixture
def gemm():
    from llama import ops
    return functools.partial(ops.gemm, versions=VERSIONS)


@pytest.fixture
def gemm_fp8():
    from llama import ops
    return functools.partial(ops.gemm_fp8, versions=FP8_VERSIONS)
