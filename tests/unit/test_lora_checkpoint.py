"""Checkpoints of a run with LoRA adapters (llama/io/checkpoint.py): the adapters, their moments and the base's
identity, read back with their LoraSpec and layout; and the base's identity (llama/io/lora_base.py): the same weights
in other files are the same base, other weights or another config are not, and the merge refuses a changed base."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from llama.config import get_preset
from llama.io.checkpoint import (MODEL, STATE, CheckpointError, checkpoint_pieces, load_checkpoint, lora_state,
                                 read_state, save_checkpoint)
from llama.io.hf import save_hf_folder
from llama.io.lora_base import base_identity, base_init, merged_weights, read_base, weights_digest
from llama.io.peft import adapters_of, merge_adapters
from llama.params import AdapterLayout, LoraSpec, ParameterLayout, init_parameters, quantized_base
from tests.unit.test_checkpoint_stream import STATE as RUN_STATE
from tests.unit.test_checkpoint_stream import random_state

CONFIG = get_preset("tiny").replace(vocab_size=264)
SPEC = LoraSpec(4, alpha=16.0, targets=("q", "v", "down"))


def lora_checkpoint(tmp_path, base: dict, qlora: bool = False, quantized: bool = False, step: int = 1):
    """A checkpoint of random adapters of SPEC and their moments, with base (state.json's "base")."""
    adapters, m, v = random_state(AdapterLayout(CONFIG, SPEC).size, step, quantized)
    state = RUN_STATE | {"lora": lora_state(SPEC), "qlora": qlora, "base": base}
    tmp_path.mkdir(exist_ok=True)
    return save_checkpoint(tmp_path, step, CONFIG, adapters, m, v, state), adapters


@pytest.mark.parametrize("quantized", [False, True])
def test_a_checkpoint_holds_the_adapters_and_reads_back_their_spec(tmp_path, quantized):
    folder, adapters = lora_checkpoint(tmp_path, base_identity(CONFIG, None, 0, None), quantized=quantized)
    loaded = load_checkpoint(folder)
    layout = AdapterLayout(CONFIG, SPEC)
    assert loaded["lora"] == SPEC and loaded["quantized"] == quantized
    assert set(load_file(folder / MODEL)) == set(layout.tensors)  # the adapters alone, by their names
    np.testing.assert_array_equal(loaded["params"], adapters)
    assert (loaded["adam_m"].codes if quantized else loaded["adam_m"]).size == layout.size
    pieces = checkpoint_pieces(load_checkpoint(folder, read=False))
    assert sum(n for _, _, n, name, _ in pieces if name == "params") == 4 * layout.size


def test_a_bad_lora_spec_in_state_json_is_one_line(tmp_path):
    folder, _ = lora_checkpoint(tmp_path, base_identity(CONFIG, None, 0, None))
    state = json.loads((folder / STATE).read_text())
    for key, value, message in (("rank", 0, "is 0, expected at least 1"), ("targets", ["q", "x"], "LoRA targets x"),
                                ("use_rslora", 1, "is not true or false")):
        (folder / STATE).write_text(json.dumps(state | {"lora": state["lora"] | {key: value}}))
        with pytest.raises(CheckpointError, match=message):
            read_state(folder)
    (folder / STATE).write_text(json.dumps({key: value for key, value in state.items() if key != "base"}))
    with pytest.raises(CheckpointError, match="lacks 'base', the identity of its adapters' base"):
        read_state(folder)


def test_the_digest_is_of_the_weights_not_of_their_files(tmp_path):
    params = init_parameters(CONFIG, 4)
    save_hf_folder(tmp_path / "fp32", CONFIG, params, "fp32")
    save_hf_folder(tmp_path / "sharded", CONFIG, params, "fp32", max_shard_bytes=100_000)
    digests = {weights_digest(*read_base(base_init(f"hf:{tmp_path / name}"))) for name in ("fp32", "sharded")}
    assert digests == {weights_digest(CONFIG, params)}
    for tensor in ParameterLayout(CONFIG).tensors.values():  # every tensor is sampled: its first value counts
        changed = params.copy()
        changed[tensor.offset] += 1
        assert weights_digest(CONFIG, changed) != weights_digest(CONFIG, params), tensor.name
    assert weights_digest(CONFIG.replace(rope_theta=10000.0), params) != weights_digest(CONFIG, params)
    assert base_identity(CONFIG, None, 3, None) == {"init": None, "seed": 3, "digest": "seed 3"}


@pytest.mark.parametrize("qlora", [False, True])
def test_the_merge_reads_the_base_again_and_refuses_a_changed_one(tmp_path, qlora):
    params = init_parameters(CONFIG, 4)
    save_hf_folder(tmp_path / "base", CONFIG, params, "fp32")
    init = base_init(f"hf:{tmp_path / 'base'}")
    folder, adapters = lora_checkpoint(tmp_path / "run", base_identity(CONFIG, init, 0, params), qlora)
    loaded = load_checkpoint(folder)
    held = quantized_base(CONFIG, params) if qlora else params
    expected = merge_adapters(held, CONFIG, SPEC, adapters_of(AdapterLayout(CONFIG, SPEC), adapters))
    np.testing.assert_array_equal(merged_weights(loaded), expected)
    save_hf_folder(tmp_path / "base", CONFIG, init_parameters(CONFIG, 5), "fp32")
    with pytest.raises(CheckpointError, match="its adapters were trained on hf:.*base, which has changed since"):
        merged_weights(loaded)
    seeded, _ = lora_checkpoint(tmp_path / "seeded", base_identity(CONFIG, None, 7, None), qlora)
    merged = merge_adapters(quantized_base(CONFIG, init_parameters(CONFIG, 7)) if qlora else init_parameters(CONFIG, 7),
                            CONFIG, SPEC, adapters_of(AdapterLayout(CONFIG, SPEC), load_checkpoint(seeded)["params"]))
    np.testing.assert_array_equal(merged_weights(load_checkpoint(seeded)), merged)
