"""The reference against transformers' LlamaForCausalLM with the same random weights (optional).

Skipped where torch or transformers is missing; its golden twin, tests/unit/test_golden_hf.py, needs neither.
Meta's q/k rows are permuted to HF's rotate-half layout on the way in and back on the way out.
"""

import numpy as np
import pytest

from llama.model import reference as ref
from llama.model.base import rope_frequencies
from llama.config import get_preset
from llama.io.hf import heads_of, hf_name, hf_to_meta
from llama.run.plan import cpu_plan
from tests.gradcheck import rel_error
from tests.hf_helpers import hf_model_of

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_gradients_match_transformers(tied):
    # a short original context, so that all three RoPE scaling branches are exercised
    config = get_preset("tiny").replace(dim=64, n_heads=4, n_kv_heads=2, vocab_size=101, tie_embeddings=tied,
                                        rope_original_context=64, rope_theta=10000.0)
    model = ref.ReferenceModel(config, cpu_plan(), dtype=np.float64, seed=7)
    model.params += 0.05 * np.random.default_rng(0).standard_normal(model.params.size)
    rng = np.random.default_rng(1)
    tokens, targets = rng.integers(0, 101, (2, 24)), rng.integers(0, 101, (2, 24))
    loss = model.forward(tokens, targets)
    logits = model.read_logits()
    model.backward()

    hf = hf_model_of(config, model.params)
    # HF computes RoPE frequencies and angles, RMSNorm and softmax in float32 even in a float64
    # model, so agreement stops near 1e-7: the tolerances below sit just above that floor
    np.testing.assert_allclose(hf.model.rotary_emb.inv_freq.numpy(), rope_frequencies(config), rtol=1e-6)
    hf_logits = hf(torch.tensor(tokens)).logits
    hf_loss = torch.nn.functional.cross_entropy(hf_logits.reshape(-1, 101), torch.tensor(targets).reshape(-1))
    hf_loss.backward()
    params = dict(hf.named_parameters())

    logit_err = rel_error(logits, hf_logits.detach().numpy())
    print(f"\ntied={tied} loss {loss:.12f} vs {hf_loss.item():.12f}; logits rel err {logit_err:.2e}")
    assert abs(loss - hf_loss.item()) < 1e-6
    assert logit_err < 1e-6
    worst, grads = 0.0, model.layout.views(model.grads)
    for name, g in grads.items():
        hg = params[hf_name(name)].grad.numpy()
        if heads_of(name, config):
            hg = hf_to_meta(hg, heads_of(name, config))
        worst = max(worst, rel_error(g, hg))
        assert rel_error(g, hg) < 1e-5, name
    print(f"worst gradient rel err over {len(grads)} tensors: {worst:.2e}")
