"""An output folder belongs to one run: reruns refused, --overwrite, the lock, folder and disk failures."""

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llama.run import trainer
from llama.cache import cache_dir
from llama.io.checkpoint import load_checkpoint
from llama.io.run_dir import default_output_dir
from tests.faults import DiskFault
from tests.runs import BASE, REPO, log_lines, run, signal_at, wait_for

ARGS = [*BASE, "-x", "6", "-n", "2"]


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def last_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_rerun_in_a_used_folder_is_refused(corpus, tmp_path, capsys):
    assert run(*ARGS, *corpus, "-o", "out") == 0
    before = files(tmp_path / "out")
    assert run(*ARGS, *corpus, "-o", "out") == 2
    err = last_error(capsys)
    assert "out already holds a run (main.log and 2 checkpoint folder(s))" in err
    assert "--resume" in err and "--overwrite" in err
    assert files(tmp_path / "out") == before


def test_default_run_folders_are_numbered_after_the_last_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert default_output_dir(continuing=False) == default_output_dir(continuing=True) == Path("out")
    for folder, content in (("out", "main.log"), ("out_2", None), ("out_3", "ckpt_00000004"), ("out_x", "main.log")):
        (tmp_path / folder).mkdir()
        if content == "main.log":
            (tmp_path / folder / "main.log").write_text("s:0 trl:5.0\n")
        elif content:
            (tmp_path / folder / content).mkdir()
    assert default_output_dir(continuing=False) == Path("out_4")
    assert default_output_dir(continuing=True) == Path("out_3")


@pytest.mark.slow
def test_the_same_command_without_o_twice_keeps_both_runs(corpus, tmp_path, capsys):
    """The README's first command, run again: a new numbered folder, named at the start and in the
    summary; --resume without -o continues the last."""
    assert run(*BASE, *corpus, "-x", "2") == 0
    assert "run folder: out (choose one with -o)" in capsys.readouterr().out
    first = files(tmp_path / "out")
    assert run(*BASE, *corpus, "-x", "2") == 0
    captured = capsys.readouterr()
    assert "run folder: out_2 (choose one with -o)" in captured.out and "log out_2/main.log" in captured.out
    assert files(tmp_path / "out") == first and sorted(log_lines(tmp_path / "out_2")) == [0, 1]
    assert run(*BASE, *corpus, "-x", "3", "--resume") == 0
    assert "resuming from out_2/ckpt_00000002 (step 2)" in capsys.readouterr().out
    assert sorted(log_lines(tmp_path / "out_2")) == [0, 1, 2] and files(tmp_path / "out") == first


def test_resume_without_o_continues_only_a_run_of_the_same_data(corpus, tmp_path, capsys):
    """Issue 63 item 12: --resume without -o took the newest out_N whatever data it used, and the loader-state
    error gave no hint; --resum was taken for --resume."""
    other = ["-i", corpus[3], "-j", corpus[3]]  # the validation shard as the training data too
    assert run(*BASE, *corpus, "-x", "2") == 0
    assert run(*BASE, *other, "-x", "2") == 0  # out_2
    capsys.readouterr()
    assert run(*BASE, *corpus, "-x", "3", "--resume") == 2
    assert last_error(capsys) == (
        f"error: --resume without -o continues the newest run, out_2, which trained on -i {corpus[3]} -j {corpus[3]}, "
        f"not on -i {corpus[1]} -j {corpus[3]}: name the run to continue with -o (out trained on this data)")
    assert run(*BASE, *corpus, "-x", "3", "-o", "out_2", "--resume") == 2
    error = last_error(capsys)
    assert error.startswith("error: --resume: data loader state does not fit this loader: files was")
    assert error.endswith(f"; the run trained on -i {corpus[3]} -j {corpus[3]}: pass the same data")
    assert run(*BASE, *corpus, "-x", "3", "-o", "out", "--resume") == 0
    assert run(*BASE, *corpus, "-x", "2", "--overwrite") == 0  # starting over in out_2 asks nothing of its data
    with pytest.raises(SystemExit) as usage:
        run(*BASE, *corpus, "-x", "3", "--resum")
    assert usage.value.code == 2 and "unrecognized arguments: --resum" in capsys.readouterr().err


@pytest.mark.slow
def test_overwrite_moves_the_old_run_aside_and_resume_continues_the_new_run(corpus, tmp_path, capsys, monkeypatch):
    """Defect 1: a second run in the folder, stopped by Ctrl-C, resumes from its own checkpoint."""
    assert run(*ARGS, *corpus, "-o", "out") == 0
    first = files(tmp_path / "out")
    assert run(*BASE, *corpus, "-x", "10", "-n", "4", "-o", "ref") == 0  # the second run, uninterrupted
    unhook = signal_at(monkeypatch, 4)
    assert run(*BASE, *corpus, "-x", "10", "-n", "4", "-o", "out", "--overwrite") == 130
    err = capsys.readouterr().err
    assert "moved the previous run (main.log and 2 checkpoint folder(s)) to out/old_run_1" in err
    assert files(tmp_path / "out" / "old_run_1") == first
    unhook()
    assert run(*BASE, *corpus, "-x", "10", "-n", "4", "-o", "out", "--resume") == 0
    assert "resuming from out/ckpt_00000005 (step 5)" in capsys.readouterr().out
    assert (tmp_path / "out" / "main.log").read_bytes() == (tmp_path / "ref" / "main.log").read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").glob("ckpt_*")) == ["ckpt_00000008", "ckpt_00000010"]
    mine, ref = load_checkpoint(tmp_path / "out" / "ckpt_00000010"), load_checkpoint(tmp_path / "ref" / "ckpt_00000010")
    assert all(np.array_equal(mine[k], ref[k]) for k in ("params", "adam_m", "adam_v"))
    assert run(*BASE, *corpus, "-x", "2", "-o", "out", "--overwrite") == 0
    assert (tmp_path / "out" / "old_run_2" / "ckpt_00000010").is_dir() and (tmp_path / "out" / "old_run_1").is_dir()


@pytest.mark.slow
def test_a_second_trainer_on_the_folder_fails_at_once(corpus, tmp_path, capsys):
    first = subprocess.Popen([sys.executable, str(REPO / "train_llama.py"), *BASE, *corpus, "-x", "100000", "-v", "0",
                              "-n", "0", "-o", "out", "--device", "cpu"], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        log = tmp_path / "out" / "main.log"
        wait_for(lambda: log.exists() and log.stat().st_size > 0)
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert run(*ARGS, *corpus, "-o", "out", *extra) == 2
            assert f"another trainer (PID {first.pid}) is using out" in last_error(capsys)
        assert all(line.startswith("s:") for line in log.read_text().splitlines()[:-1])
        assert not (tmp_path / "out" / "old_run_1").exists()
    finally:
        first.kill()
        first.wait()


def test_a_stale_lock_from_a_dead_process_is_taken_over(corpus, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train.lock").write_text(f"{dead.pid}\n")
    assert run(*ARGS, *corpus, "-o", "out") == 0
    assert f"took over the lock of out left by PID {dead.pid}" in capsys.readouterr().err
    assert not (tmp_path / "out" / "train.lock").exists()


def test_output_folder_that_is_a_file(corpus, tmp_path, capsys):
    (tmp_path / "out").write_text("not a folder")
    assert run(*ARGS, *corpus, "-o", "out") == 2
    assert last_error(capsys) == "error: the output folder out is a file; choose another --output-dir"
    assert run(*ARGS, *corpus, "-o", "out/run") == 2
    assert last_error(capsys) == "error: cannot use out/run as the output folder: Not a directory"


@pytest.mark.parametrize("exists", [True, False])
def test_read_only_output_folder(corpus, tmp_path, capsys, monkeypatch, exists):
    if exists:
        (tmp_path / "out").mkdir()
    DiskFault(tmp_path / "out" if exists else tmp_path, errno.EROFS).install(monkeypatch)
    assert run(*ARGS, *corpus, "-o", "out") == 2
    assert last_error(capsys) == "error: cannot use out as the output folder: Read-only file system"


@pytest.mark.slow
@pytest.mark.parametrize("err, budget", [(errno.ENOSPC, 30_000), (errno.ENOSPC, 0), (errno.EROFS, 0)])
def test_disk_failure_during_a_checkpoint(corpus, tmp_path, capsys, monkeypatch, err, budget):
    fault = DiskFault(tmp_path / "out", err, budget, armed=False).install(monkeypatch)
    real_save = trainer.save_checkpoint

    def save(out, step, *args, **kwargs):
        fault.armed = step == 4
        return real_save(out, step, *args, **kwargs)

    monkeypatch.setattr(trainer, "save_checkpoint", save)
    assert run(*ARGS, *corpus, "-o", "out") == 2
    assert last_error(capsys) == f"error: cannot write checkpoint out/ckpt_00000004: {os.strerror(err)}"
    assert fault.failures > 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ckpt_00000002", "main.log"]
    assert load_checkpoint(tmp_path / "out" / "ckpt_00000002")["state"]["step"] == 2
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    fault.armed = False
    assert run(*ARGS, *corpus, "-o", "out", "--resume") == 0
    assert "resuming from out/ckpt_00000002 (step 2)" in capsys.readouterr().out
    assert sorted(log_lines(tmp_path / "out")) == list(range(6))


@pytest.mark.slow
def test_disk_full_while_building_the_builtin_corpus(tmp_path, capsys, monkeypatch):
    import llama.data.datasets
    monkeypatch.chdir(tmp_path)
    few = llama.data.datasets.stdlib_sources()[:120]
    monkeypatch.setattr(llama.data.datasets, "stdlib_sources", lambda: few)
    cache = cache_dir()
    DiskFault(cache, errno.ENOSPC, budget=5000).install(monkeypatch)
    assert run("-e", "tiny", "-t", "32", "-x", "2", "-s", "0") == 2
    assert last_error(capsys) == f"error: cannot build the built-in corpus in {cache / 'builtin'}: No space left on device"
    assert [p.name for p in cache.rglob("*") if p.is_file()] == []
    assert not (tmp_path / "out").exists()  # a refused run leaves no folder


@pytest.mark.slow
def test_lock_is_released_when_the_run_fails(corpus, tmp_path):
    assert run(*ARGS, *corpus, "-o", "out", "-e", "gpt7") == 2
    assert not (tmp_path / "out" / "train.lock").exists()
    assert run(*ARGS, *corpus, "-o", "out") == 0


@pytest.mark.slow
def test_leftovers_of_a_crashed_checkpoint_are_removed(corpus, tmp_path):
    assert run(*ARGS, *corpus, "-o", "out") == 0
    shutil.copytree(tmp_path / "out" / "ckpt_00000006", tmp_path / "out" / ".tmp_ckpt_00000008")
    assert run(*BASE, *corpus, "-x", "8", "-n", "2", "-o", "out", "--resume") == 0
    assert not list((tmp_path / "out").glob(".tmp*"))


def test_without_flock_the_pid_decides(corpus, tmp_path, capsys, monkeypatch):
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "train.lock").write_text(f"{alive.pid}\n")
        assert run(*ARGS, *corpus, "-o", "out") == 2
        assert f"another trainer (PID {alive.pid}) is using out" in last_error(capsys)
    finally:
        alive.kill()
        alive.wait()
    assert run(*ARGS, *corpus, "-o", "out") == 0
    assert f"left by PID {alive.pid}" in capsys.readouterr().err
