"""--resume on one GPU streams the checkpoint's files into the model (llama/model/gpu_base.py
load_state_into): a newest checkpoint whose weights prove not finite only then is reported in one line and
the previous one, read on the host, resumes the run bit for bit."""

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.runs import BASE, log_lines, run

pytestmark = pytest.mark.gpu


def test_weights_found_not_finite_while_streaming_resume_from_the_previous_checkpoint(corpus, tmp_path, capsys):
    args = [*BASE, *corpus, "-n", "2", "-nk", "0"]
    assert run(*args, "-x", "6", "-o", "ref", device="cuda") == 0
    assert run(*args, "-x", "4", "-o", "out", device="cuda") == 0
    model = tmp_path / "out" / "ckpt_00000004" / "model.safetensors"
    tensors = load_file(model)
    tensors["norm.weight"][0] = np.nan
    save_file(tensors, model)
    capsys.readouterr()
    assert run(*args, "-x", "6", "-o", "out", "--resume", device="cuda") == 0
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if line.startswith("warning: skipping")]
    assert len(warnings) == 1 and "out/ckpt_00000004/model.safetensors: the weights are not finite" in warnings[0], err
    assert "resuming from out/ckpt_00000002 (step 2)" in out and "Traceback" not in err
    mine, ref = log_lines(tmp_path / "out"), log_lines(tmp_path / "ref")
    assert sorted(mine) == list(range(6)) and all(mine[step] == ref[step] for step in mine)
    for file in ("model.safetensors", "optimizer.safetensors"):
        final = (tmp_path / run_dir / "ckpt_00000006" / file for run_dir in ("out", "ref"))
        assert next(final).read_bytes() == next(final).read_bytes(), file
