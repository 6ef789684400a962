"""HellaSwag's file through the project's download code (a mirror, the cached copy, a local copy; a corrupt,
truncated or dropped download), and scripts/eval.py end to end on a checkpoint on the CPU."""

import json
import runpy

import numpy as np
import pytest

from llama.config import get_preset
from llama.data.tokenizer import ByteTokenizer
from llama.eval import tasks
from llama.eval.runner import Evaluation
from llama.eval.tasks import HELLASWAG, TaskError, git_blob_id, load_task
from llama.io.checkpoint import save_checkpoint
from llama.model.reference import ReferenceModel
from llama.params import init_parameters
from llama.run.plan import cpu_plan
from tests.httpserver import Route, Server
from tests.runs import REPO
from tests.system.test_run_readers import checkpoint_state

DOCS = [{"activity_label": "Baking", "ctx_a": "A man cracks eggs.", "ctx_b": "he", "label": i % 4,
         "endings": ["stirs them.", "eats the bowl [title] whole.", "leaves.", "sings a song about flour."]}
        for i in range(600)]
BODY = "".join(json.dumps(doc) + "\n" for doc in DOCS).encode()
ROUTE = "/" + HELLASWAG["path"]
eval_main = runpy.run_path(str(REPO / "scripts" / "eval.py"))["main"]


@pytest.fixture
def fake_hellaswag(tmp_path, monkeypatch):
    """A 600-item file in HellaSwag's format, pinned in place of the real one; a server, the working directory."""
    (tmp_path / "hellaswag_val.jsonl").write_bytes(BODY)
    monkeypatch.setitem(HELLASWAG, "git_blob", git_blob_id(tmp_path / "hellaswag_val.jsonl"))
    monkeypatch.chdir(tmp_path)
    server = Server()
    yield server
    server.close()


def test_hellaswag_is_downloaded_once_from_a_mirror_and_then_read_from_the_cache(fake_hellaswag, tmp_path):
    route = fake_hellaswag.routes[ROUTE] = Route(BODY)
    task = load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url)
    assert len(task.items) == 600 and task.log_key == "hella"
    assert task.items[0].context == "Baking: A man cracks eggs. He"
    assert task.items[0].choices[1] == "eats the bowl. whole."
    assert (tmp_path / "cache" / HELLASWAG["dest"]).read_bytes() == BODY
    assert load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url, limit=2).items == task.items[:2]
    assert len(route.requests) == 1


def test_a_dropped_download_resumes(fake_hellaswag, tmp_path):
    route = fake_hellaswag.routes[ROUTE] = Route(BODY, drop_first_after=len(BODY) - 1000)  # past 64 KiB chunks
    assert len(load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url).items) == 600
    assert route.requests[0] is None and route.requests[1].startswith("bytes=") and route.requests[1] != "bytes=0-"


@pytest.mark.parametrize("body", [BODY[:-40], BODY.replace(b"eggs", b"eggz")], ids=["truncated", "corrupt"])
def test_a_truncated_or_corrupt_download_is_deleted_with_one_line(fake_hellaswag, tmp_path, body):
    fake_hellaswag.routes[ROUTE] = Route(body)
    with pytest.raises(TaskError, match=r"the downloaded file is not HellaSwag's validation set \(its git blob id is "
                                        r"not [0-9a-f]{40}\); it was deleted$"):
        load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url)
    assert not list((tmp_path / "cache").rglob("*.jsonl*"))


def test_a_corrupt_cached_copy_is_downloaded_again(fake_hellaswag, tmp_path):
    cached = tmp_path / "cache" / HELLASWAG["dest"]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(BODY[:-1] + b"x")
    fake_hellaswag.routes[ROUTE] = Route(BODY)
    assert len(load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url).items) == 600
    assert cached.read_bytes() == BODY


def test_a_local_copy_is_checked_and_a_missing_file_says_how_to_name_one(fake_hellaswag, tmp_path):
    assert len(load_task("hellaswag", tmp_path / "cache", str(tmp_path / "hellaswag_val.jsonl")).items) == 600
    (tmp_path / "other.jsonl").write_bytes(BODY[:-1])
    with pytest.raises(TaskError, match="other.jsonl is not HellaSwag's validation file"):
        load_task("hellaswag", tmp_path / "cache", str(tmp_path / "other.jsonl"))
    with pytest.raises(TaskError, match=r"not found \(404\).*name a copy of hellaswag_val.jsonl with --task-source"):
        load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url)


def test_the_real_file_is_pinned():
    assert tasks.HELLASWAG["git_blob"] == "0f5ee25d72216f12317d5d8a7b92deafa423d81e"  # data/hellaswag_val.jsonl's
    assert tasks.HELLASWAG["path"] == "rowanz/hellaswag/master/data/hellaswag_val.jsonl"


def test_eval_script_scores_a_checkpoint_and_writes_each_items_scores(fake_hellaswag, tmp_path, capsys):
    config = get_preset("tiny").replace(vocab_size=ByteTokenizer.vocab_size)
    params = init_parameters(config, seed=4)
    (tmp_path / "out").mkdir()
    save_checkpoint(tmp_path / "out", 5, config, params, np.zeros_like(params), np.zeros_like(params),
                    checkpoint_state(1.0))
    argv = [str(tmp_path / "out"), "--task", "hellaswag", "--task-source", str(tmp_path / "hellaswag_val.jsonl"),
            "--limit", "6", "--device", "cpu", "-b", "5", "--output", str(tmp_path / "scores.jsonl")]
    assert eval_main(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith("hellaswag: 6 items | acc ") and " ± " in out and "examples/s" in err
    records = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    task = load_task("hellaswag", source=str(tmp_path / "hellaswag_val.jsonl"), limit=6)
    expected = Evaluation(task, ByteTokenizer(), 3, config.max_seq_len).run(ReferenceModel(config, cpu_plan(),
                                                                                           params=params))
    assert [r["index"] for r in records] == list(range(6))
    for record, score in zip(records, expected):
        assert record["loglikelihoods"] == pytest.approx(score.loglikelihoods, abs=1e-5)
        assert record["label"] == score.label and record["acc"] == int(score.prediction == score.label)
    acc = float(out.split("| acc ")[1].split()[0])
    assert acc == pytest.approx(np.mean([r["acc"] for r in records]), abs=1e-4)
    assert eval_main([*argv[:2], "nowhere.jsonl", *argv[3:]]) == 1
    assert capsys.readouterr().err.strip() == ("error: --task nowhere.jsonl: neither hellaswag nor a JSONL file of "
                                               "multiple-choice items")
