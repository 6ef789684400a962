"""The GPU models with the document mask and --sft's loss mask (issue 44) against the float64 reference with
the same masks: the bf16 model (each recompute recipe, FP8 linear layers, the optimizer in the backward) and the
fp32 model, their loss and every gradient; an --sft step normalised by the step's counted targets; and the
captured graphs, which must compute the document bounds and read the loss scale of each new batch; an --sft run
of the trainer, resumed bit for bit; and on 2 GPUs (device kind nvidia-h200-x2) an --sft run equal to one GPU's.

Rows pack documents that open with BOS: documents of length 1, shorter than a 64-wide attention tile, crossing
tiles, a row that starts mid-document, and one document filling a row."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.model.base import step_share
from llama.model.reference import ReferenceModel
from llama.optim import AdamWConfig
from llama.options import RunOptions
from llama.run.plan import cpu_plan, make_plan
from tests.gradcheck import rel_error
from tests.gpu.test_model_bf16 import CONFIG, bf16_params
from tests.gpu.test_model_fp8 import FP8_TWIN_BOUND
from tests.gpu.test_multi_gpu import relative, train
from tests.gpu_helpers import ERRORS, gpu_count, one_step_losses
from tests.runs import BASE, check_resume_is_exact, losses
from tests.unit.test_sft import sft_data, write_chat_shards

pytestmark = pytest.mark.gpu
BOS = 1
OPT = AdamWConfig()
ROWS = ([1, 1, 30, 1, 40, 23], [96], [70, 1, 25], [10, 86])  # document lengths of each row of 96; the third
# starts mid-document (no BOS at 0)


def packed_batch(seed: int, T: int = 96, vocab: int = 512, prompt: float = 0.0):
    """(tokens, targets) of the ROWS of T = 96 packed documents; prompt: the fraction of targets left out (-1)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(BOS + 1, vocab, (len(ROWS), T))
    for b, lengths in enumerate(ROWS):
        starts = np.cumsum([0, *lengths[:-1]])
        tokens[b, starts[1:] if b == 2 else starts] = BOS
    targets = rng.integers(0, vocab, tokens.shape)
    targets[rng.random(tokens.shape) < prompt] = -1
    return tokens, targets


def reference(config, params, **options) -> ReferenceModel:
    """The float64 reference of these params, document-masked, with a CPU plan of these RunOptions."""
    return ReferenceModel(config, cpu_plan(doc_mask="on", bos_id=BOS, **options), params=params.astype(np.float64),
                          dtype=np.float64)


def gpu_bf16(config, params, dtype="bf16", recompute="partial", in_backward=False, sft=False, B=4, T=96):
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.options import RunOptions
    from llama.run.plan import make_plan
    plan = make_plan(config, RunOptions("cuda", dtype, recompute=recompute, in_backward=in_backward, sft=sft,
                                        doc_mask="on", bos_id=BOS))
    return GPUModelBF16(config, plan, (B, T), params=params)


def gradient_errors(gpu_grads: np.ndarray, cpu: ReferenceModel, tag: str) -> dict:
    errors = {}
    for name, t in cpu.layout.tensors.items():
        part = slice(t.offset, t.offset + t.size)
        errors[name] = rel_error(gpu_grads[part], cpu.grads[part])
        ERRORS.append((f"{tag}_grad[{name}]", errors[name]))
    return errors


@pytest.mark.parametrize("dtype, recompute", [("bf16", "partial"), ("bf16", "none"), ("bf16", "full"),
                                              ("fp8", "partial")])
def test_bf16_model_with_the_document_mask(dtype, recompute):
    from llama.runtime.cuda import runtime
    if dtype == "fp8" and runtime().code != "sm_90a":
        pytest.skip("FP8 GEMMs need sm_90a")
    params = bf16_params(CONFIG, seed=5)
    cpu = reference(CONFIG, params, **({"dtype": "fp8", "fp8_scaling": "row"} if dtype == "fp8" else {}))
    gpu = gpu_bf16(CONFIG, params, dtype, recompute)
    one_step_losses(cpu, gpu, *packed_batch(1), f"doc_mask_{dtype}_{recompute}")
    errors = gradient_errors(gpu.grads.download(), cpu, f"doc_mask_{dtype}_{recompute}")
    worst = max(errors, key=errors.get)
    assert errors[worst] < (FP8_TWIN_BOUND if dtype == "fp8" else 2e-2), worst


def test_fp32_model_with_the_document_mask_and_ignored_targets():
    from llama.model.gpu_fp32 import GPUModelFP32
    config = get_preset("tiny").replace(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=512, max_seq_len=96)
    cpu = ReferenceModel(config, cpu_plan(doc_mask="on", bos_id=BOS), dtype=np.float64, seed=3)
    plan = make_plan(config, RunOptions("cuda", "fp32", doc_mask="on", bos_id=BOS))
    gpu = GPUModelFP32(config, plan, (4, 96), params=cpu.params.astype(np.float32))
    tokens, targets = packed_batch(2, prompt=0.4)
    cpu_loss = cpu.forward(tokens, targets)
    gpu.zero_grad()
    gpu_loss = gpu.forward(tokens, targets)
    assert abs(gpu_loss - cpu_loss) < 1e-5
    cpu.backward(loss_scale=0.5)
    gpu.backward(loss_scale=0.5)
    errors = gradient_errors(gpu.grads.download(), cpu, "doc_mask_fp32")
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("in_backward", [False, True])
def test_an_sft_step_is_the_references(in_backward):
    """An --sft step (two micro-batches, or one with the optimizer in the backward): its loss is the sum of the
    counted targets' losses over the step's counted targets, and its gradients the reference's with each
    micro-batch weighted by its share of them."""
    params = bf16_params(CONFIG, seed=6)
    tokens, targets = packed_batch(3, prompt=0.5)
    micro = 1 if in_backward else 2
    batches = list(zip(np.split(tokens, micro), np.split(targets, micro)))
    counted = float(np.count_nonzero(targets >= 0))
    cpu = reference(CONFIG, params)
    cpu_loss = 0.0
    for x, y in batches:
        share = step_share(y, counted)
        cpu_loss += cpu.forward(x, y) * share
        cpu.backward(loss_scale=share)
    opt = AdamWConfig(grad_clip=0.0)  # the update is not compared; the gradients that remain are
    gpu = gpu_bf16(CONFIG, params, in_backward=in_backward, sft=True)
    gpu_loss, gpu_norm = gpu.train_step(batches, 1e-3, 1, opt, counted=counted)
    assert abs(gpu_loss - cpu_loss) < 1e-2 * cpu_loss
    assert abs(gpu_norm - np.linalg.norm(cpu.grads)) < 2e-2 * np.linalg.norm(cpu.grads)
    if not in_backward:  # the optimizer in the backward keeps no whole gradients
        errors = gradient_errors(gpu.grads.download(), cpu, "sft_step")
        assert max(errors.values()) < 2e-2, errors
    with pytest.raises(ValueError, match="planned with --sft"):
        gpu.train_step(batches, 1e-3, 2, opt)


@pytest.mark.parametrize("in_backward", [False, True])
def test_replayed_steps_take_each_batchs_bounds_and_counted_targets(in_backward):
    """Steps 2 and 3 replay step 1's graphs on new batches (other documents, other counted targets): the same
    bits as the eager steps, which compute everything anew."""
    params = bf16_params(CONFIG, seed=7)
    captured, eager = (gpu_bf16(CONFIG, params, in_backward=in_backward, sft=True) for _ in range(2))
    steps = []
    for step in (1, 2, 3):
        tokens, targets = packed_batch(10 + step, prompt=0.2 * step)
        tokens = np.roll(tokens, 7 * step, axis=1)  # the documents move
        micro = 1 if in_backward else 2
        batches = list(zip(np.split(tokens, micro), np.split(targets, micro)))
        steps.append((batches, 1e-3, step, OPT, float(np.count_nonzero(targets >= 0))))
    results = [captured.train_step(b, lr, s, opt, counted=c) for b, lr, s, opt, c in steps]
    assert results == [eager.eager_step(*step) for step in steps]
    assert len(set(results)) == 3
    for x, y in zip((captured.get_params(), *captured.get_optimizer_state()),
                    (eager.get_params(), *eager.get_optimizer_state())):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


def test_a_step_without_counted_targets_is_finite():
    params = bf16_params(CONFIG, seed=8)
    gpu = gpu_bf16(CONFIG, params, sft=True)
    tokens, targets = packed_batch(4)
    loss, norm = gpu.train_step([(tokens, np.full_like(targets, -1))], 1e-3, 1, OPT, counted=0.0)
    assert (loss, norm) == (0.0, 0.0)
    assert np.isfinite(gpu.get_params()).all()


@pytest.mark.parametrize("model", [["--dtype", "bf16", "-e", "d6", "-t", "64", "-d", "512"],  # head_dim 64
                                   ["--dtype", "fp32", "-d", "256"]])  # tiny
def test_an_sft_run_on_the_gpu_resumes_bit_for_bit(tmp_path, monkeypatch, model):
    """train_llama.py --sft on chat shards (the document mask on, two micro-batches a step): a run resumed from
    its step-4 checkpoint repeats steps 4-7 bit for bit."""
    monkeypatch.chdir(tmp_path)
    check_resume_is_exact(tmp_path, sft_data(write_chat_shards(tmp_path)), "cuda", *model)


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_normalise_an_sft_step_as_one(tmp_path):
    """--sft on 2 GPUs with B=4 each against 1 GPU with B=8 (the same rows a step, counted unequally by the two
    ranks): the loss over the step's counted targets, and so the run, is the same up to rounding."""
    data = sft_data(write_chat_shards(tmp_path))
    args = [*BASE, *data, "-x", "10", "-n", "0", "--dtype", "fp32", "--device", "cuda"]  # tiny, fp32
    train(1, *args, "-b", "8", "-o", str(tmp_path / "one"))
    train(2, *args, "-b", "4", "-o", str(tmp_path / "two"))
    for kind in ("trl", "tel"):
        one, two = losses(tmp_path / "one", kind), losses(tmp_path / "two", kind)
        assert len(one) == len(two) > 0 and relative(two, one) < 1e-5, (kind, one, two)
