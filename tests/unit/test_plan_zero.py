"""The plan's ZeRO stage and gradient reduction on several GPUs (llama/run/plan.py, llama/run/memory.py): the
refusals, the summary, and the stage chosen from the memory a run needs."""

from dataclasses import replace

import pytest

from llama.config import get_preset
from llama.run.memory import choose_zero, gpu_training_buffers, what_would_fit, zero_buffers
from llama.options import RunOptions
from llama.run.plan import GemmChooser, Plan, PlanError, make_plan
from tests.unit.test_plan_attention import use_stand_in_gpu

GIB = 2**30
CONFIG = get_preset("llama3.1-8b")
FULL = Plan("cuda", "bf16", "GPU stand-in", recompute="full")


@pytest.mark.parametrize("options, message", [
    ({"zero": 4, "gpus": 2}, "--zero 4: choose from 1, 2, 3"),
    ({"zero": 2}, "--zero 2 shards over several GPUs"),
    ({"zero": 3, "gpus": 2, "dtype": "fp8"}, "take --zero 2"),
    ({"reduce_dtype": "bf16"}, "--reduce-dtype bf16"),
    ({"reduce_dtype": "bf16", "gpus": 2, "dtype": "fp32"}, "in fp32 on the exact path"),
    ({"reduce_dtype": "fp16", "gpus": 2}, "--reduce-dtype fp16"),
])
def test_refusals(options, message):
    with pytest.raises(PlanError, match=message):
        make_plan(CONFIG, RunOptions(**options))


def test_the_summary_names_the_stage_and_the_reduction():
    plan = Plan("cuda", "bf16", "GPU stand-in", GemmChooser(hopper=True), zero=3, reduce_dtype="bf16")
    assert plan.summary().endswith("| ZeRO-3 | bf16 reduce-scatter")
    assert "ZeRO" not in Plan("cuda", "bf16", "GPU stand-in", GemmChooser(hopper=True)).summary()


def test_each_stage_holds_less_and_the_plan_takes_the_lowest_that_fits():
    """8B on 2 GPUs, B=1 x T=8192, everything recomputed: stage 2 drops the full fp32 gradients (30 GB), stage 3
    the full bf16 weights (15 GB) for two layers' and the embedding's and head's."""
    plan = Plan("cuda", "bf16", "GPU stand-in", recompute="full")
    need = {z: sum(gpu_training_buffers(CONFIG, replace(FULL, zero=z), 1, 8192, 2).values()) for z in (1, 2, 3)}
    assert need[1] - need[2] > 20 * GIB and need[2] - need[3] > 10 * GIB
    assert [choose_zero(plan, CONFIG, 1, 8192, 2, room) for room in (need[1], need[2], need[3], need[3] - 1)] == [1, 2, 3, 3]
    assert what_would_fit(plan, CONFIG, 1, 8192, 2, need[2]) == "--zero 2 would fit"
    assert 79 * GIB < need[3] < 139 * GIB  # 8B at stage 3 fits two H200s, not two H100s
    with_bf16 = gpu_training_buffers(CONFIG, replace(FULL, zero=2, reduce_dtype="bf16"), 1, 8192, 2)
    fp32_scratch = 4 * zero_buffers(CONFIG, 2, 2)[3]  # a later micro-batch's fp32 reduction: bf16 adds as it widens
    assert fp32_scratch > 0 and zero_buffers(CONFIG, 2, 2, "bf16")[3] == 0
    assert sum(with_bf16.values()) - need[2] == with_bf16["bf16 reduction scratch"] - fp32_scratch


def test_bf16_reduction_is_refused_where_the_plan_falls_back_to_fp32(monkeypatch):
    """A model the bf16 kernels cannot take runs the exact fp32 path, whose reduce-scatter is fp32."""
    use_stand_in_gpu(monkeypatch)
    odd = get_preset("d12").replace(vocab_size=128257)  # not a whole number of bf16 vectors
    with pytest.raises(PlanError, match="in fp32 on the exact path"):
        make_plan(odd, RunOptions(gpus=2, reduce_dtype="bf16"))
    assert make_plan(get_preset("d12"), RunOptions(gpus=2, reduce_dtype="bf16")).reduce_dtype == "bf16"


def test_several_gpus_take_the_gemms_that_claim_their_tiles(monkeypatch):
    """On an H100 stand-in: one GPU runs GEMM versions 5/6, several their twins 8/7 (NCCL's kernels beside them);
    the FP8 GEMMs stay version 6."""
    use_stand_in_gpu(monkeypatch)
    config = get_preset("d12")
    assert make_plan(config, RunOptions(gpus=1)).gemm.name == "wgmma5/wgmma6"
    two = make_plan(config, RunOptions(gpus=2))
    assert two.gemm.name == "wgmma8/wgmma7" and "gemm wgmma8/wgmma7" in two.summary()
    assert make_plan(config, RunOptions(dtype="fp8", gpus=2)).fp8_gemm.name == "wgmma6"


def test_the_stage_comes_from_the_free_memory_the_ranks_share(monkeypatch):
    """make_plan takes the stage from free_memory when given (the trainer passes the least over the ranks, so
    that a rank with more room does not pick a lower stage than the others and wait on collectives they never
    issue), else from this GPU's free memory."""
    from llama.run import plan
    use_stand_in_gpu(monkeypatch)
    monkeypatch.setattr(plan, "gpu_free", lambda: 10**15)  # this GPU: room for anything
    need = {z: sum(gpu_training_buffers(CONFIG, replace(FULL, zero=z), 1, 8192, 2).values()) for z in (1, 2, 3)}
    options = dict(recompute="full", gpus=2, batch=(1, 8192))
    assert make_plan(CONFIG, RunOptions(**options)).zero == 1
    assert [make_plan(CONFIG, RunOptions(**options), free_memory=room).zero for room in (need[1], need[2], need[3])] == [1, 2, 3]
