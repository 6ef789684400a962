"""The whole GPU model against the float64 reference on a small GQA config."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.optim import AdamWConfig
from llama.model.reference import ReferenceModel
from llama.options import RunOptions
from llama.run.plan import cpu_plan, make_plan
from tests.gradcheck import rel_error
from tests.gpu_helpers import ERRORS

pytestmark = pytest.mark.gpu
CONFIG = get_preset("tiny").replace(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=300, max_seq_len=64)


def batch(seed, B=3, T=37, vocab=300):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))


@pytest.mark.parametrize("tied", [False, True])
def test_loss_and_every_gradient(tied):
    from llama.model.gpu_fp32 import GPUModelFP32
    config = CONFIG.replace(tie_embeddings=tied)
    cpu = ReferenceModel(config, cpu_plan(), dtype=np.float64, seed=3)
    gpu = GPUModelFP32(config, make_plan(config, RunOptions("cuda", "fp32")), (4, 40),
                       params=cpu.params.astype(np.float32))
    tokens, targets = batch(0)
    cpu_loss = cpu.forward(tokens, targets)
    gpu.zero_grad()
    gpu_loss = gpu.forward(tokens, targets)
    ERRORS.append(("model_loss_abs", abs(gpu_loss - cpu_loss)))
    assert abs(gpu_loss - cpu_loss) < 1e-5
    cpu.backward(loss_scale=0.5)
    gpu.backward(loss_scale=0.5)
    grads = gpu.grads.download()
    for name, t in cpu.layout.tensors.items():
        err = rel_error(grads[t.offset:t.offset + t.size], cpu.grads[t.offset:t.offset + t.size])
        ERRORS.append((f"model_grad[{name}]", err))
        assert err < 1e-4, name
    # the same step again gives bit-identical gradients (deterministic kernels)
    gpu.zero_grad()
    gpu.forward(tokens, targets)
    gpu.backward(loss_scale=0.5)
    assert np.array_equal(gpu.grads.download(), grads)


def test_smaller_batch_and_logits():
    from llama.model.gpu_fp32 import GPUModelFP32
    cpu = ReferenceModel(CONFIG, cpu_plan(), dtype=np.float64, seed=4)
    gpu = GPUModelFP32(CONFIG, make_plan(CONFIG, RunOptions("cuda", "fp32")), (4, 40),
                       params=cpu.params.astype(np.float32))
    tokens, _ = batch(1, B=1, T=9)
    cpu.forward(tokens)
    gpu.forward(tokens)
    err = rel_error(gpu.read_logits(), cpu.read_logits())
    ERRORS.append(("model_logits", err))
    assert err < 1e-5
    with pytest.raises(ValueError, match="b <= 4, t <= 40"):
        gpu.forward(np.zeros((5, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="outside"):
        gpu.forward(np.full((1, 3), 300))


def test_ten_adamw_steps_match_reference():
    from llama.model.gpu_fp32 import GPUModelFP32
    cpu = ReferenceModel(CONFIG, cpu_plan(), dtype=np.float64, seed=5)
    gpu = GPUModelFP32(CONFIG, make_plan(CONFIG, RunOptions("cuda", "fp32")), (3, 37),
                       params=cpu.params.astype(np.float32))
    opt = AdamWConfig(grad_clip=1.0, weight_decay=0.1)
    worst = 0.0
    for step in range(1, 11):
        tokens, targets = batch(100 + step)
        cpu.zero_grad()
        gpu.zero_grad()
        cpu_loss, gpu_loss = cpu.forward(tokens, targets), gpu.forward(tokens, targets)
        cpu.backward()
        gpu.backward()
        cpu_norm, gpu_norm = cpu.optimizer_step(3e-3, step, opt), gpu.optimizer_step(3e-3, step, opt)
        assert abs(gpu_norm - cpu_norm) / cpu_norm < 1e-4
        worst = max(worst, abs(gpu_loss - cpu_loss))
        assert abs(gpu_loss - cpu_loss) < 1e-4, (step, gpu_loss, cpu_loss)
    ERRORS.append(("adamw_10_steps_loss_abs", worst))
    assert rel_error(gpu.get_params(), cpu.params) < 1e-4
