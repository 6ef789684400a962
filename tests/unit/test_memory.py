"""The memory check: the reference's estimate against what it allocates, what the host has (cgroup
limits included), the GPU branch through a stand-in for the driver, and models that allocate only
what they use."""

import tracemalloc
from dataclasses import replace

import numpy as np
import pytest

from llama.run import trainer
from llama.runtime import machine
from llama.config import get_preset
from llama.run.memory import gpu_training_buffers, reference_training_buffers, what_would_fit
from llama.runtime.machine import NotEnoughMemory, require
from llama.model.reference import ReferenceModel
from llama.optim import AdamWConfig
from llama.params import LoraSpec, count_parameters
from llama.run.plan import Plan, cpu_plan

GIB = 2**30


def peak_of_two_steps(config, B, T, recompute="none", optimizer="adamw", in_backward=False, **options) -> int:
    """tracemalloc's peak (numpy's allocations included) over building a model (with the plan's other options, e.g.
    adapters) and two steps."""
    rng = np.random.default_rng(0)
    batch = [(rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T)))]
    tracemalloc.start()
    try:
        model = ReferenceModel(config, cpu_plan(recompute=recompute, optimizer=optimizer, in_backward=in_backward,
                                                **options))
        for step in (1, 2):
            model.train_step(batch, 1e-3, step, AdamWConfig())
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("recompute, optimizer, in_backward", [
    ("none", "adamw", False), ("partial", "adamw", False), ("full", "adamw", False), ("none", "adamw8bit", False),
    ("full", "adamw8bit", False), ("none", "adamw", True), ("partial", "adamw8bit", True), ("full", "adamw8bit", True)])
@pytest.mark.parametrize("name, vocab, B, T", [
    ("small", 264, 4, 64),  # AdamW-bound
    pytest.param("small", 264, 32, 64, marks=pytest.mark.slow),  # activations
    pytest.param("small", 264, 2, 512, marks=pytest.mark.slow),  # attention
    ("tiny", 4096, 8, 64),  # logits
    ("untied", 4096, 2, 64),  # the head's gradient group
])
def test_reference_estimate_is_what_the_model_allocates(name, vocab, B, T, recompute, optimizer, in_backward):
    config = get_preset("small").replace(tie_embeddings=False) if name == "untied" else get_preset(name)
    config = config.replace(vocab_size=vocab)
    measured = peak_of_two_steps(config, B, T, recompute, optimizer, in_backward)
    estimated = sum(reference_training_buffers(config, B, T, recompute, optimizer, in_backward).values())
    assert 0.95 < estimated / measured < 1.2, (estimated, measured)


@pytest.mark.parametrize("options", [{"lora": 8}, {"lora": 8, "qlora": True}, {"lora": 8, "recompute": "full"},
                                     {"lora": 8, "optimizer": "adamw8bit"}, {"lora": 2, "lora_targets": "q,v"}])
@pytest.mark.parametrize("name, vocab, B, T", [
    ("small", 264, 1, 8),  # the base (and QLoRA's copy of it while the model is built)
    ("small", 264, 4, 64),  # activations
    ("untied", 4096, 1, 8),  # the head
])
def test_reference_estimate_with_adapters_is_what_the_model_allocates(name, vocab, B, T, options):
    config = get_preset("small").replace(tie_embeddings=False) if name == "untied" else get_preset(name)
    config, plan = config.replace(vocab_size=vocab), cpu_plan(**options)
    measured = peak_of_two_steps(config, B, T, **options)
    buffers = reference_training_buffers(config, B, T, plan.recompute, plan.optimizer, lora=plan.lora, qlora=plan.qlora)
    assert 0.95 < sum(buffers.values()) / measured < 1.2, (buffers, measured)
    full = reference_training_buffers(config, B, T, plan.recompute, plan.optimizer)
    assert buffers["fp32 adapter gradients"] < full["fp32 gradients"] / 10 and "fp32 weights" not in buffers


def test_require_says_what_is_needed_and_refuses_what_does_not_fit():
    assert require(GIB, 3 * GIB, "the run", "host") == "the run needs about 1.0 GiB of host memory, 3.0 GiB available"
    with pytest.raises(NotEnoughMemory, match="^the run needs at least 2.0 GiB of GPU memory, 1.0 GiB available; "
                                              "use less$"):
        require(2 * GIB, GIB, "the run", "GPU", advice="use less", lower_bound=True)
    assert require(2 * GIB, None, "x", "host").endswith("availability unknown")


def test_host_memory_counts_a_container_limit(tmp_path, monkeypatch):
    (tmp_path / "max").write_text(f"{GIB}\n")
    (tmp_path / "current").write_text(f"{GIB // 4}\n")
    monkeypatch.setattr(machine, "CGROUP_FILES", ((str(tmp_path / "max"), str(tmp_path / "current")),))
    assert machine._cgroup_room() == 3 * GIB // 4 and machine.host_available() <= 3 * GIB // 4
    (tmp_path / "max").write_text("max\n")  # no limit
    assert machine._cgroup_room() is None


def test_gpu_check_refuses_the_8b_model_on_80_gb_at_once(monkeypatch):
    """-e llama3.1-8b -b 1 -t 2048 on an 80 GB GPU: refused before 8B parameters are built on the host."""
    monkeypatch.setattr(trainer, "gpu_free", lambda: 79 * GIB)
    plan = Plan("cuda", "bf16", "GPU stand-in", recompute="partial")
    with pytest.raises(NotEnoughMemory, match=r"^the run needs at least 142.0 GiB of GPU memory, 79.0 GiB available; "
                                              r"--optimizer adamw8bit --optimizer-in-backward would fit$"):
        trainer.check_memory(plan, get_preset("llama3.1-8b"), 1, 2048, gpus=1)
    with pytest.raises(NotEnoughMemory, match=r"; --recompute full would fit$"):
        trainer.check_memory(plan, get_preset("llama3.2-1b"), 64, 2048, gpus=1)
    with pytest.raises(NotEnoughMemory, match=r"; -b 177 or --optimizer adamw8bit --optimizer-in-backward -b 208 would "
                                              r"fit \(-d keeps the tokens per step\)$"):
        trainer.check_memory(replace(plan, recompute="full"), get_preset("llama3.2-1b"), 512, 2048, gpus=1)
    line = trainer.check_memory(plan, get_preset("d12"), 16, 1024, gpus=1)
    assert line == "memory: the run needs at least 8.7 GiB of GPU memory, 79.0 GiB available"


def test_a_sample_on_several_gpus_counts_its_gathered_weights(monkeypatch):
    """Sampling on 2 GPUs gathers the full fp32 weights (Zero.gather_flat, one buffer) and rounds them to bf16 for
    the decoder: 6 bytes a parameter (and a bucket's padding) more per GPU; one GPU reads its weights in place."""
    monkeypatch.setattr(trainer, "gpu_free", lambda: 79 * GIB)
    plan, config = Plan("cuda", "bf16", "GPU stand-in", recompute="partial", zero=2), get_preset("llama3.2-1b")
    needed = lambda line: float(line.split("at least ")[1].split(" GiB")[0])  # noqa: E731
    for gpus, more in ((1, 0.0), (2, 6 * count_parameters(config) / GIB)):
        plain, sampling = (trainer.check_memory(plan, config, 8, 2048, gpus, sampling=s) for s in (False, True))
        assert needed(sampling) - needed(plain) == pytest.approx(more, abs=0.06)


@pytest.mark.parametrize("name, B, T, measured_gb", [("d12", 16, 1024, 9.6), ("llama3.2-1b", 8, 2048, 38.9)])
def test_gpu_buffers_add_up_to_the_memory_measured_in_use(name, B, T, measured_gb):
    """The bf16 model's buffers against the device memory its training step was measured to use on an H200
    (../shared/notes/performance.md: d12 9.6 GB, llama3.2-1b 38.9 GB, both with partial recompute), when the
    decay mask took a byte a weight (now a bit)."""
    buffers = gpu_training_buffers(get_preset(name), Plan("cuda", "bf16", "GPU stand-in", recompute="partial"), B, T)
    buffers["decay mask"] = count_parameters(get_preset(name))  # as measured
    assert round(sum(buffers.values()) / 1e9, 1) == measured_gb
    assert buffers["fp32 gradients"] == 4 * count_parameters(get_preset(name))


def test_8_bit_moments_and_full_recompute_fit_the_8b_model_on_one_h200():
    """2 bytes of moments a parameter (and a scale per 256) instead of 8; one (B, T, dim) input kept a layer."""
    config, P = get_preset("llama3.1-8b"), count_parameters(get_preset("llama3.1-8b"))
    plan = Plan("cuda", "bf16", "GPU stand-in", recompute="full", optimizer="adamw8bit")
    lean = gpu_training_buffers(config, plan, 4, 4096)
    assert lean["adamw8bit moments"] == 2 * P + 8 * -(-P // 256) + 4 * 4 * 256  # and the two quantization maps
    assert lean["activations (recompute full) x 32 layers"] == 32 * 4 * 4096 * 4096 * 2
    assert 80 * GIB < sum(lean.values()) < 140 * GIB
    assert what_would_fit(plan, config, 4, 4096, 1, 79 * GIB) == "--optimizer-in-backward would fit"
    assert what_would_fit(replace(plan, in_backward=True), config, 1, 4096, 1, 70 * GIB) == (
        "4 GPUs with --optimizer adamw without --optimizer-in-backward --zero 2 would fit (ZeRO-2 shards the master "
        "weights, moments and gradients)")


def test_the_optimizer_in_the_backward_fits_the_8b_model_on_an_80_gb_gpu():
    """Gradients a group at a time: the embedding's and one more group's (the untied head with the final
    norm), 4.2 GB instead of 32 GB."""
    config = get_preset("llama3.1-8b")
    plan = Plan("cuda", "bf16", "GPU stand-in", recompute="full", optimizer="adamw8bit")
    need = {i: gpu_training_buffers(config, replace(plan, in_backward=i), 1, 4096) for i in (False, True)}
    groups = 4 * (2 * config.vocab_size * config.dim + config.dim) + 8 * (config.n_layers + 2)  # and the norms
    assert need[True]["fp32 gradients (a group at a time)"] == groups
    assert sum(need[True].values()) == sum(need[False].values()) - need[False]["fp32 gradients"] + groups
    assert sum(need[True].values()) < 75 * GIB < 79 * GIB < sum(need[False].values())
    assert what_would_fit(replace(plan, in_backward=True), config, 64, 4096, 1, 79 * GIB).startswith("-b ")


def test_the_advice_names_the_cheapest_recipe_that_fits():
    config, plan = get_preset("small").replace(vocab_size=264), Plan("cpu", "fp32", "CPU")
    need = {(r, o, i): sum(reference_training_buffers(config, 32, 64, r, o, i).values())
            for r in ("none", "partial", "full") for o in ("adamw", "adamw8bit") for i in (False, True)}
    assert need["full", "adamw8bit", True] < need["full", "adamw", False] < need["partial", "adamw", False] \
        < need["none", "adamw", True] < need["none", "adamw", False]
    advice = lambda available, now=plan: what_would_fit(now, config, 32, 64, 1, available)
    assert advice(need["partial", "adamw", False]) == "--recompute partial would fit"
    assert advice(need["partial", "adamw", True]) == "--recompute partial --optimizer-in-backward would fit"
    assert advice(need["full", "adamw", False]) == "--recompute full would fit"
    assert advice(need["full", "adamw8bit", False]) == "--recompute full --optimizer adamw8bit would fit"
    assert advice(need["full", "adamw8bit", True] - 1).startswith("-b ")
    eight_bit = replace(plan, optimizer="adamw8bit")  # a recipe already chosen is not named again
    assert advice(need["partial", "adamw8bit", False], eight_bit) == "--recompute partial would fit"


def test_the_advice_never_keeps_more_than_the_runs_own_recipe():
    """Issue 63 item 16: 8B at -b 1 -t 2048 (recompute partial) was told --recompute none ..., which keeps more."""
    config, plan = get_preset("llama3.1-8b"), Plan("cuda", "bf16", "GPU stand-in", recompute="partial")
    assert what_would_fit(plan, config, 1, 2048, 1, 79 * GIB) == "--optimizer adamw8bit --optimizer-in-backward would fit"
    assert what_would_fit(plan, config, 1, 2048, 1, 140 * GIB) == "--optimizer-in-backward would fit"
    full = replace(plan, recompute="full")
    assert "--recompute" not in what_would_fit(full, config, 1, 2048, 1, 79 * GIB)


def test_the_advice_to_a_run_with_adapters_leaves_out_the_optimizer_in_the_backward():
    """--lora refuses --optimizer-in-backward (llama/run/plan.py choose_lora): the advice names another way."""
    plan = Plan("cuda", "bf16", "GPU stand-in", recompute="partial")
    advice = what_would_fit(plan, get_preset("llama3.1-8b"), 1, 2048, 1, 79 * GIB)
    assert "--optimizer-in-backward" in advice
    advice = what_would_fit(replace(plan, lora=LoraSpec(16)), get_preset("llama3.1-8b"), 1, 2048, 1, 79 * GIB)
    assert advice and "--optimizer-in-backward" not in advice
