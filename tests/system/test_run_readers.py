"""Programs that read a run folder (export_hf.py, generate.py) cannot hurt it: they pin the checkpoint
they read, so that the rotation of a run that trains leaves it to a later turn, and an export
replaces its folder whole, refusing one that holds anything but an earlier export (issue 26,
items 3 to 6)."""

import io
import runpy
import signal
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

from llama.config import get_preset
from llama.data.tokenizer import ByteTokenizer
from llama.io.checkpoint import load_checkpoint, reading_checkpoint, rotate_checkpoints, save_checkpoint
from llama.io.hf import load_hf_folder, save_hf_folder
from llama.params import init_parameters
from tests.runs import REPO, checkpoint_steps

CONFIG = get_preset("tiny").replace(vocab_size=ByteTokenizer.vocab_size)
export_hf = runpy.run_path(str(REPO / "scripts" / "export_hf.py"))["main"]


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
def run_folder(tmp_path, monkeypatch):
    """A run folder with checkpoints at steps 2, 4 and 6, and its parent as the working directory."""
    monkeypatch.chdir(tmp_path)  # no Llama 3 tokenizer in data/tokenizer/: the export is byte-level
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


def test_a_reader_that_lists_the_run_as_its_newest_checkpoint_is_rotated_away_takes_the_next(run_folder,
                                                                                               monkeypatch):
    """The race the test below meets now and then: the listing saw only checkpoints that rotation removed
    before their DONE marker was read, and not the one written meanwhile."""
    from llama.io import checkpoint
    real, calls = checkpoint.latest_checkpoint, []

    def raced(run):
        calls.append(run)
        if len(calls) == 1:  # checkpoint 8 lands and 2-6 go while the first listing is being read
            write_checkpoint(run, 8, keep=1)
            return None
        return real(run)

    monkeypatch.setattr(checkpoint, "latest_checkpoint", raced)
    with reading_checkpoint(run_folder) as newest:
        assert newest.name == "ckpt_00000008" and len(calls) == 2


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


def files_under(folder) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_an_export_refuses_a_run_or_a_checkpoint_as_its_folder(run_folder, capsys):
    """Items 3 and 4: an export into the checkpoint it reads would replace its float32 weights by
    bf16 ones, and one into the run would hide the run's newest checkpoint from generate.py."""
    before = files_under(run_folder)
    for folder, held in ((run_folder / "ckpt_00000006", "DONE, optimizer.safetensors, readers.lock, state.json"),
                         (run_folder, "ckpt_00000002, ckpt_00000004, ckpt_00000006")):
        assert export_hf([str(folder), str(folder)]) == 2
        assert capsys.readouterr().err == (
            f"error: {folder} holds a training run or a checkpoint ({held}); an export replaces its folder whole: "
            "choose a new or empty folder, or one that holds only an earlier export\n")
    assert files_under(run_folder) == before


def test_an_export_refuses_a_file_or_a_folder_with_other_files(run_folder, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert export_hf(["out", "mine"]) == 2
    assert "error: mine holds files an export does not write (notes.txt);" in capsys.readouterr().err
    assert export_hf(["out", "mine/notes.txt"]) == 2
    assert "error: mine/notes.txt is a file; choose a folder for the export" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_an_export_over_an_earlier_one_leaves_nothing_of_it(run_folder, tmp_path):
    """Item 5: the shards and index of an earlier sharded export would be loaded instead of the new
    model.safetensors."""
    assert export_hf(["out/ckpt_00000002", "exported", "--dtype", "fp32", "--max-shard-gb", "0.0001"]) == 0
    assert (tmp_path / "exported" / "model.safetensors.index.json").exists()
    assert export_hf(["out", "exported", "--dtype", "fp32"]) == 0
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == [
        "config.json", "generation_config.json", "llama_cuda_export.json", "model.safetensors"]
    assert np.array_equal(load_hf_folder(tmp_path / "exported")[1], init_parameters(CONFIG) + np.float32(6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "out"]  # no temporary folder left


def test_an_export_refuses_a_hugging_face_model_it_did_not_write(run_folder, tmp_path, capsys):
    """Issue 63 item 2: the user's own fine-tune, whose files all have an export's names, was replaced."""
    mine = tmp_path / "my_finetune"
    save_hf_folder(mine, CONFIG, init_parameters(CONFIG), "fp32")
    (mine / "llama_cuda_export.json").unlink()  # as transformers' save_pretrained leaves a folder
    (mine / "generation_config.json").write_text("{}")
    (mine / "tokenizer.json").write_text("{}")
    before = files_under(mine)
    assert export_hf(["out", "my_finetune"]) == 2
    assert capsys.readouterr().err == (
        f"error: my_finetune holds a model that scripts/export_hf.py did not write (config.json, "
        "generation_config.json, model.safetensors, tokenizer.json; no llama_cuda_export.json); an export replaces "
        "its folder whole: choose a new or empty folder, or one that holds only an earlier export\n")
    assert files_under(mine) == before


def test_an_export_refuses_an_earlier_export_changed_since(run_folder, tmp_path, capsys):
    assert export_hf(["out/ckpt_00000002", "exported"]) == 0
    (tmp_path / "exported" / "config.json").write_text((tmp_path / "exported" / "config.json").read_text() + " ")
    before = files_under(tmp_path / "exported")
    assert export_hf(["out", "exported"]) == 2
    assert "error: exported holds an export changed since it was written (config.json);" in capsys.readouterr().err
    assert files_under(tmp_path / "exported") == before


class DiskFull(Exception):
    pass


def test_a_failed_export_leaves_the_earlier_one_whole(run_folder, tmp_path, monkeypatch):
    save_hf_folder("exported", CONFIG, init_parameters(CONFIG), "fp32")
    before = files_under(tmp_path / "exported")
    real, calls = safetensors.numpy.save_file, []

    def fail_at_the_second_shard(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise DiskFull
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.numpy, "save_file", fail_at_the_second_shard)
    with pytest.raises(DiskFull):
        save_hf_folder("exported", CONFIG, init_parameters(CONFIG) + 1, "fp32", max_shard_bytes=50_000)
    assert files_under(tmp_path / "exported") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "out"]


generate_main = runpy.run_path(str(REPO / "scripts" / "generate.py"))["main"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_generate_says_how_to_end_a_prompt_typed_on_a_terminal(run_folder, monkeypatch, capsys):
    """Issue 63 item 15: without --prompt on a terminal it waited on stdin without a word."""
    monkeypatch.setattr(sys, "stdin", Terminal("hi"))
    assert generate_main(["out", "-n", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().err.startswith("reading the prompt from the terminal: type it, then press Ctrl-D on a "
                                              "line of its own (or pass --prompt)\n")


def test_generate_says_when_the_context_cuts_new_tokens_short(run_folder, capsys):
    """Issue 63 item 15: -n 600 on a model of max_seq_len 512 stopped at 508 tokens without a word."""
    assert generate_main(["out", "--prompt", "abc", "-n", "600", "--device", "cpu", "--temperature", "0"]) == 0
    assert (f"note: the model's context is {CONFIG.max_seq_len} tokens and the prompt takes 4: at most "
            f"{CONFIG.max_seq_len - 4} new tokens, not -n 600") in capsys.readouterr().err
