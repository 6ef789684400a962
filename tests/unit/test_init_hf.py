"""Reading an HF folder straight into device memory (load_hf_to_device), here into a stand-in for a
DeviceArray that records each upload: every tensor lands at its offset, the same values as the host
load, and a bad tensor stops the read with its one-line error, whichever reader thread met it."""

import numpy as np
import pytest

from llama.io.hf import HFError, load_hf_folder, load_hf_to_device
from llama.params import ParameterLayout
from tests.unit.test_hf_io import CONFIG, random_params, write_fixture


class Uploads:
    """A flat float32 'device' array: view(offset, shape).upload(values) writes into a host array."""

    def __init__(self, size: int):
        self.values, self.size, self.uploads = np.full(size, np.nan, np.float32), size, []

    def view(self, offset: int, shape):
        outer = self

        class View:
            def upload(self, host: np.ndarray) -> None:
                outer.values[offset:offset + int(np.prod(shape))] = host
                outer.uploads.append(offset)
        return View()


@pytest.mark.parametrize("shards", [1, 3])
def test_device_load_uploads_what_the_host_load_reads(tmp_path, shards, monkeypatch):
    monkeypatch.setattr("llama.io.hf.READERS", 2)  # more tensors than readers: the in-order window moves
    write_fixture(tmp_path / "hf", CONFIG, random_params(CONFIG), np.float32, shards)
    out, counted = Uploads(ParameterLayout(CONFIG).size), []
    config = load_hf_to_device(tmp_path / "hf", out, on_tensor=counted.append)
    assert config == load_hf_folder(tmp_path / "hf")[0]
    assert np.array_equal(out.values, load_hf_folder(tmp_path / "hf")[1])
    assert sorted(out.uploads) == sorted(t.offset for t in ParameterLayout(CONFIG).tensors.values())
    assert sum(counted) == out.size


def test_device_load_checks_its_target_and_the_values(tmp_path):
    params = random_params(CONFIG)
    layout = ParameterLayout(CONFIG)
    write_fixture(tmp_path / "hf", CONFIG, params, np.float32)
    with pytest.raises(ValueError, match="holds 5 values"):
        load_hf_to_device(tmp_path / "hf", Uploads(5))
    bad = params.copy()
    bad[layout.tensors["layers.2.feed_forward.w2.weight"].offset] = np.inf
    write_fixture(tmp_path / "bad", CONFIG, bad, np.float32, shards=3)
    with pytest.raises(HFError, match="model.layers.2.mlp.down_proj.weight holds NaN or infinite values"):
        load_hf_to_device(tmp_path / "bad", Uploads(layout.size))
