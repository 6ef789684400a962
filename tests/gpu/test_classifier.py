"""The softmax cross-entropy's kernels (kernels/classifier.cu, llama/ops/classifier.py) against the float64
twin (llama/twins/classifier.py): fp32 and bf16 losses and logit gradients (bf16 rows off the 16-byte
grid, longer than shared memory and registers keep, confident rows whose loss cancellation would lose),
and the bf16 path's deterministic loss sum."""

import numpy as np
import pytest

from llama import ops
from llama.runtime.cuda import BF16
from llama.twins.classifier import fused_classifier
from tests.gpu_helpers import ERRORS, bits, check, dev, poisoned, randn, randn_bf16

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(1234)

# ||out - twin|| / ||twin|| allowed per output, the twin in float64 from the same rounded inputs: a bf16
# output carries one rounding (relative 2^-9 = 2e-3 per element) on top of fp32 math; an fp32 output of
# exact inputs only the fp32 arithmetic. The fp32 kernels' outputs: 1e-5 (tests.gpu_helpers.check).
TOL = {
    "fused_classifier_bf16_losses": 1e-5,  # fp32 (__expf: relative ~1e-6 per term)
    "fused_classifier_bf16_dlogits": 1e-2,  # bf16 output
    "confident_loss": 1e-4,                # one row's loss near 1e-11, relative
    "loss_accumulate_bf16": 1e-6,               # fp32 total, double sum
}


@pytest.mark.parametrize("N, V", [(1, 5), (33, 258), (16, 5000), (9, 128256)])
def test_fused_classifier(N, V):
    logits, targets = randn(rng, N, V) * 4, rng.integers(0, V, N)
    d_logits, losses = dev(logits), poisoned((N,))
    ops.fused_classifier(d_logits, losses, dev(targets), 1.0 / N)
    ref_losses, ref_dlogits = fused_classifier(logits, targets, 1.0 / N)
    check("fused_classifier_losses", losses, ref_losses)
    check("fused_classifier_dlogits", d_logits, ref_dlogits)


@pytest.mark.parametrize("n, V", [(1, 5), (33, 50), (7, 1001), (4, 131), (16, 5000), (9, 128256),
                                  (300, 1001), (1000, 40), (140, 140001)])
def test_fused_classifier_bf16(n, V):
    from llama.runtime.cuda import empty
    logits, targets = randn_bf16(rng, n, V, scale=4.0), rng.integers(0, V, n)
    confident = sorted({0, n - 1}) if V >= 50 else []  # losses ~1e-11, which cancellation would lose
    logits[confident, targets[confident]] = 40.0
    # a view one element into its allocation, so that even row 0 starts off the 16-byte grid
    buffer = empty(n * V + 1, BF16)
    buffer.upload(np.concatenate([[0.0], logits.ravel()]))
    logits_d, losses = buffer.view(1, (n, V)), poisoned((n,))
    ops.fused_classifier_bf16(logits_d, losses, dev(targets), 1.0 / n)
    ref_losses, ref_dlogits = fused_classifier(logits, targets, 1.0 / n)
    check("fused_classifier_bf16_losses", losses, ref_losses, TOL["fused_classifier_bf16_losses"])
    check("fused_classifier_bf16_dlogits", logits_d, ref_dlogits, TOL["fused_classifier_bf16_dlogits"])
    for row in confident:  # log1p of the other probabilities' sum, which float64's log(sum) would round
        others = np.delete(logits[row], targets[row]) - logits[row, targets[row]]
        exact = np.log1p(np.sum(np.exp(others)))
        err = abs(float(losses.download()[row]) - exact) / exact
        ERRORS.append(("fused_classifier_bf16_confident_loss", err))
        assert err < TOL["confident_loss"], (row, err, exact)


@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_loss_accumulate_bf16(n):
    losses = (rng.random(n) * 10).astype(np.float32)
    losses_d, results = dev(losses), []
    for _ in range(2):
        total = dev(np.array([3.0]))
        ops.loss_accumulate_bf16(total, losses_d, 0.25)
        results.append(bits(total))
    check("loss_accumulate_bf16", total, np.array([3.0 + 0.25 * np.sum(losses.astype(np.float64))]),
          TOL["loss_accumulate_bf16"])
    assert np.array_equal(results[0], results[1])  # deterministic


@pytest.mark.parametrize("n, V", [(33, 50), (300, 1001), (9, 128256)])
def test_ignored_targets_and_a_device_scale(n, V):
    """A target < 0 (--sft's prompt tokens) gives loss 0 and a zero gradient row, in both kernels (row 0 too:
    its target may not be read before the logits); the bf16 kernel's dloss times the device scalar dloss_scale, and
    loss_accumulate_bf16's scale times scale_at."""
    from llama.runtime.cuda import empty
    logits, targets = randn_bf16(rng, n, V, scale=4.0), rng.integers(0, V, n)
    targets[::3] = -1
    targets[n - 1] = -5
    ref_losses, ref_dlogits = fused_classifier(logits, targets, 0.5 * 0.25)
    fp32_logits, fp32_losses = dev(logits), poisoned((n,))
    ops.fused_classifier(fp32_logits, fp32_losses, dev(targets), 0.5 * 0.25)
    check("fused_classifier_losses", fp32_losses, ref_losses)
    check("fused_classifier_dlogits", fp32_logits, ref_dlogits)
    buffer = empty(n * V, BF16)
    buffer.upload(logits.ravel())
    logits_d, losses, scale = buffer.view(0, (n, V)), poisoned((n,)), dev(np.array([0.25]))
    ops.fused_classifier_bf16(logits_d, losses, dev(targets), 0.5, dloss_scale=scale)
    check("fused_classifier_bf16_losses", losses, ref_losses, TOL["fused_classifier_bf16_losses"])
    check("fused_classifier_bf16_dlogits", logits_d, ref_dlogits, TOL["fused_classifier_bf16_dlogits"])
    ignored = targets < 0
    for array in (fp32_losses, losses):
        assert not array.download()[ignored].any()
    for array in (fp32_logits, logits_d):
        assert not array.download().astype(np.float32)[ignored].any()
    total = dev(np.array([1.0]))
    ops.loss_accumulate_bf16(total, losses, 2.0, scale_at=scale)
    check("loss_accumulate_bf16", total, np.array([1.0 + 0.5 * np.sum(ref_losses)]), TOL["loss_accumulate_bf16"])
