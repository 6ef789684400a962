"""PEFT adapter folders (llama/io/peft.py): PEFT's file names, config keys and tensor names, the round trip, the
q/k permutation of B (merging in our layout then converting equals converting then merging in HF's), the
merge, the folder's atomic replacement and its guard, and PEFT's own logits where the golden fixture
(scripts/record_peft_golden.py) is recorded."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from llama.io import peft as peft_io
from llama.io.hf import ExportFolderError, hf_name, to_hf_state
from llama.io.peft import load_peft_adapter, merge_adapters, save_peft_adapter
from llama.params import LoraSpec
from llama.params import ParameterLayout
from tests.gradcheck import rel_error
from tests.hf_helpers import GOLDEN, GOLDEN_CONFIG, fixture_paths, reference_forward, seeded_params
from tests.peft_golden import PEFT_GOLDEN, PEFT_SPECS, RECORD_PEFT_COMMAND, golden_adapters

CONFIG = GOLDEN_CONFIG  # 4 query heads on 2 key/value heads: q's and k's permutations differ
ALL = LoraSpec(rank=4, alpha=8.0, dropout=0.05)


def test_peft_s_names_and_config(tmp_path):
    adapters = golden_adapters(ALL, CONFIG)
    written = save_peft_adapter(tmp_path / "out", CONFIG, ALL, adapters)
    assert sorted(p.name for p in written) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                                  "llama_cuda_export.json"]  # its record, last
    values = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert values["peft_type"] == "LORA" and values["task_type"] == "CAUSAL_LM" and values["bias"] == "none"
    assert (values["r"], values["lora_alpha"], values["lora_dropout"], values["use_rslora"]) == (4, 8.0, 0.05, False)
    assert values["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    tensors = load_file(tmp_path / "out" / "adapter_model.safetensors")
    expected = {f"base_model.model.model.layers.{i}.{module}.lora_{ab}.weight"
                for i in range(CONFIG.n_layers) for ab in "AB"
                for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(tensors) == expected and all(t.dtype == np.float32 for t in tensors.values())
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.lora_A.weight"].shape == (4, CONFIG.dim)
    assert tensors[f"{q}.lora_B.weight"].shape == (CONFIG.n_heads * CONFIG.head_dim, 4)


@pytest.mark.parametrize("spec", [ALL, LoraSpec(rank=2, alpha=16.0, targets=("q", "v"), use_rslora=True)])
def test_round_trip(tmp_path, spec):
    adapters = golden_adapters(spec, CONFIG)
    save_peft_adapter(tmp_path / "out", CONFIG, spec, adapters)
    loaded_spec, loaded = load_peft_adapter(tmp_path / "out", CONFIG)
    assert loaded_spec == spec and loaded.keys() == adapters.keys()
    for name, (a, b) in adapters.items():
        assert loaded[name][0].tobytes() == a.tobytes() and loaded[name][1].tobytes() == b.tobytes()


def test_b_of_q_and_k_is_permuted_a_is_not(tmp_path):
    """Merge in our layout then convert to HF's = convert the base to HF's, then merge PEFT's tensors as written:
    W_hf + scale * B_file @ A_file, for every targeted weight (q and k permuted, the rest not)."""
    spec = ALL
    params, adapters = seeded_params(CONFIG), golden_adapters(spec, CONFIG)
    merged_hf = to_hf_state(ParameterLayout(CONFIG).views(merge_adapters(params, CONFIG, spec, adapters)), CONFIG)
    base_hf = to_hf_state(ParameterLayout(CONFIG).views(params), CONFIG)
    save_peft_adapter(tmp_path / "out", CONFIG, spec, adapters)
    tensors = load_file(tmp_path / "out" / "adapter_model.safetensors")
    permuted = 0
    for name, (a, b) in adapters.items():
        a_name, b_name = peft_io.peft_names(name)
        expected = base_hf[hf_name(name)] + spec.scale * (tensors[b_name].astype(np.float64) @ tensors[a_name])
        np.testing.assert_allclose(merged_hf[hf_name(name)], expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(tensors[a_name], a)
        permuted += not np.array_equal(tensors[b_name], b)
    assert permuted == 2 * CONFIG.n_layers  # q's and k's B


def test_merge():
    """W + scale * B @ A on the targeted weights only, rounded once; the input is left alone; a fresh adapter
    (B = 0) changes nothing."""
    spec = LoraSpec(rank=2, alpha=16.0, targets=("v", "down"))
    params, adapters = seeded_params(CONFIG), golden_adapters(spec, CONFIG)
    before = params.copy()
    merged = merge_adapters(params, CONFIG, spec, adapters)
    np.testing.assert_array_equal(params, before)
    views, merged_views = ParameterLayout(CONFIG).views(params), ParameterLayout(CONFIG).views(merged)
    for name in views:
        if name in adapters:
            a, b = adapters[name]
            exact = views[name].astype(np.float64) + 8.0 * (b.astype(np.float64) @ a)
            np.testing.assert_array_equal(merged_views[name], exact.astype(np.float32))
        else:
            np.testing.assert_array_equal(merged_views[name], views[name])
    fresh = peft_io.init_adapters(CONFIG, spec, seed=0)
    np.testing.assert_array_equal(merge_adapters(params, CONFIG, spec, fresh), params)


def test_the_initial_adapters_sit_in_one_flat_buffer():
    """init_adapters draws each A at its offset in the adapters' flat buffer (llama/params.py AdapterLayout): a
    GEMM's A's stacked (q, k, v), then its B's, layer by layer; B is zero."""
    from llama.params import AdapterLayout
    from llama.twins.lora import uniforms
    spec = LoraSpec(rank=3, alpha=6.0, targets=("q", "k", "v", "up"))
    adapters = peft_io.init_adapters(CONFIG, spec, seed=4)
    assert list(adapters) == [f"layers.{i}.{w}.weight" for i in range(CONFIG.n_layers)
                              for w in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w3")]
    layout = AdapterLayout(CONFIG, spec)
    a_q, a_k = layout.tensors["layers.0.attention.wq.lora_A"], layout.tensors["layers.0.attention.wk.lora_A"]
    assert a_k.offset == a_q.offset + a_q.size  # stacked: one (3 r, dim) A for the fused qkv GEMM
    a = adapters["layers.0.attention.wk.weight"][0]
    np.testing.assert_array_equal(a.reshape(-1), (uniforms(4, a_k.offset, a.size) / np.sqrt(a.shape[1])).astype(np.float32))
    assert all(not b.any() for _, b in adapters.values())


def test_the_folder_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save_peft_adapter(out, CONFIG, ALL, golden_adapters(ALL, CONFIG))
    spec = LoraSpec(rank=2, alpha=4.0, targets=("o",))
    save_peft_adapter(out, CONFIG, spec, golden_adapters(spec, CONFIG))  # an earlier export is replaced
    assert load_peft_adapter(out, CONFIG)[0] == spec
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")
    monkeypatch.setattr(peft_io, "_write_safetensors", full_disk)
    with pytest.raises(OSError, match="No space"):
        save_peft_adapter(out, CONFIG, ALL, golden_adapters(ALL, CONFIG))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left beside it


def test_a_folder_of_other_files_is_refused(tmp_path):
    """A run, a model's export (its config.json is not an adapter's file) and a file stay as they were."""
    (tmp_path / "run" / "ckpt_00000010").mkdir(parents=True)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    adapters = golden_adapters(ALL, CONFIG)
    for out, message in ((tmp_path / "run", "a training run or a checkpoint"),
                         (tmp_path / "model", "files an export does not write \\(config.json\\)"),
                         (tmp_path / "file", "is a file")):
        with pytest.raises(ExportFolderError, match=message):
            save_peft_adapter(out, CONFIG, ALL, adapters)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["ckpt_00000010"]
    assert (tmp_path / "model" / "config.json").read_text() == "{}"


def test_wrong_adapters_and_folders_are_refused(tmp_path):
    adapters = golden_adapters(ALL, CONFIG)
    with pytest.raises(ValueError, match="missing"):
        save_peft_adapter(tmp_path / "out", CONFIG, ALL, dict(list(adapters.items())[1:]))
    with pytest.raises(ValueError, match="LoRA targets qq"):
        LoraSpec(rank=4, alpha=8.0, targets=("qq",))
    save_peft_adapter(tmp_path / "out", CONFIG, ALL, adapters)
    with pytest.raises(peft_io.PeftError, match="is it an adapter of this model"):
        load_peft_adapter(tmp_path / "out", CONFIG.replace(n_layers=CONFIG.n_layers + 1))
    with pytest.raises(peft_io.PeftError, match="are"):
        load_peft_adapter(tmp_path / "out", CONFIG.replace(dim=CONFIG.dim * 2))
    config_path = tmp_path / "out" / "adapter_config.json"
    for change, message in (({"use_dora": True}, "use_dora set"), ({"peft_type": "IA3"}, "only LoRA"),
                            ({"target_modules": "q_proj|v_proj"}, "a pattern"),
                            ({"target_modules": ["lm_head"]}, "lm_head")):
        values = json.loads(config_path.read_text())
        config_path.write_text(json.dumps(values | change))
        with pytest.raises(peft_io.PeftError, match=message):
            load_peft_adapter(tmp_path / "out", CONFIG)
        config_path.write_text(json.dumps(values))
    with pytest.raises(peft_io.PeftError, match="cannot read"):
        load_peft_adapter(tmp_path / "nowhere", CONFIG)


@pytest.mark.parametrize("name", PEFT_SPECS)
def test_peft_s_logits(name):
    """The golden twin of peft.PeftModel.from_pretrained(base, our folder): its logits are our reference's with
    the merged weights, and its merge_and_unload's q_proj and k_proj ours converted to HF's layout."""
    facts_path, arrays_path = fixture_paths(PEFT_GOLDEN)
    if not (facts_path.is_file() and arrays_path.is_file()):
        pytest.skip(f"the PEFT golden fixture is not recorded yet: record it where torch, transformers and peft are "
                    f"installed, from the repository root: {RECORD_PEFT_COMMAND}")
    facts = json.loads(facts_path.read_text(encoding="utf-8"))
    spec = PEFT_SPECS[name]
    assert facts["specs"][name]["spec"]["targets"] == list(spec.targets), f"{GOLDEN / PEFT_GOLDEN}: re-record it"
    with np.load(arrays_path) as arrays:
        golden = {key.split(".", 1)[1]: arrays[key] for key in arrays if key.startswith(f"{name}.")}
    merged = merge_adapters(seeded_params(CONFIG), CONFIG, spec, golden_adapters(spec))
    model, _ = reference_forward(CONFIG, merged, golden["tokens"])
    assert rel_error(model.read_logits().reshape(golden["logits"].shape), golden["logits"]) < 1e-6
    assert rel_error(golden["merged_logits"], golden["logits"]) < 1e-6
    hf = to_hf_state(ParameterLayout(CONFIG).views(merged), CONFIG)
    for module in ("q_proj", "k_proj"):
        np.testing.assert_allclose(golden[module], hf[f"model.layers.0.self_attn.{module}.weight"], rtol=1e-6,
                                   atol=1e-7)
    if facts["specs"][name]["scaling"] is not None:
        assert facts["specs"][name]["scaling"] == spec.scale
