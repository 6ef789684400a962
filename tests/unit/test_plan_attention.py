"""The plan runs the wgmma flash attention (ladder v6's forward at D = 64, v3's otherwise; TMA maps) on Hopper and the mma.sync build (v2) on other
GPUs; checked without a GPU through a stand-in runtime."""

from types import SimpleNamespace

import pytest

from llama.run import plan as plan_module
from llama.config import get_preset
from llama.options import RunOptions


def use_stand_in_gpu(monkeypatch, capability=(9, 0), code="sm_90a"):
    """The plan sees one GPU of this compute capability and build code (an H100's by default), no CUDA needed."""
    device = SimpleNamespace(compute_capability=lambda: capability)
    monkeypatch.setattr(plan_module, "runtime", lambda: SimpleNamespace(name="NVIDIA Test GPU", code=code,
                                                                         device=device))
    monkeypatch.setattr(plan_module, "cuda_unavailable", lambda: None)


@pytest.mark.parametrize("capability, code, module, tma, name", [
    ((9, 0), "sm_90a", "flash_attention_wgmma", True, "flash v6 (wgmma + TMA)"),
    ((8, 0), "sm_80", "flash_attention", False, "flash v2 (mma.sync)"),
])
def test_attention_build_per_gpu(monkeypatch, capability, code, module, tma, name):
    use_stand_in_gpu(monkeypatch, capability, code)
    plan = plan_module.make_plan(get_preset("d12"), RunOptions(device="cuda"))
    assert (plan.attention.module, plan.attention.tma, plan.attention_name) == (module, tma, name)
    assert f"attention {name}" in plan.summary()
