"""The divergence guard's verdicts on made-up weights and probe losses (llama/io/guard.py)."""

import numpy as np
import pytest

from llama.io.guard import BAD_IN_A_ROW, JUMP, SAVE, SKIP, STOP, CheckpointGuard, weights_rms

START = np.full(1000, 0.1, dtype=np.float32)


def test_an_isolated_spike_is_skipped_and_the_next_good_weights_are_saved():
    guard = CheckpointGuard(weights_rms(START))
    assert guard.judge(START, 5.0) == (SAVE, None) and guard.best == 5.0
    assert guard.judge(START, 4.0)[0] == SAVE and guard.best == 4.0
    verdict, why = guard.judge(START, 6.5)  # the limit is 4 + 2
    assert verdict == SKIP and why.startswith("the loss of the weights on the probe batch, 6.5000, is far above "
                                              "the best so far, 4.0000 (limit 6.0000)")
    assert guard.best == 4.0
    assert guard.judge(START, 4.5)[0] == SAVE and guard.best == 4.0


def test_bad_checkpoints_in_a_row_stop_the_run_and_a_good_one_resets_the_count():
    guard = CheckpointGuard(weights_rms(START), best_probe_loss=2.0)
    for _ in range(BAD_IN_A_ROW - 1):
        assert guard.judge(START, 9.0)[0] == SKIP
    assert guard.judge(START, 2.5)[0] == SAVE
    for _ in range(BAD_IN_A_ROW - 1):
        assert guard.judge(START, 9.0)[0] == SKIP
    verdict, why = guard.judge(START, 9.0)
    assert verdict == STOP and why.startswith(f"{BAD_IN_A_ROW} bad checkpoints in a row, the last one because the loss")


def test_weights_that_jump_are_bad_however_low_their_loss():
    guard = CheckpointGuard(weights_rms(START))
    grown = START * (0.99 * JUMP)
    assert guard.judge(grown, 3.0)[0] == SAVE  # the reference is now the grown weights
    verdict, why = guard.judge(grown * (1.01 * JUMP), 1.0)
    assert verdict == SKIP and why.startswith("the weights jumped: their RMS grew from 0.99")
    assert guard.judge(grown * 2, 3.0)[0] == SAVE


def test_weights_or_a_loss_that_are_not_finite_stop_at_once():
    broken = START.copy()
    broken[7] = np.inf
    assert CheckpointGuard(weights_rms(START)).judge(broken, 3.0) == (STOP, "the weights are not finite")
    assert CheckpointGuard(weights_rms(START)).judge(START, float("nan"))[0] == STOP


def test_the_rms_of_the_weights_is_summed_in_chunks():
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert weights_rms(values, chunk=64) == pytest.approx(np.sqrt(np.mean(values.astype(np.float64) ** 2)), rel=1e-6)


def test_huge_finite_weights_have_a_finite_rms_and_jump():
    """Squares of 1e30 overflow float32: such a chunk is summed in float64, so the weights are judged as having
    jumped, not as not finite."""
    huge = np.full(1000, 1e30, dtype=np.float32)
    assert weights_rms(huge, chunk=64) == pytest.approx(1e30, rel=1e-6)
    verdict, why = CheckpointGuard(weights_rms(START)).judge(huge, 3.0)
    assert verdict == SKIP and why.startswith("the weights jumped")
    with_nan = huge.copy()
    with_nan[500] = np.nan
    assert CheckpointGuard(weights_rms(START)).judge(with_nan, 3.0) == (STOP, "the weights are not finite")
