"""--eval in the training loop on the CPU: s:<step> <key>:<acc> lines in main.log on the schedule, in the
progress and the summary, the training itself unchanged; a resumed run evaluates at the same steps with the
same results."""

import json
import runpy

import pytest

from llama.eval.tasks import HELLASWAG, git_blob_id
from tests.runs import BASE, REPO, check_resume_is_exact, log_lines, run

ITEMS = [{"context": f"ROMEO {i}:", "choices": ["What light", "O Romeo", "zzz qqq"], "label": i % 2} for i in range(5)]
DOC = {"activity_label": "Talking", "ctx_a": "ROMEO speaks.", "ctx_b": "juliet", "label": 1,
       "endings": ["What light", "O Romeo, Romeo", "zzz", "wherefore art thou"]}


@pytest.fixture
def items(tmp_path):
    path = tmp_path / "romeo.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    return str(path)


def test_eval_lines_follow_the_schedule_reach_the_summary_and_the_plot(corpus, tmp_path, items, capsys):
    assert run(*BASE, *corpus, "-x", "5", "--eval", items, "--eval-every", "2", "-o", "out") == 0
    lines = log_lines(tmp_path / "out", "eval")
    assert sorted(lines) == [0, 2, 4]  # every 2 steps, and the last (step 4)
    for line in lines.values():
        acc, norm = line.split()[1:]
        assert acc.startswith("eval:") and norm.startswith("eval_norm:")
        assert float(acc[5:]) in [k / 5 for k in range(6)] and float(norm[10:]) in [k / 5 for k in range(6)]
    out = capsys.readouterr().out
    assert "step 4: romeo acc " in out
    acc = lines[4].split()[1][5:]
    assert f"| eval {acc} (acc_norm " in out and " at step 4 | checkpoint " in out
    read_eval_log = runpy.run_path(str(REPO / "scripts" / "plot_log.py"))["read_eval_log"]
    logged = {step: float(line.split()[1][5:]) for step, line in lines.items()}
    assert read_eval_log(tmp_path / "out" / "main.log") == {"eval": logged}
    assert run(*BASE, *corpus, "-x", "5", "-o", "plain") == 0
    assert log_lines(tmp_path / "plain") == log_lines(tmp_path / "out")  # the training is the same, bit for bit


def test_hellaswag_in_the_loop_logs_llm_cs_hella_lines(corpus, tmp_path, monkeypatch):
    source = tmp_path / "hellaswag_val.jsonl"
    source.write_text(json.dumps(DOC) + "\n")
    monkeypatch.setitem(HELLASWAG, "git_blob", git_blob_id(source))
    assert run(*BASE, *corpus, "-x", "2", "--eval", "hellaswag", "--eval-source", str(source), "-o", "out") == 0
    assert sorted(log_lines(tmp_path / "out", "hella")) == [0, 1]  # --val-every 2's schedule, and the last step


def test_a_bad_eval_task_stops_the_run_before_it_trains(corpus, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"context": "x"}\n')
    assert run(*BASE, *corpus, "--eval", str(tmp_path / "bad.jsonl"), "-o", "out") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: --eval: {tmp_path / 'bad.jsonl'}:1: expected")
    assert not (tmp_path / "out" / "main.log").exists() or "trl:" not in (tmp_path / "out" / "main.log").read_text()


@pytest.mark.slow
def test_a_resumed_run_keeps_the_eval_schedule_and_results(corpus, tmp_path, items):
    check_resume_is_exact(tmp_path, corpus, "cpu", "--eval", items, "--eval-every", "3")
    a, b = log_lines(tmp_path / "a", "eval"), log_lines(tmp_path / "b", "eval")
    assert sorted(a) == [0, 3, 6, 7] and b == {step: line for step, line in a.items() if step >= 4}
