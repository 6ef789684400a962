"""float32 and uint8 tensors (8-bit optimizer moments) in safetensors files: written, read back, checked."""

import numpy as np
import pytest
from safetensors.numpy import load_file

from llama.io.safetensors_file import SafetensorsError, read_tensors, tensor_names, write_tensors


def test_uint8_and_float32_tensors_round_trip_and_are_plain_safetensors(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"codes": rng.integers(0, 256, 1001).astype(np.uint8), "scales": rng.random(4, dtype=np.float32)}
    write_tensors(tmp_path / "t.safetensors", tensors)
    assert tensor_names(tmp_path / "t.safetensors") == {"codes", "scales"}
    theirs = load_file(tmp_path / "t.safetensors")
    assert all(theirs[k].dtype == a.dtype and np.array_equal(theirs[k], a) for k, a in tensors.items())
    mine = {k: np.empty_like(a) for k, a in tensors.items()}
    read_tensors(tmp_path / "t.safetensors", mine)
    assert all(np.array_equal(mine[k], a) for k, a in tensors.items())


def test_a_tensor_of_another_dtype_is_refused(tmp_path):
    write_tensors(tmp_path / "t.safetensors", {"codes": np.zeros(8, np.uint8)})
    with pytest.raises(SafetensorsError, match=r"codes is U8 \[8\], expected F32 \[8\]"):
        read_tensors(tmp_path / "t.safetensors", {"codes": np.zeros(8, np.float32)})
    with pytest.raises(ValueError, match="only float32 and uint8 tensors are written, got float64"):
        write_tensors(tmp_path / "u.safetensors", {"x": np.zeros(8)})
