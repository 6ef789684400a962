"""The checkpoint snapshot of the GPU models (download_state into page-locked memory, beside a forward) holds
what get_params and get_optimizer_state download, bit for bit, and reuses its arrays; 8-bit moments go back
in as their codes and scales; the guard's RMS of the weights is measured on the device."""

import numpy as np
import pytest

from llama.cuda import BF16
from llama.io.checkpoint import snapshot_moments
from llama.io.guard import weights_rms
from llama.optim import AdamWConfig, Quantized, fp32_moments
from llama.params import ParameterLayout
from tests.gpu.test_model_bf16 import CONFIG, batch, bf16_model, bf16_params

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_the_snapshot_is_the_downloaded_state_and_reuses_its_arrays(optimizer):
    model = bf16_model(CONFIG, 3, 80, bf16_params(CONFIG, seed=2), optimizer=optimizer)
    size = model.layout.size
    snapshot = None
    for step in (1, 2):
        model.train_step([batch(step)], 1e-3, step, AdamWConfig())
        again = model.download_state(snapshot, wait=False)
        model.forward(*batch(9))  # beside the copies, as the checkpoint's probe forward
        model.wait_for_state()
        assert snapshot is None or again is snapshot
        snapshot = again
        assert np.array_equal(snapshot["params"][:size], model.get_params())
        m, v = model.get_optimizer_state()
        moments = snapshot_moments(snapshot, size)
        assert isinstance(moments[0], Quantized) == (optimizer == "adamw8bit")
        for mine, expected in zip(fp32_moments(*moments), (m, v)):
            assert np.array_equal(mine, expected)


def test_8_bit_moments_go_back_as_their_codes_and_the_run_goes_on_bit_exact():
    """set_state with a snapshot's codes and scales: the same state, and the next step the same as without."""
    model = bf16_model(CONFIG, 3, 80, bf16_params(CONFIG, seed=2), optimizer="adamw8bit")
    size = model.layout.size
    model.train_step([batch(1)], 1e-3, 1, AdamWConfig())
    saved = {name: array.copy() for name, array in model.download_state().items()}
    resumed = bf16_model(CONFIG, 3, 80, bf16_params(CONFIG, seed=5), optimizer="adamw8bit")
    resumed.set_state(saved["params"][:size], *snapshot_moments(saved, size))
    assert all(np.array_equal(resumed.download_state()[name], array) for name, array in saved.items())
    for each in (model, resumed):
        each.train_step([batch(2)], 1e-3, 2, AdamWConfig())
    assert np.array_equal(model.get_params(), resumed.get_params())


def test_the_weights_rms_on_the_device_is_the_hosts():
    model = bf16_model(CONFIG, 3, 80, bf16_params(CONFIG, seed=2))
    rms = model.weights_rms()
    assert rms == pytest.approx(weights_rms(model.get_params()), rel=1e-5) and model.weights_rms() == rms


def test_the_bf16_weights_are_rounded_on_the_device_as_on_the_host():
    """set_weights rounds the bf16 copy from the uploaded master on the GPU: the bits of the host's rounding."""
    params = np.random.default_rng(3).standard_normal(ParameterLayout(CONFIG).size).astype(np.float32)
    model = bf16_model(CONFIG, 3, 80, params)
    size = model.layout.size
    assert np.array_equal(model.zero.weights.download()[:size].view(np.uint16), params.astype(BF16).view(np.uint16))
    assert np.array_equal(model.get_params(), params)
