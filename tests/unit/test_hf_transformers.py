"""Import and export against transformers itself (optional: skipped where torch or transformers is
missing; the golden twins in tests/unit/test_golden_hf.py need neither): a random LlamaForCausalLM saved
with save_pretrained imports with the same logits, and our export loads with from_pretrained /
AutoTokenizer with the same logits and token ids."""

import copy
import logging

import numpy as np
import pytest

from llama.io.hf import load_hf_folder, save_hf_folder
from llama.data.tokenizer import Llama3Tokenizer, default_tokenizer_path
from llama.params import ParameterLayout
from llama.model.reference import ReferenceModel
from llama.run.plan import cpu_plan
from tests.gradcheck import rel_error
from tests.hf_helpers import CONFIG, TOKENS, hf_logits, random_hf_model, reference_forward
from tests.sample_files import ranks_file_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
REAL_TOKENIZER = default_tokenizer_path()  # read at collection, as tests/unit/test_tokenizer.py does


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_pretrained_imports_with_the_same_logits(tmp_path, tied, dtype):
    model = random_hf_model(tied)
    with torch.no_grad():  # the weights as stored (the model itself stays float32, RoPE tables included)
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(tmp_path, safe_serialization=True)
    config, params = load_hf_folder(tmp_path)
    assert config == CONFIG.replace(tie_embeddings=tied, multiple_of=config.multiple_of,
                                    ffn_dim_multiplier=config.ffn_dim_multiplier)
    err = rel_error(reference_forward(config, params, TOKENS)[0].read_logits(), hf_logits(model, TOKENS))
    print(f"\ntied={tied} {dtype}: logits rel err {err:.2e}")
    assert err < 1e-6  # HF computes RoPE angles in float32 even in a float64 model


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers(tmp_path, tied):
    config = CONFIG.replace(tie_embeddings=tied)
    params = ReferenceModel(config, cpu_plan(), seed=3).params
    params += 0.05 * np.random.default_rng(0).standard_normal(params.size).astype(np.float32)
    (tmp_path / "tokenizer.model").write_bytes(ranks_file_bytes())
    tokenizer = Llama3Tokenizer(tmp_path / "tokenizer.model")
    save_hf_folder(tmp_path / "out", config, params, "fp32", tokenizer)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    err = rel_error(reference_forward(config, params, TOKENS)[0].read_logits(), hf_logits(model, TOKENS))
    print(f"\ntied={tied}: logits rel err {err:.2e}")
    assert err < 1e-6
    assert model.generation_config.eos_token_id == list(tokenizer.stop_ids)

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "the thin line: ünïcödé 日本語 🦙\r\n  tabs\tand 12345"
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text, bos=True)
    messages = [{"role": "system", "content": "the thin line"}, {"role": "user", "content": "hi"}]
    chat = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if not isinstance(chat, list) else chat
    assert chat == tokenizer.encode_chat(messages)


@pytest.mark.skipif(not REAL_TOKENIZER.exists(), reason="Meta's tokenizer.model is not in the user's cache")
def test_the_exported_llama3_tokenizer_loads_without_the_mistral_warning(tmp_path):
    """transformers 5 takes a local folder's tokenizer of over 100k tokens for a possible Mistral one, and warns
    that its split pattern is wrong, unless config.json names the transformers that wrote it; the warning's
    advice (fix_mistral_regex=True) would change our tokens."""
    tokenizer = Llama3Tokenizer(REAL_TOKENIZER)
    config = CONFIG.replace(vocab_size=128256)
    save_hf_folder(tmp_path / "out", config, np.zeros(ParameterLayout(config).size, np.float32), "bf16", tokenizer)
    warnings, handler = [], logging.Handler()
    handler.emit = warnings.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [w.getMessage() for w in warnings if "mistral" in w.getMessage().lower()]
    text = "the thin line: ünïcödé 日本語 🦙\r\n  tabs\tand 12345 HTTPServer's"
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text, bos=True)
