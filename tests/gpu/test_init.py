"""The random initialization on the GPU (kernels/init.cu) against its numpy twin (llama/twins/init.py):
bit-equal values. Both compute Box-Muller in float64 from correctly rounded +, -, *, / and sqrt alone
(polynomials instead of log and sincos, no fused multiply-adds), then round once to fp32, so there is no
last-bit difference to allow for; a GPU model built without params holds exactly init_parameters."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.runtime.cuda import BF16, empty
from llama.params import ParameterLayout, init_parameters
from llama.twins.init import standard_normals
from tests.gpu_helpers import ERRORS

pytestmark = pytest.mark.gpu
CONFIG = get_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=512, multiple_of=64,
                                    max_seq_len=96)


@pytest.mark.parametrize("start, n, seed, std", [
    (0, 1 << 22, 0, 1.0),  # 4M values: every branch of the transform many times over
    (3, 1001, 5, 0.02),  # starts and ends inside a Philox block
    ((1 << 34) + 1, 4099, (1 << 40) + 7, 0.0025),  # offsets and seeds past 32 bits
    (6, 1, 2, 0.02),
])
def test_kernel_equals_the_twin_bit_for_bit(start, n, seed, std):
    from llama.ops import init_normal
    out = empty(n)
    init_normal(out, start, seed, std)
    got = out.download()
    expected = (standard_normals(seed, start, n) * std).astype(np.float32)
    mismatched = int(np.count_nonzero(got.view(np.uint32) != expected.view(np.uint32)))
    ERRORS.append((f"init_normal mismatched values of {n}", float(mismatched)))
    assert mismatched == 0


@pytest.mark.parametrize("tied", [False, True])
def test_fill_parameters_is_init_parameters(tied, monkeypatch):
    from llama import ops
    config = CONFIG.replace(tie_embeddings=tied)
    layout = ParameterLayout(config)
    expected = init_parameters(config, seed=9)
    out = empty(layout.size)
    counted = []
    ops.fill_parameters(out, layout, 9, on_values=counted.append)
    assert np.array_equal(out.download(), expected) and sum(counted) == layout.size
    part = empty(12345)  # a slice that cuts tensors, as a ZeRO shard or a chunk does
    ops.fill_parameters(part, layout, 9, start=54321)
    assert np.array_equal(part.download(), expected[54321:54321 + 12345])
    monkeypatch.setattr("llama.ops.init.HOST_CHUNK", 10_000)  # chunks that cut tensors
    assert np.array_equal(ops.init_parameters_on_gpu(layout, 9), expected)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_model_without_params_draws_init_parameters(dtype):
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.model.gpu_fp32 import GPUModelFP32
    from llama.options import RunOptions
    from llama.run.plan import make_plan
    expected = init_parameters(CONFIG, seed=4)
    if dtype == "bf16":
        model = GPUModelBF16(CONFIG, make_plan(CONFIG, RunOptions("cuda", "bf16")), (2, 64), seed=4)
        assert np.array_equal(model.params_bf16.download()[:expected.size].astype(np.float32),
                              expected.astype(BF16).astype(np.float32))
    else:
        model = GPUModelFP32(CONFIG, make_plan(CONFIG, RunOptions("cuda", "fp32")), (2, 64), seed=4)
    assert np.array_equal(model.get_params(), expected)
    rms = np.sqrt(np.mean(expected.astype(np.float64) ** 2))
    assert model.weights_rms() == pytest.approx(rms, rel=1e-5)
