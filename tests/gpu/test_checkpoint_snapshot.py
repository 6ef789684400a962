"""The checkpoint snapshot of the GPU models (download_state into page-locked memory pinned in the background,
beside a forward) holds what get_params and get_optimizer_state download, bit for bit, and reuses its arrays;
8-bit moments go back in as their codes and scales; a checkpoint streamed from its files into a model (the
resume of one GPU) is the state set_state makes from the host arrays, bit for bit; the guard's RMS of the
weights is measured on the device."""

import numpy as np
import pytest

from llama.runtime.cuda import BF16
from llama.io.checkpoint import load_checkpoint, load_state_into, save_checkpoint, snapshot_moments
from llama.runtime import pinned
from llama.io.guard import weights_rms
from llama.optim import AdamWConfig, Quantized, fp32_moments
from llama.params import ParameterLayout
from tests.gpu.test_model_bf16 import CONFIG, batch, bf16_model, bf16_params

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_the_snapshot_is_the_downloaded_state_and_reuses_its_arrays(optimizer, monkeypatch):
    monkeypatch.setattr(pinned, "PIN_PIECE", 1 << 14)  # copies of many pinned pieces
    model = bf16_model(CONFIG, 3, 80, bf16_params(CONFIG, seed=2), optimizer=optimizer)
    model.reserve_state()  # pinned while the steps run
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


STATE = {"run": {"batch_size": 3, "seq_len": 80, "tokens_per_step": 240, "seed": 0},
         "sample_rng": np.random.PCG64(0).state,
         "loader": {"epoch": 0, "shard_pos": 0, "batch_pos": 0, "seed": 0, "files": [], "B": 3, "T": 80, "rank": 0,
                    "world_size": 1}}


@pytest.mark.parametrize("saved_with, resumed_with", [("adamw", "adamw"), ("adamw8bit", "adamw8bit"),
                                                      ("adamw", "adamw8bit"), ("adamw8bit", "adamw")])
def test_a_checkpoint_streamed_into_the_model_is_the_state_of_the_host_arrays(tmp_path, monkeypatch, saved_with,
                                                                             resumed_with):
    """load_state_into (parts of 4 KB through the page-locked buffers) against set_state of load_checkpoint's
    arrays: master weights, bf16 weights, moments, and the next step; moments of the other format go through the
    host's conversion."""
    monkeypatch.setattr("llama.io.checkpoint.READ_PIECE", 1 << 12)
    model = bf16_model(CONFIG, 3, 80, bf16_params(CONFIG, seed=2), optimizer=saved_with)
    size = model.layout.size
    model.train_step([batch(1)], 1e-3, 1, AdamWConfig())
    snapshot = model.download_state()
    folder = save_checkpoint(tmp_path, 1, CONFIG, snapshot["params"][:size], *snapshot_moments(snapshot, size), STATE)
    host = load_checkpoint(folder)
    by_host, streamed = (bf16_model(CONFIG, 3, 80, bf16_params(CONFIG, seed=5), optimizer=resumed_with)
                         for _ in range(2))
    by_host.set_state(host["params"], host["adam_m"], host["adam_v"])
    load_state_into(streamed, load_checkpoint(folder, read=False))
    for name, buffer in streamed.state_buffers().items():
        assert np.array_equal(buffer.download(), by_host.state_buffers()[name].download()), name
    assert np.array_equal(streamed.zero.weights.download().view(np.uint16),
                          by_host.zero.weights.download().view(np.uint16))
    for each in (by_host, streamed):
        each.train_step([batch(2)], 1e-3, 2, AdamWConfig())
    assert np.array_equal(by_host.get_params(), streamed.get_params())
