"""The checkpoint snapshot of the GPU models (download_state into page-locked memory) holds what get_params
and get_optimizer_state download, bit for bit, and reuses its arrays."""

import numpy as np
import pytest

from llama.io.checkpoint import snapshot_moments
from llama.optim import AdamWConfig
from tests.gpu.test_model_bf16 import CONFIG, batch, bf16_model, bf16_params

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_the_snapshot_is_the_downloaded_state_and_reuses_its_arrays(optimizer):
    model = bf16_model(CONFIG, 3, 80, bf16_params(CONFIG, seed=2), optimizer=optimizer)
    size = model.layout.size
    snapshot = None
    for step in (1, 2):
        model.train_step([batch(step)], 1e-3, step, AdamWConfig())
        again = model.download_state(snapshot)
        assert snapshot is None or again is snapshot
        snapshot = again
        assert np.array_equal(snapshot["params"][:size], model.get_params())
        m, v = model.get_optimizer_state()
        for mine, expected in zip(snapshot_moments(snapshot, size), (m, v)):
            pieces = np.concatenate(list(mine.chunks())) if hasattr(mine, "chunks") else mine
            assert np.array_equal(pieces, expected)
