"""--eval in the training loop on the CPU: s:<step> <key>:<acc> lines in main.log on the schedule, for each task,
in the progress and the summary, the training itself unchanged; a resumed run evaluates at the same steps with the
same results; a task whose file cannot be had stops the run before it trains, naming the trainer's own option."""

import json
import runpy

import pytest

from tests.eval_files import EVALDATA, accept, needs_evaldata, write_jsonl
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
    accept(monkeypatch, "hellaswag", source, count=1)
    assert run(*BASE, *corpus, "-x", "2", "--eval", "hellaswag", "--eval-source", str(source), "-o", "out") == 0
    assert sorted(log_lines(tmp_path / "out", "hella")) == [0, 1]  # --val-every 2's schedule, and the last step


def test_several_tasks_log_a_line_each_and_reach_the_progress_the_summary_and_the_plot(corpus, tmp_path, monkeypatch,
                                                                                        capsys):
    copies = tmp_path / "copies"
    copies.mkdir()
    write_jsonl(copies / "arc_easy.jsonl", [{"query": f"Question: Who speaks {i}?", "choices": ["ROMEO", "JULIET"],
                                             "gold": i % 2} for i in range(4)])
    write_jsonl(copies / "winogrande.jsonl", [{"context_options": ["ROMEO speaks to", "JULIET speaks to"],
                                               "continuation": "the moon.", "gold": 0}] * 3)
    accept(monkeypatch, "arc_easy", count=4)
    accept(monkeypatch, "winogrande", count=3)
    monkeypatch.setenv("LLAMA_PHASE_TIMES", "1")  # every phase a line on stderr, however short
    assert run(*BASE, *corpus, "-x", "3", "--eval", "arc_easy,winogrande", "--eval-every", "2",
               "--eval-source", str(copies), "-o", "out") == 0
    arc, wino = log_lines(tmp_path / "out", "arc_easy"), log_lines(tmp_path / "out", "winogrande")
    assert sorted(arc) == sorted(wino) == [0, 2]  # every 2 steps, and the last (step 2)
    assert all(line.split()[2].startswith("arc_easy_norm:") for line in arc.values())  # ARC reports acc_norm
    assert all(len(line.split()) == 2 for line in wino.values())  # Winogrande acc alone
    out, err = capsys.readouterr()
    assert "step 2: arc_easy acc " in out and "step 2: winogrande acc " in out
    assert "--eval: tokenizing arc_easy: done in " in err and "step 2: evaluating winogrande: done in " in err
    logged = {key: {step: accuracy(line) for step, line in lines.items()} for key, lines in (("arc_easy", arc),
                                                                                            ("winogrande", wino))}
    assert f"| arc_easy {logged['arc_easy'][2]:.4f} (acc_norm " in out
    assert f", winogrande {logged['winogrande'][2]:.4f} at step 2 | " in out
    read_eval_log = runpy.run_path(str(REPO / "scripts" / "plot_log.py"))["read_eval_log"]
    assert read_eval_log(tmp_path / "out" / "main.log") == logged


def accuracy(line: str) -> float:
    """The acc of an --eval line s:<step> <key>:<acc> ..."""
    return float(line.split()[1].split(":")[1])


@needs_evaldata
def test_the_suite_in_the_loop_logs_each_task_and_the_mean_centered_accuracy(corpus, tmp_path, capsys):
    assert run(*BASE, "-e", "small", "-t", "256", *corpus, "-x", "1", "--eval", "suite", "--eval-limit", "1",
               "--eval-source", str(EVALDATA), "-o", "out") == 0
    keys = ["hella", "arc_easy", "arc_challenge", "piqa", "winogrande", "openbookqa", "copa", "boolq", "lambada",
            "mmlu"]
    lines = {key: log_lines(tmp_path / "out", key)[0] for key in keys}
    assert lines["lambada"].split()[2].startswith("lambada_ppl:") and len(lines["mmlu"].split()) == 2
    chance = {"lambada": 0.0, "piqa": 0.5, "winogrande": 0.5, "copa": 0.5, "boolq": 0.5}
    centered = [(accuracy(lines[k]) - chance.get(k, 0.25)) / (1 - chance.get(k, 0.25)) for k in keys]
    suite = log_lines(tmp_path / "out", "suite")[0]
    assert accuracy(suite) == pytest.approx(sum(centered) / 10, abs=1e-4)
    assert f"step 0: suite of 10 tasks, mean centered accuracy {accuracy(suite):.4f}" in capsys.readouterr().out


def test_a_task_that_cannot_be_downloaded_names_the_trainers_source_option(corpus, tmp_path, capsys):
    assert run(*BASE, *corpus, "--eval", "lambada_openai", "--eval-source", "http://127.0.0.1:9/", "-o", "out") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: --eval: http://127.0.0.1:9/gpt-2/data/lambada_test.jsonl: ")
    assert error.endswith("; or name a copy (lambada_test.jsonl, lambada_openai.jsonl) or a folder holding one with "
                          "--eval-source")


def test_a_bad_eval_task_stops_the_run_before_it_trains(corpus, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"context": "x"}\n')
    assert run(*BASE, *corpus, "--eval", str(tmp_path / "bad.jsonl"), "-o", "out") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == f"error: --eval: {tmp_path / 'bad.jsonl'}:1: field 'choices' is missing"
    assert not (tmp_path / "out" / "main.log").exists() or "trl:" not in (tmp_path / "out" / "main.log").read_text()


@pytest.mark.slow
def test_a_resumed_run_keeps_the_eval_schedule_and_results(corpus, tmp_path, items):
    check_resume_is_exact(tmp_path, corpus, "cpu", "--eval", items, "--eval-every", "3")
    a, b = log_lines(tmp_path / "a", "eval"), log_lines(tmp_path / "b", "eval")
    assert sorted(a) == [0, 3, 6, 7] and b == {step: line for step, line in a.items() if step >= 4}
