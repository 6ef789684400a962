"""A random transformers LlamaForCausalLM (GQA, llama3 RoPE scaling, tied and untied) saved with
save_pretrained, imported into our GPU model: the same logits. Needs a GPU, torch and transformers
(scripts/gpu_check.sh refuses to run without them, so that this test does not skip unseen there)."""

import copy

import numpy as np
import pytest

from llama.io.hf import load_hf_folder
from llama.options import RunOptions
from llama.run.plan import make_plan
from tests.gpu_helpers import ERRORS
from tests.gradcheck import rel_error
from tests.hf_helpers import TOKENS, hf_logits, random_hf_model

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_pretrained_imports_into_the_gpu_model(tmp_path, tied, dtype):
    from llama.model.gpu_fp32 import GPUModelFP32
    model = random_hf_model(tied)
    with torch.no_grad():  # the weights as stored; the transformers model stays float32
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(tmp_path, safe_serialization=True)
    config, params = load_hf_folder(tmp_path)
    gpu = GPUModelFP32(config, make_plan(config, RunOptions("cuda", "fp32")), (TOKENS.shape[0], TOKENS.shape[1]),
                       params=params)
    gpu.forward(TOKENS)
    err = rel_error(gpu.read_logits(), hf_logits(model, TOKENS))
    ERRORS.append((f"hf_import_gpu_logits[{dtype},tied={tied}]", err))
    assert np.isfinite(err) and err < 1e-5
