"""The numpy reference fine-tuning through LoRA adapters (--lora) and on an NF4 base (--qlora): the adapters' gradients
against float64 finite differences, the base frozen (no gradient, no moments, the same bits after training), the
forward against the merged weights, QLoRA's base as NF4's round trip, and every memory recipe, the loss mask, the
document mask and gradient accumulation with adapters; the plan's refusals."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.io.peft import adapters_of, merge_adapters
from llama.model.generate import decoder_for
from llama.model.reference import ReferenceModel
from llama.optim import AdamWConfig
from llama.options import RunOptions
from llama.params import AdapterLayout, LoraSpec, ParameterLayout, init_adapters, init_parameters, quantized_base
from llama.run.plan import PlanError, cpu_plan, make_plan
from llama.twins import nf4
from tests.gradcheck import model_gradient_errors
from tests.unit.test_sft import one_step_whole_and_in_two

TOL = 1e-6
V, BOS = 23, 1
CONFIG = get_preset("tiny").replace(dim=16, n_heads=4, n_kv_heads=2, vocab_size=V)
SPEC = LoraSpec(4, alpha=8.0)
SOME = LoraSpec(2, alpha=3.0, targets=("q", "v", "up", "down"))  # splits the fused qkv and gate/up GEMMs


def base_weights(config=CONFIG, seed=1) -> np.ndarray:
    """Weights larger than the initialization's and norms that are not all 1, so that every path matters."""
    params = init_parameters(config, seed) * 5
    layout = ParameterLayout(config)
    for name in layout.norm_names():
        t = layout.tensors[name]
        params[t.offset:t.offset + t.size] = 1 + 0.3 * np.random.default_rng(2).standard_normal(t.size)
    return params


def lora_model(spec=SPEC, config=CONFIG, dtype=np.float64, random_b=True, params=None, **options) -> ReferenceModel:
    """The reference with adapters of spec on base_weights(); random_b: every B not 0 (so that dA flows)."""
    model = ReferenceModel(config, cpu_plan(lora=spec.rank, lora_alpha=spec.alpha, lora_targets=",".join(spec.targets),
                                            **options),
                           params=base_weights(config) if params is None else params, seed=3, dtype=dtype)
    if random_b:
        model.adapters[:] = np.random.default_rng(4).standard_normal(model.adapters.size) * 0.3
    return model


def batch(rng, B=2, T=6, vocab=V):
    return rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))


@pytest.mark.parametrize("qlora", [False, True])
@pytest.mark.parametrize("spec", [SPEC, SOME], ids=["all", "some"])
@pytest.mark.parametrize("tied", [False, True])
def test_adapter_gradients_against_finite_differences(qlora, spec, tied):
    model = lora_model(spec, CONFIG.replace(tie_embeddings=tied), qlora=qlora)
    rng = np.random.default_rng(5)
    errors = model_gradient_errors(model, *batch(rng), rng)
    assert set(errors) == set(AdapterLayout(model.config, spec).tensors)
    assert max(errors.values()) < TOL, errors


def test_adapter_gradients_with_the_document_mask_and_the_loss_mask():
    model = lora_model(doc_mask="on", bos_id=BOS)
    rng = np.random.default_rng(6)
    tokens, targets = batch(rng, T=9)
    tokens[:, [0, 4]] = BOS  # two documents a row
    targets[0, :3] = -1  # not counted
    errors = model_gradient_errors(model, tokens, targets, rng)
    assert max(errors.values()) < TOL, errors


def test_training_leaves_the_base_as_it_was_and_keeps_no_state_for_it():
    model = lora_model(dtype=np.float32, random_b=False)
    base = model.params.copy()
    layout = AdapterLayout(CONFIG, SPEC)
    assert model.grads.size == model.get_params().size == layout.size < ParameterLayout(CONFIG).size
    assert all(m.size == layout.size for m in model.get_optimizer_state())
    np.testing.assert_array_equal(model.get_params(), init_adapters(layout, 3))  # PEFT's: A uniform, B zero
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, V, (4, 17))
    losses = [model.train_step([(tokens[:, :-1], tokens[:, 1:])], 1e-2, step, AdamWConfig())[0]
              for step in range(1, 16)]
    assert losses[-1] < losses[0] - 0.5
    np.testing.assert_array_equal(model.params, base)
    np.testing.assert_array_equal(model.base_params(), base_weights())
    assert not np.array_equal(model.get_params(), init_adapters(layout, 3))


def test_fresh_adapters_leave_the_model_as_it_was_and_trained_ones_are_the_merged_weights():
    rng = np.random.default_rng(8)
    tokens, targets = batch(rng, T=12)
    plain = ReferenceModel(CONFIG, cpu_plan(), params=base_weights())
    fresh = lora_model(dtype=np.float32, random_b=False)
    assert fresh.forward(tokens, targets) == plain.forward(tokens, targets)
    np.testing.assert_array_equal(fresh.read_logits(), plain.read_logits())
    for spec in (SPEC, SOME):
        trained = lora_model(spec)
        trained.forward(tokens)
        layout = AdapterLayout(CONFIG, spec)
        merged = merge_adapters(base_weights(), CONFIG, spec, adapters_of(layout, trained.get_params()))
        reference = ReferenceModel(CONFIG, cpu_plan(), params=merged.astype(np.float64), dtype=np.float64)
        reference.forward(tokens)
        np.testing.assert_allclose(trained.read_logits(), reference.read_logits(), rtol=1e-6, atol=1e-6)


def test_qlora_base_is_each_linear_weight_s_nf4_round_trip():
    model = lora_model(dtype=np.float32, random_b=False, qlora=True)
    base, layout = base_weights(), ParameterLayout(CONFIG)
    np.testing.assert_array_equal(model.params, quantized_base(CONFIG, base))
    np.testing.assert_array_equal(model.base_params(), model.params)
    views, held = layout.views(base), layout.views(model.params)
    for name in views:
        if name.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight")):
            np.testing.assert_array_equal(held[name], nf4.dequantize(nf4.quantize(views[name])))
            assert not np.array_equal(held[name], views[name])
        else:  # the embedding and the norms
            np.testing.assert_array_equal(held[name], views[name])


@pytest.mark.parametrize("qlora", [False, True])
def test_every_recompute_gives_the_same_adapter_gradients_bit_for_bit(qlora):
    rng = np.random.default_rng(9)
    tokens, targets = batch(rng, T=10)
    grads = []
    for recompute in ("none", "partial", "full"):
        model = lora_model(SOME, dtype=np.float32, recompute=recompute, qlora=qlora)
        model.forward(tokens, targets)
        model.backward()
        grads.append(model.grads)
    for other in grads[1:]:
        np.testing.assert_array_equal(other, grads[0])


def test_accumulation_and_the_loss_mask_take_the_same_step():
    rng = np.random.default_rng(10)
    tokens, targets = batch(rng, B=4, T=8)
    targets[rng.random(targets.shape) < 0.4] = -1
    one, two, _, _ = one_step_whole_and_in_two(lora_model, tokens, targets)
    np.testing.assert_array_equal(one.params, two.params)
    np.testing.assert_array_equal(one.params, base_weights())


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_the_state_is_the_adapters_and_comes_back_exactly(optimizer):
    rng = np.random.default_rng(11)
    steps = [batch(rng, T=8) for _ in range(4)]
    straight, resumed = (lora_model(dtype=np.float32, optimizer=optimizer) for _ in range(2))
    for step, b in enumerate(steps[:2], 1):
        straight.train_step([b], 1e-3, step, AdamWConfig())
        resumed.train_step([b], 1e-3, step, AdamWConfig())
    snapshot = {name: array.copy() for name, array in resumed.download_state().items()}
    assert snapshot["params"].size == AdapterLayout(CONFIG, SPEC).size
    np.testing.assert_array_equal(snapshot["params"], resumed.get_params())
    resumed = lora_model(dtype=np.float32, optimizer=optimizer, random_b=False)
    resumed.set_state(snapshot["params"], *straight.get_optimizer_state())
    for step, b in enumerate(steps[2:], 3):
        assert straight.train_step([b], 1e-3, step, AdamWConfig()) == resumed.train_step([b], 1e-3, step, AdamWConfig())
    np.testing.assert_array_equal(straight.get_params(), resumed.get_params())


def test_the_decoder_of_a_model_with_adapters_computes_its_logits():
    model = lora_model(dtype=np.float32)
    tokens = np.random.default_rng(12).integers(0, V, (1, 7))
    model.forward(tokens)
    decoder = decoder_for(model, model.plan, max_len=16)
    np.testing.assert_allclose(decoder.forward(tokens), model.read_logits(position=-1), rtol=1e-5, atol=1e-5)
    model.adapters[:] = 0  # shared: the decoder sees the adapters as they are now
    decoder.reset()
    plain = ReferenceModel(CONFIG, cpu_plan(), params=base_weights())
    plain.forward(tokens)
    np.testing.assert_allclose(decoder.forward(tokens), plain.read_logits(position=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, message", [
    ({"lora": 4, "dtype": "fp8"}, "--dtype fp8 with --lora: on the CPU"),
    ({"lora": 4, "in_backward": True}, "--optimizer-in-backward with --lora"),
    ({"lora": 4, "lora_dropout": 0.1}, "--lora-dropout: only 0 trains for now"),
    ({"qlora": True}, "go with --lora RANK"),
    ({"lora": 4, "lora_targets": "q,x"}, "--lora: LoRA targets x: choose from"),
])
def test_the_plan_refuses_what_the_reference_s_adapters_do_not_run(options, message):
    with pytest.raises(PlanError, match=message):
        make_plan(CONFIG, RunOptions(device="cpu", **options))


def test_the_plan_s_line_names_the_adapters():
    plan = cpu_plan(lora=16, lora_targets="q,v", qlora=True)
    assert plan.lora == LoraSpec(16, 8.0, 0.0, ("q", "v")) and plan.qlora
    assert plan.summary().endswith("| lora r16 on 2 linears, base nf4")
