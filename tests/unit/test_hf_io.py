"""Hugging Face folders in and out (CPU): configs of Meta's models, HF-named safetensors made here
with the safetensors library, export -> import round trips, and one-line errors for bad folders."""

import json
import os
import stat

import numpy as np
import pytest
from safetensors.numpy import save_file

from llama.config import get_preset
from llama.runtime.cuda import BF16
from llama.io.hf import HFError, config_from_hf, config_to_hf, hf_tokenizer_path, load_hf_folder, save_hf_folder
from llama.runtime.machine import NotEnoughMemory
from llama.model.base import apply_rope_scaling, rope_frequencies
from llama.params import ParameterLayout, init_parameters
from llama.data.tokenizer import Llama3Tokenizer
from tests.sample_files import ranks_file_bytes

LLAMA3_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
# config.json of meta-llama/Llama-3.2-1B as published (transformers 4.x style)
LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
              "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
              "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
              "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
              "rms_norm_eps": 1e-05, "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256}
LLAMA32_3B = {**LLAMA32_1B, "head_dim": 128, "hidden_size": 3072, "num_attention_heads": 24, "num_hidden_layers": 28}
LLAMA31_8B = {**LLAMA32_1B, "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "tie_word_embeddings": False, "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}}


@pytest.mark.parametrize("values, preset", [(LLAMA32_1B, "llama3.2-1b"), (LLAMA32_3B, "llama3.2-3b"),
                                            (LLAMA31_8B, "llama3.1-8b")])
def test_meta_configs_come_out_as_the_presets(values, preset):
    assert config_from_hf(values) == get_preset(preset)
    # transformers 5 writes rope_parameters, with rope_theta inside, instead of rope_scaling + rope_theta
    v5 = {k: v for k, v in values.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**values["rope_scaling"], "rope_theta": 500000.0}
    assert config_from_hf(v5) == get_preset(preset)


def test_config_without_rope_scaling_and_with_odd_ffn_width():
    values = {**LLAMA32_1B, "rope_scaling": None, "rope_theta": 10000.0, "intermediate_size": 1000,
              "hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": None}
    config = config_from_hf(values)
    assert (config.use_scaled_rope, config.rope_theta, config.ffn_hidden_dim, config.head_dim) == (False, 1e4, 1000, 24)


def hf_permute(w, heads):
    """Meta's interleaved rows -> HF's halves, per head, written out: HF row j < D/2 is Meta row
    2j and HF row D/2 + j is Meta row 2j + 1."""
    D = w.shape[0] // heads
    rows = [h * D + r for h in range(heads) for r in [*range(0, D, 2), *range(1, D, 2)]]
    return w[rows]


def hf_state(config, params):
    """HF-named tensors of our flat parameters, built by hand (not with llama.io.hf)."""
    p = ParameterLayout(config).views(params)
    state = {"model.embed_tokens.weight": p["tok_embeddings.weight"], "model.norm.weight": p["norm.weight"]}
    if not config.tie_embeddings:
        state["lm_head.weight"] = p["output.weight"]
    names = {"attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
             "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(config.n_layers):
        state[f"model.layers.{i}.self_attn.q_proj.weight"] = hf_permute(p[f"layers.{i}.attention.wq.weight"], config.n_heads)
        state[f"model.layers.{i}.self_attn.k_proj.weight"] = hf_permute(p[f"layers.{i}.attention.wk.weight"],
                                                                         config.n_kv_heads)
        for meta, hf in names.items():
            state[f"model.layers.{i}.{hf}.weight"] = p[f"layers.{i}.{meta}.weight"]
    return state


CONFIG = get_preset("tiny").replace(dim=48, n_heads=4, n_kv_heads=2, n_layers=3, vocab_size=90, max_seq_len=128,
                                    rope_scale_factor=32.0, rope_original_context=32)


def hf_config_json(config):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.dim,
            "intermediate_size": config.ffn_hidden_dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
            "vocab_size": config.vocab_size, "rms_norm_eps": config.norm_eps, "max_position_embeddings": config.max_seq_len,
            "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32}}


def write_fixture(folder, config, params, dtype, shards=1):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config_json(config)))
    state = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in hf_state(config, params).items()}
    if shards == 1:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: state[k] for k in part}, folder / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def random_params(config, seed=0):
    params = init_parameters(config, seed)
    params += np.random.default_rng(seed).standard_normal(params.size).astype(np.float32) * 0.1  # norms too
    return params


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_fixture_imports_to_the_right_config_and_weights(tmp_path, tied, dtype, shards):
    config = CONFIG.replace(tie_embeddings=tied)
    params = random_params(config)
    write_fixture(tmp_path / "hf", config, params, dtype, shards)
    read = []
    got_config, got = load_hf_folder(tmp_path / "hf", on_tensor=read.append)
    assert sum(read) == got.size and len(read) == len(ParameterLayout(config).tensors)  # the progress it reports
    # the FFN width is what HF stores; multiple_of and the multiplier are ours to choose
    assert got_config.ffn_hidden_dim == config.ffn_hidden_dim
    assert got_config.replace(multiple_of=config.multiple_of, ffn_dim_multiplier=config.ffn_dim_multiplier) == config
    assert got.dtype == np.float32 and np.array_equal(got, params.astype(dtype).astype(np.float32))


@pytest.mark.parametrize("tied", [False, True])
def test_export_then_import_is_the_identity(tmp_path, tied):
    config = get_preset("d6").replace(n_layers=2, vocab_size=517, tie_embeddings=tied)
    params = random_params(config, seed=1)
    (tmp_path / "tokenizer.model").write_bytes(ranks_file_bytes())
    tokenizer = Llama3Tokenizer(tmp_path / "tokenizer.model")
    written = save_hf_folder(tmp_path / "fp32", config, params, "fp32", tokenizer)
    assert {p.name for p in written} >= {"config.json", "generation_config.json", "model.safetensors",
                                         "tokenizer.json", "tokenizer_config.json"}
    got_config, got = load_hf_folder(tmp_path / "fp32")
    assert got_config == config and np.array_equal(got, params)
    assert Llama3Tokenizer(hf_tokenizer_path(tmp_path / "fp32")).ranks == tokenizer.ranks
    generation = json.loads((tmp_path / "fp32" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [262, 269, 270]
    # bf16, in shards of at most 200 kB
    written = save_hf_folder(tmp_path / "bf16", config, params, "bf16", max_shard_bytes=200_000)
    shards = [p for p in written if p.name.startswith("model-")]
    assert len(shards) > 2 and (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "bf16" / "tokenizer.json").exists()
    got_config, got = load_hf_folder(tmp_path / "bf16")
    assert got_config == config and np.array_equal(got, params.astype(BF16).astype(np.float32))


def test_exported_weights_have_the_mode_of_the_other_files(tmp_path):
    """The safetensors library writes 0600; the export's weights are as readable as its config (0644
    under the usual umask)."""
    old_umask = os.umask(0o022)
    try:
        written = save_hf_folder(tmp_path / "out", CONFIG, random_params(CONFIG), "bf16", max_shard_bytes=20_000)
    finally:
        os.umask(old_umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in written} == {0o644}
    assert sum(p.suffix == ".safetensors" for p in written) > 1


@pytest.mark.parametrize("name", ["llama3.2-1b", "llama3.1-8b", "d12", "small", "tiny"])
def test_preset_configs_survive_export(name):
    config = get_preset(name)
    assert config_from_hf(config_to_hf(config, "bfloat16")) == config


def test_config_json_names_the_transformers_layout_it_is_written_in():
    """transformers 5 reads a local config.json without transformers_version as a possible Mistral one and warns
    about the tokenizer (tests/unit/test_hf_transformers.py loads one); ours is 4.x's layout, both rope keys."""
    values = config_to_hf(get_preset("d12"), "bfloat16")
    assert values["model_type"] == "llama" and values["transformers_version"].startswith("4.")


@pytest.mark.parametrize("name", ["d12", "small", "tiny"])
def test_exported_rope_context_is_below_the_model_context_with_the_same_frequencies(name):
    """transformers warns when original_max_position_embeddings >= max_position_embeddings (8192 against
    small's 512): the export writes the same scaling with the context and both factors halved."""
    config = get_preset(name)
    values = config_to_hf(config, "bfloat16")
    for rope in (values["rope_scaling"], values["rope_parameters"]):
        assert rope["original_max_position_embeddings"] < values["max_position_embeddings"] == config.max_seq_len
    rope = values["rope_scaling"]
    written = config.replace(rope_original_context=rope["original_max_position_embeddings"],
                             rope_low_freq_factor=rope["low_freq_factor"],
                             rope_high_freq_factor=rope["high_freq_factor"])
    assert written != config and np.array_equal(rope_frequencies(written), rope_frequencies(config))
    for dtype in (np.float32, np.float64):  # transformers computes them in float32
        theta = config.rope_theta ** -(np.arange(0, config.head_dim, 2, dtype=dtype) / dtype(config.head_dim))
        args = [(c.rope_scale_factor, c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_context)
                for c in (written, config)]
        assert np.array_equal(apply_rope_scaling(theta, *args[0]), apply_rope_scaling(theta, *args[1]))


def break_config(folder, **changes):
    values = json.loads((folder / "config.json").read_text())
    values.update(changes)
    (folder / "config.json").write_text(json.dumps(values))


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "config.json").unlink(), "has no config.json"),
    (lambda f: (f / "config.json").write_text("{oops"), "cannot read .*config.json"),
    (lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors"),
    (lambda f: break_config(f, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
    (lambda f: break_config(f, architectures=["MistralForCausalLM"], model_type="mistral"),
     "MistralForCausalLM \\(mistral\\) is not supported; only LlamaForCausalLM"),
    (lambda f: break_config(f, rope_scaling="llama3", rope_parameters=None), "rope_scaling = 'llama3' is not a JSON"),
    (lambda f: break_config(f, architectures="GPT2LMHeadModel", model_type="gpt2"),
     "GPT2LMHeadModel \\(gpt2\\) is not supported"),
    (lambda f: break_config(f, attention_bias=True), "attention_bias = True is not supported"),
    (lambda f: break_config(f, head_dim=64), "head_dim 64 differs"),
    (lambda f: break_config(f, num_hidden_layers=4), "missing tensor model.layers.3.input_layernorm.weight"),
    (lambda f: break_config(f, num_hidden_layers=2), "unexpected tensor model.layers.2"),
    (lambda f: break_config(f, intermediate_size=64), "has shape \\(128, 48\\), expected \\(64, 48\\)"),
    (lambda f: break_config(f, hidden_size=50), "dim \\(50\\) must be divisible by n_heads"),
    (lambda f: break_config(f, vocab_size=None), "config.json: missing vocab_size"),
    (lambda f: break_config(f, rms_norm_eps="small"), "rms_norm_eps = 'small' is not a number"),
])
def test_bad_folders_fail_in_one_line(tmp_path, damage, message):
    write_fixture(tmp_path / "hf", CONFIG, random_params(CONFIG), np.float32)
    damage(tmp_path / "hf")
    with pytest.raises(HFError, match=message) as e:
        load_hf_folder(tmp_path / "hf")
    assert "\n" not in str(e.value)


def test_a_config_too_big_for_this_machine_is_refused_before_allocating(tmp_path):
    write_fixture(tmp_path / "hf", CONFIG, random_params(CONFIG), np.float32)
    break_config(tmp_path / "hf", hidden_size=2**20, intermediate_size=2**22, num_hidden_layers=1000,
                 num_attention_heads=2**16, num_key_value_heads=2**16, head_dim=None)
    with pytest.raises(NotEnoughMemory, match=r"^the [\d,]+ parameters of .*hf needs about [\d,.]+ PiB of host memory, "
                                              r"[\d,.]+ [GMT]iB available$"):
        load_hf_folder(tmp_path / "hf")


def test_bad_shards_and_dtypes(tmp_path):
    folder = tmp_path / "hf"
    write_fixture(folder, CONFIG, random_params(CONFIG), np.float32, shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HFError, match="lists model-00002-of-00002.safetensors, which is missing"):
        load_hf_folder(folder)
    folder = tmp_path / "hf8"
    write_fixture(folder, CONFIG, random_params(CONFIG), np.int8)
    with pytest.raises(HFError, match="is I8; only F32, BF16 and F16"):
        load_hf_folder(folder)
    with pytest.raises(HFError, match="is not a folder"):
        load_hf_folder(tmp_path / "nothing")


def test_tokenizer_beside_the_weights(tmp_path):
    assert hf_tokenizer_path(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    assert hf_tokenizer_path(tmp_path).name == "tokenizer.json"
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(ranks_file_bytes())
    assert hf_tokenizer_path(tmp_path) == tmp_path / "original" / "tokenizer.model"
