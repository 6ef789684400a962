"""Task files through the project's download code (a mirror, the cached copy, a local copy, a folder of copies;
a corrupt, truncated or dropped download; an archive), and scripts/eval.py end to end on a checkpoint on the CPU:
its per-item file and lm-eval's results JSON, its errors (exit code 2 before anything is scored), Ctrl-C (130,
nothing written) and its progress where stdout is not a terminal."""

import io
import json
import runpy
import zipfile

import numpy as np
import pytest

from llama.config import get_preset
from llama.data.tokenizer import ByteTokenizer
from llama.eval.benchmarks import BENCHMARKS
from llama.eval.items import TaskError
from llama.eval.runner import Evaluation
from llama.eval.scoring import metrics
from llama.eval.tasks import load_task
from llama.io.checkpoint import save_checkpoint
from llama.model.reference import ReferenceModel
from llama.params import init_parameters
from llama.run.plan import cpu_plan
from tests.eval_files import EVALDATA, accept, needs_evaldata, write_jsonl
from tests.httpserver import Route, Server
from tests.runs import REPO
from tests.system.test_run_readers import checkpoint_state

DOCS = [{"activity_label": "Baking", "ctx_a": "A man cracks eggs.", "ctx_b": "he", "label": i % 4,
         "endings": ["stirs them.", "eats the bowl [title] whole.", "leaves.", "sings a song about flour."]}
        for i in range(600)]
BODY = "".join(json.dumps(doc) + "\n" for doc in DOCS).encode()
HELLASWAG = BENCHMARKS["hellaswag"].sources[0]
ROUTE = "/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
COPA_ROWS = [{"premise": f"The man turned on faucet {i}.", "choice1": "The toilet filled with water.",
              "choice2": "Water flowed from the spout.", "question": "effect", "label": 1, "idx": i} for i in range(4)]
eval_main = runpy.run_path(str(REPO / "scripts" / "eval.py"))["main"]


@pytest.fixture
def fake_hellaswag(tmp_path, monkeypatch):
    """A 600-item file in HellaSwag's format, pinned in place of the real one; a server, the working directory."""
    (tmp_path / "hellaswag_val.jsonl").write_bytes(BODY)
    accept(monkeypatch, "hellaswag", tmp_path / "hellaswag_val.jsonl", count=600)
    monkeypatch.chdir(tmp_path)
    server = Server()
    yield server
    server.close()


def zipped(member: str, rows: list, bad_line: int | None = None) -> bytes:
    lines = [json.dumps(row) for row in rows]
    if bad_line is not None:
        lines[bad_line - 1] = lines[bad_line - 1][:-5]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(member, "\n".join(lines) + "\n")
    return buffer.getvalue()


def test_hellaswag_is_downloaded_once_from_a_mirror_and_then_read_from_the_cache(fake_hellaswag, tmp_path):
    route = fake_hellaswag.routes[ROUTE] = Route(BODY)
    task = load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url)
    assert len(task.items) == 600 and task.log_key == "hella"
    assert task.items[0].context == "Baking: A man cracks eggs. He"  # process_docs capitalizes ctx_b
    assert task.items[0].choices[1] == "eats the bowl. whole."
    assert (tmp_path / "cache" / HELLASWAG.dest).read_bytes() == BODY
    assert load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url, limit=2).items == task.items[:2]
    assert len(route.requests) == 1


def test_a_dropped_download_resumes(fake_hellaswag, tmp_path):
    route = fake_hellaswag.routes[ROUTE] = Route(BODY, drop_first_after=len(BODY) - 1000)  # past 64 KiB chunks
    assert len(load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url).items) == 600
    assert route.requests[0] is None and route.requests[1].startswith("bytes=") and route.requests[1] != "bytes=0-"


@pytest.mark.parametrize("body", [BODY[:-40], BODY.replace(b"eggs", b"eggz")], ids=["truncated", "corrupt"])
def test_a_truncated_or_corrupt_download_is_deleted_with_one_line(fake_hellaswag, tmp_path, body):
    fake_hellaswag.routes[ROUTE] = Route(body)
    with pytest.raises(TaskError, match=r"the downloaded file is not the expected one \(its git blob id is not "
                                        r"[0-9a-f]{40}\); it was deleted$"):
        load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url)
    assert not list((tmp_path / "cache").rglob("*.jsonl*"))


def test_a_corrupt_cached_copy_is_downloaded_again(fake_hellaswag, tmp_path):
    cached = tmp_path / "cache" / HELLASWAG.dest
    cached.parent.mkdir(parents=True)
    cached.write_bytes(BODY[:-1] + b"x")
    fake_hellaswag.routes[ROUTE] = Route(BODY)
    assert len(load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url).items) == 600
    assert cached.read_bytes() == BODY


def test_a_local_copy_is_checked_and_a_failed_download_says_how_to_name_one(fake_hellaswag, tmp_path):
    assert len(load_task("hellaswag", tmp_path / "cache", str(tmp_path / "hellaswag_val.jsonl")).items) == 600
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "hellaswag_val.jsonl").write_bytes(BODY.replace(b"eggs", b"eggz"))
    with pytest.raises(TaskError, match="hellaswag_val.jsonl is not the original file of HellaSwag's validation set"):
        load_task("hellaswag", tmp_path / "cache", str(tmp_path / "other" / "hellaswag_val.jsonl"))
    with pytest.raises(TaskError, match=r"not found \(404\).*; or name a copy \(hellaswag_val.jsonl, "
                                        r"hellaswag_val_full.txt\) or a folder holding one with --eval-source$"):
        load_task("hellaswag", tmp_path / "cache", fake_hellaswag.url, options=("--eval", "--eval-source"))


def test_a_folder_of_copies_is_searched_and_a_file_of_another_task_is_refused(fake_hellaswag, tmp_path):
    folder = tmp_path / "copies" / "nested"
    folder.mkdir(parents=True)
    (folder / "hellaswag_val.jsonl").write_bytes(BODY)
    assert len(load_task("hellaswag", tmp_path / "cache", str(tmp_path / "copies")).items) == 600
    with pytest.raises(TaskError, match="--task-source .*copies: this folder holds no copy of piqa "
                                        r"\(looked for valid.jsonl, piqa.jsonl\)"):
        load_task("piqa", tmp_path / "cache", str(tmp_path / "copies"))
    with pytest.raises(TaskError, match=r"hellaswag_val.jsonl:1: not a file of arc_easy \(its formats and their "
                                        r"fields: original: answerKey, question; llm-foundry: choices, gold, query\)"):
        load_task("arc_easy", tmp_path / "cache", str(folder / "hellaswag_val.jsonl"))


def test_an_archive_is_downloaded_on_first_use_and_a_bad_one_deleted(tmp_path, monkeypatch):
    accept(monkeypatch, "copa", count=4)
    server = Server()
    try:
        server.routes["/glue/superglue/data/v2/COPA.zip"] = Route(zipped("COPA/val.jsonl", COPA_ROWS))
        task = load_task("copa", tmp_path / "cache", server.url)
        assert task.items[1].context == "The man turned on faucet 1 therefore"
        assert task.items[1].choices == (" the toilet filled with water.", " water flowed from the spout.")
        assert (tmp_path / "cache" / "copa" / "COPA.zip").is_file()
        (tmp_path / "cache" / "copa" / "COPA.zip").unlink()
        server.routes["/glue/superglue/data/v2/COPA.zip"] = Route(zipped("COPA/val.jsonl", COPA_ROWS, bad_line=3))
        with pytest.raises(TaskError, match=r"COPA.zip:COPA/val.jsonl:3: not JSON .*; the download was deleted "
                                            r"\(rerun to download it again\)$"):
            load_task("copa", tmp_path / "cache", server.url)
        assert not (tmp_path / "cache" / "copa" / "COPA.zip").exists()
    finally:
        server.close()


def test_the_real_files_are_pinned_where_they_could_be_verified():
    assert HELLASWAG.git_blob == "0f5ee25d72216f12317d5d8a7b92deafa423d81e"  # rowanz/hellaswag's data/hellaswag_val.jsonl
    assert HELLASWAG.url == "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
    assert [s.git_blob for s in BENCHMARKS["piqa"].sources] == ["da35972044f4a35e0053ff09a97ed7926ed3b8b4",
                                                                 "2cec30af5415a24647d70417db4df35c202c6c34"]


# ---- scripts/eval.py

@pytest.fixture
def checkpoint(tmp_path):
    """The tiny model with a window of 256 bytes, which the longest choice of the suite's first items fits."""
    config = get_preset("tiny").replace(vocab_size=ByteTokenizer.vocab_size, max_seq_len=256)
    params = init_parameters(config, seed=4)
    (tmp_path / "out").mkdir()
    save_checkpoint(tmp_path / "out", 5, config, params, np.zeros_like(params), np.zeros_like(params),
                    checkpoint_state(1.0))
    return tmp_path / "out", config, params


def test_eval_script_scores_a_checkpoint_and_writes_each_items_scores(fake_hellaswag, tmp_path, capsys, checkpoint):
    out, config, params = checkpoint
    argv = [str(out), "--task", "hellaswag", "--task-source", str(tmp_path / "hellaswag_val.jsonl"),
            "--limit", "6", "--device", "cpu", "-b", "5", "--output", str(tmp_path / "scores.jsonl")]
    assert eval_main(argv) == 0
    stdout, err = capsys.readouterr()
    assert stdout.startswith("hellaswag: 6 items | acc ") and " ± " in stdout and "examples/s" in stdout
    records = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    task = load_task("hellaswag", source=str(tmp_path / "hellaswag_val.jsonl"), limit=6)
    expected = Evaluation(task, ByteTokenizer(), 3, config.max_seq_len).run(ReferenceModel(config, cpu_plan(),
                                                                                           params=params))
    assert [r["index"] for r in records] == list(range(6)) and {r["task"] for r in records} == {"hellaswag"}
    for record, score in zip(records, expected):
        assert record["loglikelihoods"] == pytest.approx(score.loglikelihoods, abs=1e-5)
        assert record["label"] == score.label and record["acc"] == int(score.prediction == score.label)
    acc = float(stdout.split("| acc ")[1].split()[0])
    assert acc == pytest.approx(np.mean([r["acc"] for r in records]), abs=1e-4)
    results = json.loads((tmp_path / "scores_results.json").read_text())
    entry = results["results"]["hellaswag"]
    assert entry["alias"] == "hellaswag" and entry["sample_len"] == 6
    assert entry["acc,none"] == pytest.approx(np.mean([r["acc"] for r in records]))
    assert entry["acc_norm,none"] == pytest.approx(np.mean([r["acc_norm"] for r in records]))
    assert entry["acc_stderr,none"] == pytest.approx(metrics(expected)["acc_stderr"])
    assert results["n-samples"]["hellaswag"] == {"original": 600, "effective": 6}
    assert results["n-shot"]["hellaswag"] == 0
    assert results["higher_is_better"]["hellaswag"] == {"acc": True, "acc_norm": True}


def test_eval_script_scores_several_tasks_from_a_folder_of_copies(tmp_path, capsys, checkpoint, monkeypatch):
    out, *_ = checkpoint
    copies = tmp_path / "copies"
    copies.mkdir()
    write_jsonl(copies / "copa.jsonl", [{"query": "The man turned on the faucet, therefore", "gold": 1,
                                         "choices": ["the toilet filled.", "water flowed."]}] * 3)
    write_jsonl(copies / "lambada_openai.jsonl", [{"context": "He said hello and", "continuation": "left"}] * 2)
    accept(monkeypatch, "copa", count=3)
    accept(monkeypatch, "lambada_openai", count=2)
    monkeypatch.chdir(tmp_path)
    assert eval_main([str(out), "--task", "copa,lambada_openai", "--task-source", str(copies), "--device", "cpu"]) == 0
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0].startswith("copa: 3 items | acc ") and "acc_norm" not in stdout[0]  # COPA's YAML: acc only
    assert stdout[1].startswith("lambada_openai: 2 items | perplexity ") and "| acc " in stdout[1]
    records = [json.loads(line) for line in (tmp_path / "eval_copa+lambada_openai.jsonl").read_text().splitlines()]
    assert [r["task"] for r in records] == ["copa"] * 3 + ["lambada_openai"] * 2
    assert set(records[3]) == {"task", "index", "loglikelihood", "greedy", "acc"}
    results = json.loads((tmp_path / "eval_copa+lambada_openai_results.json").read_text())["results"]
    ppl = np.exp(-np.mean([r["loglikelihood"] for r in records[3:]]))
    assert results["lambada_openai"]["perplexity,none"] == pytest.approx(ppl)
    assert results["lambada_openai"]["acc,none"] == np.mean([r["greedy"] for r in records[3:]])


@needs_evaldata
def test_eval_script_runs_the_suite_and_sums_it_up(tmp_path, capsys, checkpoint):
    out, *_ = checkpoint
    assert eval_main([str(out), "--task", "suite", "--task-source", str(EVALDATA), "--limit", "1", "--device", "cpu",
                      "--output", str(tmp_path / "suite.jsonl")]) == 0
    stdout = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in stdout[:10]] == list(BENCHMARKS)
    results = json.loads((tmp_path / "suite_results.json").read_text())
    assert results["group_subtasks"]["suite"] == list(BENCHMARKS)
    assert results["group_subtasks"]["mmlu"] == ["mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"]
    # --limit takes the first item of each of MMLU's subjects, as lm-eval's does of each subtask
    assert results["results"]["mmlu_abstract_algebra"]["sample_len"] == 1 and results["n-samples"]["mmlu"] == {
        "original": 14_079, "effective": 57} and results["n-shot"]["mmlu"] == 5
    chance = {"lambada_openai": 0.0, "piqa": 0.5, "winogrande": 0.5, "copa": 0.5, "boolq": 0.5}
    centered = [(results["results"][n]["acc,none"] - chance.get(n, 0.25)) / (1 - chance.get(n, 0.25))
                for n in BENCHMARKS]
    assert results["results"]["suite"]["centered_acc,none"] == pytest.approx(np.mean(centered))
    assert stdout[10] == (f"suite of 10 tasks ({', '.join(BENCHMARKS)}): mean centered accuracy "
                          f"{np.mean(centered):.4f}")


def test_eval_script_errors_are_one_line_with_exit_code_2_before_scoring(tmp_path, capsys, checkpoint, monkeypatch):
    out, *_ = checkpoint
    monkeypatch.chdir(tmp_path)
    assert eval_main([str(out), "--task", "helaswag,arc,piqa", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("error: --task helaswag, arc: neither tasks (hellaswag, arc_easy, arc_challenge, "
                                       "piqa, winogrande, openbookqa, copa, boolq, lambada_openai, mmlu, suite) nor "
                                       "JSONL files of multiple-choice items\n")
    monkeypatch.setitem(eval_main.__globals__, "load_model", lambda *a: pytest.fail("the model was loaded"))
    assert eval_main([str(out), "--task", "piqa", "--output", str(tmp_path / "typo" / "s.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: --output {tmp_path / 'typo' / 's.jsonl'}: the folder {tmp_path / 'typo'} " \
                                      "does not exist\n"
    assert eval_main([str(out), "--task", "piqa", "--task-source", str(tmp_path / "nowhere.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: --task-source {tmp_path / 'nowhere.jsonl'}: no such file or folder\n"


def test_ctrl_c_is_one_line_with_exit_code_130_and_writes_nothing(tmp_path, capsys, checkpoint, monkeypatch):
    out, *_ = checkpoint
    write_jsonl(tmp_path / "mine.jsonl", [{"context": "Two and two", "choices": ["four", "five"], "label": 0}])
    monkeypatch.chdir(tmp_path)

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(Evaluation, "run", interrupted)
    assert eval_main([str(out), "--task", str(tmp_path / "mine.jsonl"), "--device", "cpu"]) == 130
    assert capsys.readouterr().err == "\ninterrupted: nothing was written\n"
    assert not list(tmp_path.glob("eval_*"))


def test_the_progress_shows_in_a_log(tmp_path, capsys, checkpoint, monkeypatch):
    """stdout and stderr are not terminals here (captured): each phase is a line on stderr (every phase's time, as
    LLAMA_PHASE_TIMES asks; a long one would say so after two seconds and every ten)."""
    out, *_ = checkpoint
    write_jsonl(tmp_path / "mine.jsonl", [{"context": "Two and two", "choices": ["four", "five"], "label": 0}] * 3)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLAMA_PHASE_TIMES", "1")
    assert eval_main([str(out), "--task", str(tmp_path / "mine.jsonl"), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "mine: tokenizing 3 items: done in " in err and "mine: scoring: done in " in err
