"""scripts/prepare_data.py as a user runs it: a summary in a pipe, one-line errors with exit 2, Ctrl-C
is exit 130, and the shards train_llama.py's loader reads."""

import io
import json
import os
import runpy
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from llama.data.dataloader import DataLoader
from llama.data.shards import ShardError
from tests.runs import REPO
from tests.sample_files import ranks_file_bytes

SCRIPT = REPO / "scripts" / "prepare_data.py"


def tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(ranks_file_bytes())
    return path


def run_main(tmp_path, monkeypatch, *args):
    monkeypatch.chdir(tmp_path)
    return runpy.run_path(str(SCRIPT))["main"]([*map(str, args), "--tokenizer", str(tokenizer_file(tmp_path))])


def test_a_folder_and_a_jsonl_become_shards_the_loader_reads(tmp_path, monkeypatch, capsys):
    (tmp_path / "texts").mkdir()
    for i in range(5):
        (tmp_path / "texts" / f"{i}.txt").write_text(f"text number {i}. " * 50)
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 30}) + "\n" for i in range(20)))
    rc = run_main(tmp_path, monkeypatch, "texts", "more.jsonl", "--name", "mine", "--val-every", "5",
                  "--shard-tokens", "1000", "--workers", "2")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "documents: 25 (20 train, 5 val)" in out and "tokens/s" in out
    assert "train with: python3 train_llama.py -i 'data/mine/mine_train_*.bin' -j 'data/mine/mine_val_*.bin'" in out
    loader = DataLoader(str(tmp_path / "data/mine/mine_train_*.bin"), B=2, T=64)
    assert len(loader.files) > 1 and loader.next_batch()[0].shape == (2, 64)


def test_a_bad_line_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "x.jsonl").write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": \n')
    assert run_main(tmp_path, monkeypatch, "x.jsonl") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: x.jsonl:3: invalid JSON")
    assert run_main(tmp_path, monkeypatch, "x.jsonl", "--skip-bad", "--val-every", "0") == 0
    assert "skipped: 1 bad records (--skip-bad)" in capsys.readouterr().out


def test_val_every_1_is_a_usage_error(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        run_main(tmp_path, monkeypatch, "x.jsonl", "--val-every", "1")
    assert stop.value.code == 2 and "--val-every 1 would put every document in validation" in capsys.readouterr().err


# prepare_data.py's main, held after its first shard (more to come) until the test's signal, which so comes mid-run
# whenever the test's poll sees the shard
HELD_AFTER_FIRST_SHARD = """
import runpy, sys, time
from llama.data import prepare
flush = prepare.ShardWriter._flush
def held(self, count):
    flush(self, count)
    while True:
        time.sleep(0.01)
prepare.ShardWriter._flush = held
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def with_ctrl_c() -> None:
    """In the child before it runs: SIGINT's default, whatever the tests inherited. A shell without job control starts
    its background commands with SIGINT ignored, and a Python started so keeps ignoring it (no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line_exit_130_and_no_shards(tmp_path):
    (tmp_path / "big.jsonl").write_text((json.dumps({"text": "many words " * 500}) + "\n") * 1000)  # 5.5 MB
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", HELD_AFTER_FIRST_SHARD, str(SCRIPT), "big.jsonl", "--name", "big",
                             "--shard-tokens", "100000", "--workers", "2", "--tokenizer", str(tokenizer_file(tmp_path))],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=with_ctrl_c)
    try:
        deadline = time.time() + 60
        while not list((tmp_path / "data" / "big").glob(".big.partial/big_train_*.bin")) and time.time() < deadline:
            time.sleep(0.05)
        assert list((tmp_path / "data" / "big").glob(".big.partial/big_train_*.bin")), "no shard written within 60 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # held for ever where the signal did not stop it
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted: data/big is as it was"
    assert not (tmp_path / "data").exists()  # the folders made for the dataset are gone


def test_tinystories_unpacks_its_tarball_and_prepares_the_stories(tmp_path, monkeypatch, capsys):
    with tarfile.open(tmp_path / "TinyStories_all_data.tar.gz", "w:gz") as tar:
        for i in range(2):
            raw = json.dumps([{"story": f"tale {i}-{j}"} for j in range(60)]).encode()
            info = tarfile.TarInfo(f"data{i:02d}.json")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    main = runpy.run_path(str(REPO / "data" / "tinystories.py"))["main"]
    args = ["--input", str(tmp_path / "TinyStories_all_data.tar.gz"), "--out-dir", str(tmp_path / "out"),
            "--tokenizer", str(tokenizer_file(tmp_path)), "--workers", "1"]
    assert main(args) == 0 and "documents: 120 (118 train, 2 val)" in capsys.readouterr().out
    val = DataLoader(str(tmp_path / "out" / "TinyStories_val_*.bin"), B=1, T=4, shuffle=False)
    assert [Path(f).name for f in val.files] == ["TinyStories_val_000000.bin"]
    assert (tmp_path / "TinyStories_all_data" / "data01.json").exists()
    assert main(args) == 0  # again: the unpacked folder is reused, the shards replaced


def test_a_preparation_killed_halfway_leaves_no_dataset_to_train_on(tmp_path, monkeypatch):
    """Issue 63 item 3: kill -9 left 3 of 65 shards, and train_llama.py -i trained on them without a word."""
    (tmp_path / "big.jsonl").write_text((json.dumps({"text": "many words " * 500}) + "\n") * 1000)  # 5.5 MB
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    arguments = [str(SCRIPT), "big.jsonl", "--name", "big", "--shard-tokens", "100000", "--workers", "1",
                 "--tokenizer", str(tokenizer_file(tmp_path))]
    proc = subprocess.Popen([sys.executable, "-c", HELD_AFTER_FIRST_SHARD, *arguments], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = tmp_path / "data" / "big" / ".big.partial"
    deadline = time.time() + 60
    while not list(partial.glob("big_train_*.bin")) and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(partial.glob("big_train_*.bin")), "no shard written within 60 s"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ShardError, match=r"no shard files match data/big/big_train_\*\.bin; data/big/\.big\.partial "
                                         r"holds a preparation that did not finish"):
        DataLoader("data/big/big_train_*.bin", B=1, T=8)
    (tmp_path / "big.jsonl").write_text((json.dumps({"text": "few words " * 50}) + "\n") * 2)
    assert subprocess.run([sys.executable, *arguments], cwd=tmp_path, env=env,
                          capture_output=True).returncode == 0  # no --overwrite
    assert sorted(p.name for p in (tmp_path / "data" / "big").iterdir()) == [
        "big.manifest.json", "big_train_000000.bin", "big_val_000000.bin"]  # nothing of the killed one


def test_a_name_with_a_slash_is_one_line_and_chat_data_gets_the_sft_command(tmp_path, monkeypatch, capsys):
    """Issue 63 items 6 and 13."""
    (tmp_path / "x.txt").write_text("text")
    assert run_main(tmp_path, monkeypatch, "x.txt", "--name", "my/data") == 2
    assert capsys.readouterr().err == ("error: --name 'my/data' is the shards' file name prefix, not a path: choose a "
                                       "plain name, and the folder with --out-dir\n")
    assert not (tmp_path / "data").exists()
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "ok"}]}) + "\n")
    assert run_main(tmp_path, monkeypatch, "chat.jsonl", "--val-every", "0") == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"train with: python3 train_llama.py -i 'data/chat/chat_train_*.bin' --sft --tokenizer "
        f"{tmp_path / 'tokenizer.model'}")


def test_tinystories_unpacks_its_files_on_a_python_without_extraction_filters(tmp_path, monkeypatch):
    """Python before 3.11.4 (Debian 12's 3.11.2, in a virtual environment) has no extractall(filter=)."""
    extract_files = runpy.run_path(str(REPO / "data" / "tinystories.py"))["extract_files"]
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    with tarfile.open(tmp_path / "t.tar", "w") as tar:
        for name, raw in (("data00.json", b"[]"), ("../outside.json", b"[]")):
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    with tarfile.open(tmp_path / "t.tar") as tar, pytest.raises(tarfile.TarError, match="outside the folder"):
        extract_files(tar, tmp_path / "out")
    assert (tmp_path / "out" / "data00.json").read_bytes() == b"[]" and not (tmp_path / "outside.json").exists()
