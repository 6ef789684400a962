"""The golden twins of the tests against transformers, without torch: our numpy reference and our HF import
and export against what transformers computed for the same tiny models (tests/data/golden/, recorded by
scripts/record_golden.py; see there for what each fixture holds). A missing fixture fails, naming the command
that records it."""

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from llama.data.tokenizer import Llama3Tokenizer
from llama.io.hf import heads_of, hf_name, hf_to_meta, load_hf_folder, save_hf_folder
from llama.model.base import rope_frequencies
from tests.gradcheck import rel_error
from tests.hf_helpers import (GOLDEN, GOLDEN_CHAT, GOLDEN_CONFIG, GOLDEN_EXPORT_VOCAB, GOLDEN_TEXT, RECORD_COMMAND,
                              fixture_paths, reference_forward, seeded_params, sha256)
from tests.sample_files import ranks_file_bytes

# transformers computes RoPE frequencies and angles, RMSNorm and softmax in float32 even in a float64 model, so
# agreement with our float64 reference stops near 1e-7 (the fixtures' float32 rounding adds 3e-8): the
# tolerances sit just above that floor
LOGITS_REL = 1e-6
LOSS_ABS = 1e-6
GRAD_REL = 1e-5
INV_FREQ_RTOL = 1e-6


def fixture(name: str, config) -> tuple[dict, dict]:
    """(facts, arrays) of a golden fixture recorded for `config` with weights from seeded_params."""
    facts_path, arrays_path = fixture_paths(name)
    if not (facts_path.is_file() and arrays_path.is_file()):
        pytest.fail(f"golden fixture {name} is missing from {GOLDEN}: record it where torch and transformers are "
                    f"installed, from the repository root: {RECORD_COMMAND}", pytrace=False)
    facts = json.loads(facts_path.read_text(encoding="utf-8"))
    made = ", ".join(f"{k} {v}" for k, v in facts["versions"].items())
    assert facts["config"] == dataclasses.asdict(config), f"{name} was recorded for another config; re-record it"
    assert facts["weights"]["sha256"] == sha256(seeded_params(config, facts["weights"]["seed"])), (
        f"seeded_params no longer draws the weights {name} was recorded with ({made}); re-record it")
    with np.load(arrays_path) as arrays:
        return facts, dict(arrays)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_loss_and_gradients_match_transformers(tied):
    config = GOLDEN_CONFIG.replace(tie_embeddings=tied)
    facts, golden = fixture(f"forward_backward_{'tied' if tied else 'untied'}", config)
    np.testing.assert_allclose(golden["inv_freq"], rope_frequencies(config), rtol=INV_FREQ_RTOL)
    model, loss = reference_forward(config, seeded_params(config), golden["tokens"], golden["targets"])
    assert abs(loss - facts["loss"]) < LOSS_ABS, (loss, facts["loss"])
    assert rel_error(model.read_logits(), golden["logits"]) < LOGITS_REL
    model.backward()
    grads = model.layout.views(model.grads)
    assert {f"grad.{hf_name(name)}" for name in grads} == {key for key in golden if key.startswith("grad.")}
    for name, grad in grads.items():
        hf_grad = golden[f"grad.{hf_name(name)}"]
        if heads_of(name, config):
            hf_grad = hf_to_meta(hf_grad, heads_of(name, config))
        assert rel_error(grad, hf_grad) < GRAD_REL, name


@pytest.mark.parametrize("dtype, tied", [("float32", False), ("bfloat16", True)])
def test_save_pretrained_folder_imports_with_transformers_logits(dtype, tied):
    config = GOLDEN_CONFIG.replace(tie_embeddings=tied)
    name = f"save_pretrained_{dtype}_{'tied' if tied else 'untied'}"
    facts, golden = fixture(name, config)
    assert sorted(p.name for p in (GOLDEN / name).iterdir()) == facts["files"]
    imported, params = load_hf_folder(GOLDEN / name)
    assert imported == config.replace(multiple_of=imported.multiple_of, ffn_dim_multiplier=imported.ffn_dim_multiplier)
    assert imported.ffn_hidden_dim == config.ffn_hidden_dim
    model, _ = reference_forward(imported, params, golden["tokens"])
    assert rel_error(model.read_logits(), golden["logits"]) < LOGITS_REL


@pytest.mark.parametrize("tied", [False, True])
def test_export_is_what_transformers_loaded(tmp_path, tied):
    """Our export writes the files transformers read when the fixture was recorded and the tensors it loaded;
    transformers' logits, stop ids and token ids of those files are our reference's and tokenizer's."""
    config = GOLDEN_CONFIG.replace(vocab_size=GOLDEN_EXPORT_VOCAB, tie_embeddings=tied)
    name = f"export_{'tied' if tied else 'untied'}"
    facts, golden = fixture(name, config)
    (tmp_path / "tokenizer.model").write_bytes(ranks_file_bytes())
    tokenizer = Llama3Tokenizer(tmp_path / "tokenizer.model")
    params = seeded_params(config)
    save_hf_folder(tmp_path / "out", config, params, "fp32", tokenizer)
    for file, digest in facts["files"].items():
        assert sha256((tmp_path / "out" / file).read_bytes()) == digest, (
            f"the export's {file} is not the one transformers read for {name}; re-record it to check the new one")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert {n: sha256(w) for n, w in tensors.items()} == facts["tensors"]
    model, _ = reference_forward(config, params, golden["tokens"])
    assert rel_error(model.read_logits(), golden["logits"]) < LOGITS_REL
    assert facts["eos_token_id"] == list(tokenizer.stop_ids)
    assert facts["text_ids"] == tokenizer.encode(GOLDEN_TEXT, bos=True)
    assert facts["chat_ids"] == tokenizer.encode_chat(GOLDEN_CHAT)
