"""Readers of a run folder (export_hf.py, generate.py) while it trains: they pin the checkpoint they
read, and rotation leaves a pinned checkpoint to a later turn (issue 26, item 6)."""

import signal
import subprocess
import sys

import numpy as np
import pytest

from llama.config import get_preset
from llama.data.tokenizer import ByteTokenizer
from llama.io.checkpoint import load_checkpoint, reading_checkpoint, rotate_checkpoints, save_checkpoint
from llama.params import init_parameters
from tests.runs import REPO, checkpoint_steps

CONFIG = get_preset("tiny").replace(vocab_size=ByteTokenizer.vocab_size)


def checkpoint_state(probe_loss: float) -> dict:
    """A state.json as a byte-level run of the tiny model writes it."""
    return {"run": {"batch_size": 2, "seq_len": 8, "tokens_per_step": 16, "seed": 0},
            "loader": {"epoch": 0, "shard_pos": 0, "batch_pos": 1, "seed": 0, "files": ["train.bin"], "B": 2, "T": 8,
                       "rank": 0, "world_size": 1},
            "sample_rng": np.random.default_rng(0).bit_generator.state, "probe_loss": probe_loss}


def write_checkpoint(out_dir, step: int, keep: int = 0):
    """Checkpoint `step`, whose weights are the initial ones plus `step` and whose probe loss falls with it."""
    params = init_parameters(CONFIG) + np.float32(step)
    moments = np.zeros_like(params)
    save_checkpoint(out_dir, step, CONFIG, params, moments, moments, checkpoint_state(10.0 - step / 100), keep)


@pytest.fixture
def run_folder(tmp_path):
    """A run folder with checkpoints at steps 2, 4 and 6."""
    (tmp_path / "out").mkdir()
    for step in (2, 4, 6):
        write_checkpoint(tmp_path / "out", step)
    return tmp_path / "out"


def test_rotation_leaves_a_checkpoint_that_a_reader_pins(run_folder):
    with reading_checkpoint(run_folder) as newest:
        assert newest.name == "ckpt_00000006"
    with reading_checkpoint(run_folder / "ckpt_00000002") as pinned:
        rotate_checkpoints(run_folder, run_folder / "ckpt_00000006", keep=1)
        assert checkpoint_steps(run_folder) == [2, 6]
        assert load_checkpoint(pinned)["state"]["step"] == 2
    rotate_checkpoints(run_folder, run_folder / "ckpt_00000006", keep=1)
    assert checkpoint_steps(run_folder) == [6]


PIN_AND_WAIT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from llama.io.checkpoint import reading_checkpoint
with reading_checkpoint(sys.argv[2]):
    print("pinned", flush=True)
    time.sleep(60)
"""


def test_the_pin_of_a_reader_that_died_counts_no_more(run_folder):
    reader = subprocess.Popen([sys.executable, "-c", PIN_AND_WAIT, str(REPO), str(run_folder / "ckpt_00000002")],
                              stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline() == "pinned\n"
    rotate_checkpoints(run_folder, run_folder / "ckpt_00000006", keep=1)
    assert checkpoint_steps(run_folder) == [2, 6]
    reader.send_signal(signal.SIGKILL)
    reader.wait()
    rotate_checkpoints(run_folder, run_folder / "ckpt_00000006", keep=1)
    assert checkpoint_steps(run_folder) == [6]


WRITE_CHECKPOINTS = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.system.test_run_readers import write_checkpoint
for step in range(7, 87):
    write_checkpoint(Path(sys.argv[2]), step, keep=1)
"""


@pytest.mark.slow
def test_readers_of_a_run_that_rotates_at_every_step_never_fail(run_folder):
    """As a run with -n 1 -nk 1 would, another process writes checkpoints 7 to 86, keeping one, while
    this one loads the run's newest checkpoint again and again."""
    writer = subprocess.Popen([sys.executable, "-c", WRITE_CHECKPOINTS, str(REPO), str(run_folder)])
    reads = []
    while writer.poll() is None:
        with reading_checkpoint(run_folder) as checkpoint:
            loaded = load_checkpoint(checkpoint)
        reads.append(loaded["state"]["step"])
        assert np.array_equal(loaded["params"], init_parameters(CONFIG) + np.float32(reads[-1]))
    assert writer.returncode == 0 and len(reads) > 5 and reads == sorted(reads)
