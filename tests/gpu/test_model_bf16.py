"""The bf16 GPU model against the float64 reference, and its determinism: gradients of one step
tensor by tensor, bit-identical repeated runs, a captured step equal to an eager one, exact resume.

The reference runs on the same bf16-rounded weights and batch; the bf16 model then differs by its
bf16 activations and weight copies: each gradient within ‖g − ref‖ / ‖ref‖ <= 2e-2."""

import gc

import numpy as np
import pytest

from llama import ops
from llama.config import get_preset
from llama.runtime.cuda import BF16, zeros
from llama.optim import AdamWConfig
from llama.model.bf16_step import adamw
from llama.model.reference import ReferenceModel
from llama.options import RunOptions
from llama.run.plan import cpu_plan, make_plan
from tests.gradcheck import rel_error
from tests.gpu_helpers import ERRORS, one_step_losses

pytestmark = pytest.mark.gpu
CONFIG = get_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=512, multiple_of=64,
                                    max_seq_len=96)
OPT = AdamWConfig()


def batch(seed, B=3, T=80, vocab=512):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))


def bf16_params(config, seed):
    from llama.params import init_parameters
    return init_parameters(config, seed).astype(BF16).astype(np.float32)


def bf16_model(config, B, T, params, recompute="partial", optimizer="adamw", in_backward=False):
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.options import RunOptions
    from llama.run.plan import make_plan
    plan = make_plan(config, RunOptions("cuda", "bf16", recompute=recompute, optimizer=optimizer, in_backward=in_backward))
    return GPUModelBF16(config, plan, (B, T), params=params)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("recompute", ["partial", "none", "full"])
def test_one_step_gradients(tied, recompute):
    config = CONFIG.replace(tie_embeddings=tied)
    params = bf16_params(config, seed=5)
    cpu = ReferenceModel(config, cpu_plan(), params=params.astype(np.float64), dtype=np.float64)
    gpu = bf16_model(config, 4, 96, params, recompute)
    one_step_losses(cpu, gpu, *batch(1), "bf16_model")
    grads = gpu.grads.download()
    worst = ("", 0.0)
    for name, t in cpu.layout.tensors.items():
        err = rel_error(grads[t.offset:t.offset + t.size], cpu.grads[t.offset:t.offset + t.size])
        ERRORS.append((f"bf16_model_grad[{name}]", err))
        worst = max(worst, (name, err), key=lambda w: w[1])
        assert err < 2e-2, name
    print(f"\nbf16 gradients (tied={tied}, recompute={recompute}): worst {worst[0]} {worst[1]:.2e}")


def test_logits_without_targets():
    from llama.model.gpu_bf16 import GPUModelBF16
    params = bf16_params(CONFIG, seed=6)
    cpu = ReferenceModel(CONFIG, cpu_plan(), params=params.astype(np.float64), dtype=np.float64)
    gpu = GPUModelBF16(CONFIG, make_plan(CONFIG, RunOptions("cuda", "bf16")), (4, 96), params=params)
    tokens, _ = batch(2, B=2, T=33)
    cpu.forward(tokens)
    gpu.forward(tokens)
    err = rel_error(gpu.read_logits(position=32), cpu.read_logits(position=32))
    ERRORS.append(("bf16_model_logits", err))
    assert err < 2e-2
    full = gpu.read_logits()
    assert full.shape == (2, 33, CONFIG.vocab_size)
    rows, positions = np.array([0, 1, 1, 0, 1, 0]), np.array([32, 5, 0, 17, 32, 1])  # more rows than B: two gathers
    err = rel_error(gpu.read_logits(positions, rows=rows), full[rows, positions])
    ERRORS.append(("bf16_model_logits_of_rows", err))
    assert err < 1e-2


BATCHES = [batch(100 + i) for i in range(2)]  # two micro-batches per step, the same every step


def run_steps(model, steps, start=0):
    return [model.train_step(BATCHES, 1e-3, step + 1, OPT) for step in range(start, start + steps)]


@pytest.mark.parametrize("recompute, optimizer", [("partial", "adamw"), ("full", "adamw"), ("none", "adamw8bit")])
def test_runs_are_bit_identical_and_resume_is_exact(recompute, optimizer):
    """Step 1 runs eagerly and captures; later steps replay the graphs. Two runs agree bit for bit,
    and a model resumed after 3 steps (its first step eager again) reproduces steps 4-6, with each
    memory recipe (8-bit moments go through the checkpoint's fp32 moments and back)."""
    params = bf16_params(CONFIG, seed=7)
    a, b = (bf16_model(CONFIG, 3, 80, params, recompute, optimizer) for _ in range(2))
    losses_a, losses_b = run_steps(a, 6), run_steps(b, 3)
    assert losses_a[:3] == losses_b
    assert losses_a[-1][0] < losses_a[0][0] - 0.1  # it learns the two batches
    c = bf16_model(CONFIG, 3, 80, b.get_params(), recompute, optimizer)
    c.set_state(b.get_params(), *b.get_optimizer_state())
    assert run_steps(c, 3, start=3) == losses_a[3:]
    for x, y in zip((a.get_params(), *a.get_optimizer_state()), (c.get_params(), *c.get_optimizer_state())):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
    assert np.array_equal(a.params_bf16.download().view(np.uint16), c.params_bf16.download().view(np.uint16))


def test_captured_step_matches_the_eager_path():
    """The same step through train_step (graphs) and through forward/backward/optimizer_step."""
    from llama.model.gpu_bf16 import GPUModelBF16
    params = bf16_params(CONFIG, seed=8)
    a, b = (GPUModelBF16(CONFIG, make_plan(CONFIG, RunOptions("cuda", "bf16")), (3, 80),
                         params=params) for _ in range(2))
    run_steps(a, 2)  # the second step replays the captured graphs
    for step in range(2):
        b.zero_grad()
        for tokens, targets in BATCHES:
            b.forward(tokens, targets, loss_scale=0.5)
            b.backward()
        b.optimizer_step(1e-3, step + 1, OPT)
    assert np.array_equal(a.get_params().view(np.uint32), b.get_params().view(np.uint32))


@pytest.mark.parametrize("in_backward", [False, True])
def test_the_eager_step_gives_the_captured_steps_bits(in_backward):
    """eager_step (the benchmark's breakdown) runs train_step's launches without CUDA graphs: the same losses,
    norms and state, bit for bit, against steps that replay the captured graphs."""
    params = bf16_params(CONFIG, seed=11)
    captured, eager = (bf16_model(CONFIG, 3, 80, params, in_backward=in_backward) for _ in range(2))
    micro = BATCHES[:1] if in_backward else BATCHES  # the optimizer in the backward takes one micro-batch
    steps = [(micro, 1e-3, step, OPT) for step in (1, 2, 3)]  # the captured model replays from step 2
    assert [captured.train_step(*s) for s in steps] == [eager.eager_step(*s) for s in steps]
    assert not eager.step.graphs
    assert all(np.array_equal(x, y) for x, y in zip(state_bits(captured), state_bits(eager)))


@pytest.mark.parametrize("in_backward", [False, True])
def test_staging_the_next_batch_changes_no_bit(in_backward):
    """train_step's upcoming (the next step's first micro-batch staged while the step runs) gives the bits of
    steps without it; a forward in between (an evaluation), or a step on other arrays than the staged ones,
    uploads its own batch."""
    params = bf16_params(CONFIG, seed=10)
    a, b = (bf16_model(CONFIG, 3, 80, params, in_backward=in_backward) for _ in range(2))
    batches = [[batch(20 + i)] for i in range(4)]
    expected = [a.train_step(batches[i], 1e-3, i + 1, OPT) for i in range(4)]
    got = [b.train_step(batches[0], 1e-3, 1, OPT, upcoming=batches[1][0])]
    assert b.inputs.staged is batches[1][0]
    b.forward(*batch(30))  # an evaluation between steps
    got.append(b.train_step(batches[1], 1e-3, 2, OPT, upcoming=batches[3][0]))  # a wrong guess
    got.append(b.train_step(batches[2], 1e-3, 3, OPT, upcoming=batches[3][0]))
    got.append(b.train_step(batches[3], 1e-3, 4, OPT))
    assert got == expected
    assert np.array_equal(a.get_params().view(np.uint32), b.get_params().view(np.uint32))


def test_full_recompute_gives_the_same_gradients_bit_for_bit():
    """The backward runs each layer's forward again from its input: the same activations, so the same
    gradients as keeping everything (and as the partial recompute)."""
    params, (tokens, targets) = bf16_params(CONFIG, seed=9), batch(3)
    grads = {}
    for recompute in ("none", "partial", "full"):
        model = bf16_model(CONFIG, 3, 80, params, recompute)
        model.zero_grad()
        model.forward(tokens, targets, loss_scale=1.0)
        model.backward()
        grads[recompute] = model.grads.download().view(np.uint32)
    assert np.array_equal(grads["none"], grads["full"]) and np.array_equal(grads["none"], grads["partial"])


def test_an_8_bit_step_is_the_twins_update_of_its_gradients():
    """One captured-graph step with 8-bit moments against llama/optim.py's AdamW8bitState given the step's
    gradients and the device's clip factor: the same weights and moments, bit for bit."""
    from llama.optim import AdamW8bitState
    opt = AdamWConfig(grad_clip=0.5)  # the step is clipped
    params = bf16_params(CONFIG, seed=10)
    model, plain = bf16_model(CONFIG, 3, 80, params, optimizer="adamw8bit"), bf16_model(CONFIG, 3, 80, params)
    twin, expected = AdamW8bitState(params.size), params.copy()
    for step in (1, 2):
        _, norm = model.train_step(BATCHES, 1e-3, step, opt)
        grads = model.grads.download()[:params.size]
        norm_squared = np.float32(model.norm_squared.download()[0])
        scale = np.float32(opt.grad_clip) / np.sqrt(norm_squared) if np.sqrt(norm_squared) > opt.grad_clip else 1.0
        twin.update(expected, grads, model.layout.decay_mask(), step, 1e-3, opt, grad_scale=float(scale))
        assert np.array_equal(model.get_params().view(np.uint32), expected.view(np.uint32))
        plain_loss, plain_norm = plain.train_step(BATCHES, 1e-3, step, opt)
    for got, want in zip(model.get_optimizer_state(), twin.moments()):
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # and it trains like fp32 moments: the first step is the same update, the second close to it
    assert abs(plain_norm - norm) < 1e-2 * plain_norm


def state_bits(model):
    return [x.view(np.uint32) for x in (model.get_params(), *model.get_optimizer_state())]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_the_optimizer_in_the_backward_updates_what_the_plain_step_updates(optimizer, tied):
    """Unclipped, three steps give the plain step's weights and moments bit for bit: the same gradients,
    each group updated by the same kernel as soon as they are final (a tied head's in the embedding's)."""
    config, opt = CONFIG.replace(tie_embeddings=tied), AdamWConfig(grad_clip=0.0)
    params = bf16_params(config, seed=11)
    plain, inside = (bf16_model(config, 3, 80, params, optimizer=optimizer, in_backward=i) for i in (False, True))
    assert inside.zero.grads is None  # no whole gradient buffer
    for step in (1, 2, 3):
        (loss_a, norm_a), (loss_b, norm_b) = (m.train_step([BATCHES[step % 2]], 1e-3, step, opt) for m in (plain, inside))
        assert loss_a == loss_b and abs(norm_a - norm_b) < 1e-5 * norm_a  # the norm summed by group
        for a, b in zip(state_bits(plain), state_bits(inside)):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_the_optimizer_in_the_backward_clips_by_the_estimated_norm_and_resumes_exactly(optimizer):
    """Clipped, each group's update is the plain path's gradients' update of that group by the norm
    estimated from this step's group norms so far and the last step's (ops.clip_norm_estimate), bit for
    bit. A model resumed after two steps with the checkpoint's group norms reproduces steps 3 and 4."""
    opt = AdamWConfig(grad_clip=0.05)  # below every norm: every update is clipped
    params = bf16_params(CONFIG, seed=12)
    inside, plain = (bf16_model(CONFIG, 3, 80, params, optimizer=optimizer, in_backward=i) for i in (True, False))
    groups = inside.step.groups
    current, last = zeros(len(groups)), zeros(len(groups))
    steps = []
    for step in (1, 2, 3, 4):
        batch = BATCHES[step % 2]
        steps.append(inside.train_step([batch], 1e-3, step, opt))
        plain.zero_grad()
        plain.forward(*batch, loss_scale=1.0)  # the whole gradients, then the groups from the last
        plain.backward()
        plain.inputs.set_scalars(1e-3, step, opt)
        for g in reversed(range(len(groups))):
            grads = plain.zero.grads.view(groups[g][0], (groups[g][1] - groups[g][0],))
            ops.global_norm_squared_bf16(current.view(g, (1,)), plain.norm_scratch, grads)
            ops.clip_norm_estimate(plain.norm_squared, current, last, g)
            adamw(plain, groups[g][0], grads, opt)
        last.copy_from(current)
        assert steps[-1][1] == float(np.sqrt(plain.norm_squared.download()[0])) > 0.05
        assert all(np.array_equal(x, y) for x, y in zip(state_bits(inside), state_bits(plain)))
        if step == 2:
            resumed = bf16_model(CONFIG, 3, 80, inside.get_params(), optimizer=optimizer, in_backward=True)
            resumed.set_state(inside.get_params(), *inside.get_optimizer_state())
            resumed.group_norms_squared = inside.group_norms_squared
    assert inside.group_norms_squared == last.download().tolist()
    assert [resumed.train_step([BATCHES[s % 2]], 1e-3, s, opt) for s in (3, 4)] == steps[2:]
    assert all(np.array_equal(x, y) for x, y in zip(state_bits(inside), state_bits(resumed)))


@pytest.mark.parametrize("options", [dict(dtype="bf16"), dict(dtype="bf16", recompute="full", optimizer="adamw8bit"),
                                     dict(dtype="fp8"), dict(dtype="bf16", in_backward=True), dict(dtype="fp32")])
def test_the_memory_accounting_is_what_the_model_allocates_on_the_device(options):
    """llama/run/memory.py's buffers against the device memory a model's construction allocated (empty(), which
    every buffer of ours comes from), to the byte."""
    from llama.model import build_model
    from llama.run.memory import training_buffers
    from llama.runtime.cuda import allocated_bytes, runtime
    if options["dtype"] == "fp8" and runtime().code != "sm_90a":
        pytest.skip("FP8 GEMMs need sm_90a")
    plan = make_plan(CONFIG, RunOptions("cuda", **options))
    gc.collect()  # what earlier tests left to the collector goes now, not while this model is built
    before = allocated_bytes()
    model = build_model(CONFIG, plan, (3, 80), bf16_params(CONFIG, seed=3))
    assert allocated_bytes() - before == sum(training_buffers(plan, CONFIG, 3, 80).values())
    del model
