"""kernels_for(plan) names every unit a training step and the sampler load (of the attention, the model's head dim's
alone): once build() ran, a step and a sample load only those units, and compile nothing."""

from dataclasses import replace

import numpy as np
import pytest

from llama.runtime import kernel_build
from llama.config import get_preset
from llama.runtime.cuda import runtime
from llama.model.generate import decoder_for, generate
from llama.runtime.kernel_build import build, kernels_for
from llama.model.sampling import Sampling
from llama.ops import common, flash_attention
from llama.optim import AdamWConfig
from llama.options import RunOptions
from llama.params import init_parameters
from llama.run.plan import fp8_unsupported, gemm_chooser, make_plan
from llama.model import build_model

pytestmark = pytest.mark.gpu
CONFIG = get_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=512, multiple_of=64,
                                    max_seq_len=96)
B, T = 2, 96


def no_compiling(unit):
    raise AssertionError(f"{unit.name} was compiled after the plan's build")


@pytest.mark.parametrize("dtype, dynamic", [("bf16", False), ("bf16", True), ("fp8", False), ("fp32", False)])
def test_a_step_and_a_sample_load_only_the_plans_units(monkeypatch, dtype, dynamic):
    if dtype == "fp8" and fp8_unsupported(CONFIG):
        pytest.skip(fp8_unsupported(CONFIG))
    rt = runtime()
    plan = make_plan(CONFIG, RunOptions("cuda", dtype))
    if dynamic:  # the GEMM versions of several GPUs, on this one
        plan = replace(plan, gemm=gemm_chooser(dynamic=True))
    units = kernels_for(plan, rt.code, decoder=True, head_dim=CONFIG.head_dim)  # the attention of its head dim only
    build(units)
    monkeypatch.setattr(kernel_build, "compile_unit", no_compiling)
    for loaded in ("modules", "cubins", "driver_modules"):  # this process's loads forgotten: all from the cache now
        monkeypatch.setattr(rt, loaded, {})
    monkeypatch.setattr(common, "_KERNELS", {})
    monkeypatch.setattr(flash_attention, "_FLASH_CONFIGS", {})
    rng = np.random.default_rng(0)
    model = build_model(CONFIG, plan, (B, T), init_parameters(CONFIG, 0))
    tokens = rng.integers(0, CONFIG.vocab_size, (2, B, T))
    model.train_step([(tokens[0], tokens[1])], 1e-3, 1, AdamWConfig())
    generate(decoder_for(model, plan, max_len=T), [1, 2, 3], 4, Sampling(seed=1))
    assert rt.modules and set(rt.modules) <= set(units), sorted(u.name for u in set(rt.modules) - set(units))
