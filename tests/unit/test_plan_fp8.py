"""--dtype fp8 in the plan and the memory check, without a GPU (a stand-in runtime): where the plan takes it,
the one line it refuses it with, and the FP8 buffers the memory check counts."""

import pytest

from llama.run import plan as plan_module
from llama.config import get_preset
from llama.run.memory import gpu_training_buffers
from llama.options import RunOptions
from llama.params import ParameterLayout
from llama.run.plan import Plan, PlanError
from tests.unit.test_plan_attention import use_stand_in_gpu


@pytest.fixture
def gpu(monkeypatch):
    return lambda capability, code: use_stand_in_gpu(monkeypatch, capability, code)


def test_fp8_runs_on_hopper_and_says_so(gpu):
    gpu((9, 0), "sm_90a")
    plan = plan_module.make_plan(get_preset("d12"), RunOptions(device="cuda", dtype="fp8"))
    assert (plan.path, plan.recompute) == ("fp8", "partial")
    assert "| dtype fp8 | gemm wgmma5/wgmma6 (FP8 e4m3 on wgmma6, row-wise scales, in the linear layers)," in (
        plan.summary())
    # version 6 for every FP8 shape, where the bf16 rule sends short K and the d768 weight gradients to version 5
    assert plan.fp8_gemm(16384, 768, 768) == plan.fp8_gemm(1280, 768, 16384) == "wgmma6"
    assert plan.gemm(16384, 768, 768) == plan.gemm(1280, 768, 16384) == "wgmma5"
    tensor = plan_module.make_plan(get_preset("d12"), RunOptions(device="cuda", dtype="fp8", fp8_scaling="tensor"))
    assert (tensor.path, tensor.fp8_scaling) == ("fp8", "tensor")
    assert "(FP8 e4m3 on wgmma6, tensor-wise scales, in the linear layers)" in tensor.summary()


@pytest.mark.parametrize("device, dtype, scaling, message", [
    ("cuda", "bf16", "tensor", "--fp8-scaling tensor: the scaling of --dtype fp8's casts, and this run's dtype is bf16"),
    ("cuda", None, "row", "--fp8-scaling row: the scaling of --dtype fp8's casts, and this run's dtype is not fp8"),
    ("cpu", "fp32", "tensor", "--fp8-scaling tensor: the scaling of --dtype fp8's casts, and this run's dtype is fp32"),
    ("cpu", "fp8", "column", "--fp8-scaling column: choose from row, tensor"),
])
def test_fp8_scaling_is_refused_in_one_line_without_fp8(gpu, device, dtype, scaling, message):
    gpu((9, 0), "sm_90a")
    with pytest.raises(PlanError, match=f"^{message}$"):
        plan_module.make_plan(get_preset("d12"), RunOptions(device=device, dtype=dtype, fp8_scaling=scaling))


def test_fp8_is_refused_in_one_line_where_it_cannot_run(gpu):
    gpu((8, 0), "sm_80")
    with pytest.raises(PlanError, match=r"^--dtype fp8: FP8 GEMMs are wgmma kernels for sm_90a \(Hopper\), this GPU "
                                        r"is sm_80$"):
        plan_module.make_plan(get_preset("d12"), RunOptions(device="cuda", dtype="fp8"))
    gpu((9, 0), "sm_90a")
    with pytest.raises(PlanError, match=r"^--dtype fp8: FP8 rows hold multiples of 16 values: ffn_hidden_dim 2072$"):
        plan_module.make_plan(get_preset("d12").replace(multiple_of=8, ffn_dim_multiplier=1.01), RunOptions(device="cuda",
                              dtype="fp8"))
    with pytest.raises(PlanError, match=r"^--dtype bf16 needs a CUDA GPU; the CPU reference computes in fp32 "
                                        r"\(or fp8's casts\)$"):
        plan_module.make_plan(get_preset("d12"), RunOptions(device="cpu", dtype="bf16"))


def test_on_the_cpu_fp8_is_the_reference_with_its_fp8_casts():
    from llama.model.reference import ReferenceModel
    from llama.model import build_model
    config = get_preset("tiny")
    plans = {dtype: plan_module.make_plan(config, RunOptions(device="cpu", dtype=dtype)) for dtype in (None, "fp32", "fp8")}
    assert [plan.dtype for plan in plans.values()] == ["fp32", "fp32", "fp8"]
    assert "| dtype fp8 | the numpy reference with FP8 casts (row-wise scales) in the linear layers |" in (
        plans["fp8"].summary())
    models = {dtype: build_model(config, plan, (2, 16)) for dtype, plan in plans.items()}
    assert all(isinstance(model, ReferenceModel) for model in models.values())
    assert [model.fp8 for model in models.values()] == [None, None, "row"]
    tensor = plan_module.make_plan(config, RunOptions(device="cpu", dtype="fp8", fp8_scaling="tensor"))
    assert "the numpy reference with FP8 casts (tensor-wise scales)" in tensor.summary()
    assert build_model(config, tensor, (2, 16)).fp8 == "tensor"


@pytest.mark.parametrize("name, B, T, measured_gb", [("d12", 16, 1024, 9.9), ("llama3.2-1b", 8, 2048, 41.5)])
def test_fp8_buffers_add_up_to_the_memory_measured_in_use(name, B, T, measured_gb):
    """The FP8 model's buffers against what its training step allocated on an H100 (scripts/bench_step.py
    --dtype fp8), when the decay mask took a byte a weight (now a bit): the bf16 model's, plus each linear
    weight's two FP8 casts and their scales, plus the casts' scratch."""
    config = get_preset(name)
    fp8, bf16 = (gpu_training_buffers(config, Plan("cuda", dtype, "GPU stand-in", recompute="partial"), B, T)
                 for dtype in ("fp8", "bf16"))
    byte_mask = ParameterLayout(config).size  # the decay mask as measured
    assert round((sum(fp8.values()) - fp8["decay mask"] + byte_mask) / 1e9, 1) == measured_gb
    assert {k: v for k, v in fp8.items() if not k.startswith("FP8")} == bf16
    matrices = sum(t.size for name_, t in ParameterLayout(config).tensors.items()
                   if name_.startswith("layers.") and len(t.shape) == 2)
    assert 2 * matrices < fp8["FP8 weight copies"] < 2.01 * matrices  # two casts of a byte each, and their scales
