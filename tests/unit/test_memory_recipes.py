"""The memory recipes on the numpy reference (llama/model/reference.py): recompute gives the plain path's
gradients bit for bit, and AdamW with 8-bit moments trains like AdamW and resumes exactly."""

from dataclasses import replace

import numpy as np
import pytest

from llama.config import get_preset
from llama.model.reference import ReferenceModel
from llama.options import RECOMPUTE
from llama.optim import QUANT_BLOCK, AdamWConfig, clip_norm_estimate, clip_scale, global_norm, squared_norm
from llama.run.plan import PlanError, choose_recipe, cpu_plan

CONFIG = get_preset("tiny").replace(dim=32, n_heads=4, n_kv_heads=2, vocab_size=61)


def _batches(steps: int, micro: int = 1, B: int = 2, T: int = 12, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [[(rng.integers(0, CONFIG.vocab_size, (B, T)), rng.integers(0, CONFIG.vocab_size, (B, T)))
             for _ in range(micro)] for _ in range(steps)]


def _train(model: ReferenceModel, batches, first_step: int = 1) -> list[float]:
    return [model.train_step(micro, 3e-3, step, AdamWConfig())[0] for step, micro in enumerate(batches, first_step)]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("recompute", [r for r in RECOMPUTE if r != "none"])
def test_recompute_gives_the_same_gradients_bit_for_bit(recompute, tied):
    config = CONFIG.replace(tie_embeddings=tied)
    plain = ReferenceModel(config, cpu_plan(), seed=1)
    recomputing = ReferenceModel(config, cpu_plan(recompute=recompute), seed=1)
    for (tokens, targets), in _batches(1):
        assert plain.forward(tokens, targets) == recomputing.forward(tokens, targets)
    plain.backward(0.5)
    recomputing.backward(0.5)
    np.testing.assert_array_equal(recomputing.grads, plain.grads)
    for model in (plain, recomputing):  # and after two steps of two micro-batches each
        _train(model, _batches(2, micro=2, seed=1))
    np.testing.assert_array_equal(recomputing.params, plain.params)


@pytest.mark.parametrize("recompute, kept", [("none", 13), ("partial", 10), ("full", 1)])
def test_recompute_keeps_less_of_each_layer(recompute, kept):
    model = ReferenceModel(CONFIG, cpu_plan(recompute=recompute))
    model.forward(*_batches(1)[0][0])
    assert [len(a) for a in model.acts["layers"]] == [kept] * CONFIG.n_layers
    assert recompute != "full" or list(model.acts["layers"][0]) == ["x"]


def test_unknown_recipes_are_refused():
    with pytest.raises(ValueError, match="--recompute some: the numpy reference runs none or partial or full"):
        ReferenceModel(CONFIG, cpu_plan(recompute="some"))
    with pytest.raises(ValueError, match="--optimizer sgd: the numpy reference runs adamw or adamw8bit"):
        ReferenceModel(CONFIG, cpu_plan(optimizer="sgd"))
    with pytest.raises(ValueError, match="the numpy reference runs a CPU plan on one process"):
        ReferenceModel(CONFIG, replace(cpu_plan(), device="cuda"))


def test_adamw8bit_trains_like_adamw():
    batches = _batches(1, B=4, seed=2) * 40  # one batch learnt by heart
    plain = _train(ReferenceModel(CONFIG, cpu_plan()), batches)
    eight = _train(ReferenceModel(CONFIG, cpu_plan(optimizer="adamw8bit")), batches)
    assert eight[-1] < eight[0] - 0.5  # it learns
    assert abs(np.mean(eight[-10:]) - np.mean(plain[-10:])) < 0.02, (eight[-10:], plain[-10:])


def test_adamw8bit_resumes_bit_exact_through_fp32_moments():
    batches = _batches(6, seed=3)
    straight = ReferenceModel(CONFIG, cpu_plan(optimizer="adamw8bit"))
    _train(straight, batches)
    first = ReferenceModel(CONFIG, cpu_plan(optimizer="adamw8bit"))
    _train(first, batches[:3])
    resumed = ReferenceModel(CONFIG,
                             cpu_plan(optimizer="adamw8bit"))  # what a checkpoint holds: fp32 params and moments
    resumed.set_state(first.get_params(), *first.get_optimizer_state())
    _train(resumed, batches[3:], first_step=4)
    np.testing.assert_array_equal(resumed.params, straight.params)


def test_each_path_runs_its_recipes_and_refuses_the_others_in_one_line():
    assert choose_recipe("cpu", None, None) == {"recompute": "none", "optimizer": "adamw", "in_backward": False}
    assert choose_recipe("bf16", None, None) == {"recompute": "partial", "optimizer": "adamw", "in_backward": False}
    assert choose_recipe("cpu", "full", "adamw8bit", True) == {"recompute": "full", "optimizer": "adamw8bit",
                                                               "in_backward": True}
    assert choose_recipe("bf16", "full", "adamw8bit") == {"recompute": "full", "optimizer": "adamw8bit",
                                                          "in_backward": False}
    with pytest.raises(PlanError, match="^--recompute full: the fp32 GPU model runs none; the CPU "
                                        "reference runs every recipe$"):
        choose_recipe("fp32", "full", None)
    assert choose_recipe("bf16", None, "adamw8bit", gpus=2)["optimizer"] == "adamw8bit"  # ZeRO shards whole blocks
    with pytest.raises(PlanError, match="^--optimizer adamw8bit: the fp32 GPU model runs adamw;"):
        choose_recipe("fp32", None, "adamw8bit")
    assert choose_recipe("bf16", None, None, True)["in_backward"]
    with pytest.raises(PlanError, match="^--optimizer-in-backward: the fp32 GPU model updates after the backward;"):
        choose_recipe("fp32", None, None, True)
    with pytest.raises(PlanError, match="^--optimizer-in-backward runs on one GPU"):
        choose_recipe("bf16", None, None, True, gpus=2)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("optimizer, recompute", [("adamw", "none"), ("adamw8bit", "full")])
def test_optimizer_in_backward_updates_what_the_plain_step_updates(optimizer, recompute, tied):
    """Unclipped, the same bits after several steps: groups of any size (the tied model's last is its 32
    norm weights), blocks cut by group boundaries updated once, whole."""
    config, unclipped = CONFIG.replace(tie_embeddings=tied), AdamWConfig(grad_clip=0.0)
    plain = ReferenceModel(config, cpu_plan(optimizer=optimizer), seed=4)
    fused = ReferenceModel(config, cpu_plan(recompute=recompute, optimizer=optimizer, in_backward=True), seed=4)
    assert fused.grads is None and any((end - start) % 256 for start, end in fused.groups)
    for step, micro in enumerate(_batches(4, seed=5), 1):
        loss, norm = plain.train_step(micro, 3e-3, step, unclipped)
        assert fused.train_step(micro, 3e-3, step, unclipped) == (loss, pytest.approx(norm, rel=1e-9))
        np.testing.assert_array_equal(fused.params, plain.params)
    for mine, theirs in zip(fused.get_optimizer_state(), plain.get_optimizer_state()):
        np.testing.assert_array_equal(mine, theirs)


def test_clip_norm_estimate():
    previous, current = np.array([4.0, 1.0, 2.0, 1.0]), np.array([np.nan, 3.0, 4.0, 3.0])  # groups 1-3 finished
    assert clip_norm_estimate(current, previous, 1) == 10.0 + 4.0
    assert clip_norm_estimate(current, previous, 3) == 3.0 + 7.0
    assert clip_norm_estimate(current, np.zeros(4), 2) == 7.0  # the first step: the finished groups alone
    assert clip_norm_estimate(np.array([5.0, *current[1:]]), previous, 0) == 15.0  # the last group: the step's norm


def test_optimizer_in_backward_clips_by_the_estimated_norm():
    """Each update is clipped by clip_norm_estimate of this step's group norms so far and the last step's;
    the last group's by this step's norm. The twin: the plain path's gradients, the groups updated from the
    last, whole blocks at a time."""
    opt = AdamWConfig(grad_clip=0.05)  # below every norm here: each step is clipped
    plain, fused = ReferenceModel(CONFIG, cpu_plan(), seed=6), ReferenceModel(CONFIG, cpu_plan(in_backward=True),
                                                                              seed=6)
    last = np.zeros(len(fused.groups))
    for step, micro in enumerate(_batches(3, seed=7), 1):
        plain.zero_grad()
        plain.forward(*micro[0])
        plain.backward()
        current, estimates, frontier = np.zeros(len(fused.groups)), [], plain.layout.size
        for g, (start, end) in reversed(list(enumerate(fused.groups))):
            current[g] = squared_norm(plain.grads[start:end])
            first = -(-start // QUANT_BLOCK) * QUANT_BLOCK
            if first < frontier:  # a block cut by the group's start waits for the next group
                estimates.append(np.sqrt(clip_norm_estimate(current, last, g)))
                done = slice(first, frontier)
                plain.optimizer.update(plain.params[done], plain.grads[done], plain.decay_mask[done], step, 3e-3,
                                       opt, grad_scale=clip_scale(estimates[-1], opt.grad_clip), start=first)
                frontier = first
        norm, last = global_norm(plain.grads), current
        assert estimates[-1] == pytest.approx(norm, rel=1e-12) and max(abs(e / norm - 1) for e in estimates) > 0.01
        assert fused.train_step(micro, 3e-3, step, opt)[1] == pytest.approx(norm, rel=1e-12)
        np.testing.assert_array_equal(fused.params, plain.params)
    assert fused.group_norms_squared == last.tolist()
    resumed = ReferenceModel(CONFIG, cpu_plan(in_backward=True), params=fused.params)
    assert resumed.group_norms_squared == [0.0] * len(fused.groups)
    resumed.set_state(fused.params, *fused.get_optimizer_state())
    resumed.group_norms_squared = fused.group_norms_squared
    for step, micro in enumerate(_batches(2, seed=8), 4):
        assert resumed.train_step(micro, 3e-3, step, opt) == fused.train_step(micro, 3e-3, step, opt)
    np.testing.assert_array_equal(resumed.params, fused.params)


def test_optimizer_in_backward_takes_one_micro_batch_and_runs_inside_a_step():
    model = ReferenceModel(CONFIG, cpu_plan(in_backward=True))
    with pytest.raises(ValueError, match="takes one micro-batch a step, got 2"):
        model.train_step(_batches(1, micro=2)[0], 1e-3, 1, AdamWConfig())
    model.forward(*_batches(1)[0][0])
    with pytest.raises(RuntimeError, match="runs inside train_step"):
        model.backward()
