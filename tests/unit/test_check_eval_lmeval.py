"""scripts/check_eval_lmeval.py's pure parts: the items part 2 scores, the Instances handed to HFLM, the scores from
HFLM's results, and the comparison's one-line verdict; and, where lm_eval is installed (its wheels, see the
script), part 1 on a hand-made item of each kind (the lm-eval run itself needs torch)."""

import math
import runpy
from dataclasses import dataclass
from pathlib import Path

import pytest

from llama.eval.items import LOGLIKELIHOOD, Item, Task
from llama.eval.scoring import ItemScore

SCRIPT = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "check_eval_lmeval.py"))
ITEMS = [Item("The cat", ("sat.", "ran away."), 1), Item("A dog  ", ("barked", "slept", "ate"), 0)]


@dataclass
class RecordedInstance:
    """lm_eval.api.instance.Instance's constructor fields (a misspelt keyword is a TypeError, as there)."""
    request_type: str
    doc: dict
    arguments: tuple
    idx: int
    metadata: tuple


def test_each_request_is_a_loglikelihood_instance_numbered_by_its_item_and_choice():
    requests = SCRIPT["instances"]([item.requests() for item in ITEMS], "arc_easy", RecordedInstance)
    assert [r.arguments for r in requests] == [("The cat", " sat."), ("The cat", " ran away."), ("A dog  ", " barked"),
                                               ("A dog  ", " slept"), ("A dog  ", " ate")]
    assert [r.idx for r in requests] == [0, 1, 0, 1, 2]
    assert [r.metadata for r in requests] == [("arc_easy", 0, 1)] * 2 + [("arc_easy", 1, 1)] * 3
    assert {r.request_type for r in requests} == {"loglikelihood"}


def test_part_two_takes_the_first_items_or_the_first_of_each_subject():
    task = Task("arc_easy", ITEMS * 5)
    assert SCRIPT["picks"](task, 3) == [0, 1, 2] and SCRIPT["picks"](task, 500) == list(range(10))
    mmlu = Task("mmlu", ITEMS * 5, parts=(("mmlu_a", 4), ("mmlu_b", 1), ("mmlu_c", 5)))
    assert SCRIPT["picks"](mmlu, 6) == [0, 1, 4, 5, 6]  # two of each subject, as many as a subject has


def test_results_become_item_scores_with_lm_evals_gold_and_lengths():
    results = [(-3.0, False), (-4.0, False), (-1.0, True), (-2.0, False), (-6.0, False)]
    first, second = SCRIPT["scores_from_results"](Task("t", ITEMS), [(1, (4, 9)), (2, (6, 5, 3))], results)
    assert first == ItemScore(0, 1, (-3.0, -4.0), (4, 9))
    assert first.prediction == 0 and first.prediction_norm == 1  # -4/9 > -3/4
    assert second.label == 2 and second.loglikelihoods == (-1.0, -2.0, -6.0) and second.lengths == (6, 5, 3)
    with pytest.raises(ValueError, match="4 results for 5 requests"):
        SCRIPT["scores_from_results"](Task("t", ITEMS), [(1, (4, 9)), (2, (6, 5, 3))], results[:4])
    lambada = Task("lambada_openai", [Item("He said", ("hi",), 0)] * 2, LOGLIKELIHOOD, ("perplexity", "acc"))
    scores = SCRIPT["scores_from_results"](lambada, [(0, (0,))] * 2, [(-2.0, True), (-5.0, False)])
    assert [s.greedy for s in scores] == [True, False] and [s.correct for s in scores] == [True, False]


class StubLmTask:
    """lm_eval_documents' task side: the requests, gold and lengths lm-eval would give each document (here: a
    document is the item itself, or a changed copy)."""

    def requests(self, doc, shots=0):
        return doc.requests()

    def gold_and_lengths(self, doc):
        return doc.label, tuple(map(len, doc.choices))


def test_part_one_checks_every_item_or_those_part_two_scores():
    task, lm_task = Task("arc_easy", ITEMS * 3), StubLmTask()
    agreeing = [(lm_task, item) for item in task.items]
    assert SCRIPT["check_requests"](agreeing, task) is None
    changed = list(agreeing)
    changed[3] = (lm_task, Item("A dog ", ITEMS[1].choices, 0))  # their context lost a space
    assert SCRIPT["check_requests"](changed, task) == ("item 3, request 0: ours ('A dog  ', ' barked') vs lm-eval's "
                                                       "('A dog ', ' barked')")
    assert SCRIPT["check_requests"](changed, task, [0, 1, 2]) is None  # item 3 is not part 2's
    changed[4] = (lm_task, Item("The cat", ITEMS[0].choices, 0))
    assert SCRIPT["check_requests"](changed, task, [4]) == ("item 4: label 1, lengths (4, 9) (ours) vs 0, (4, 9) "
                                                            "(lm-eval's)")


def test_scored_only_and_requests_only_exclude_each_other(capsys):
    assert SCRIPT["main"](["--scored-only", "--requests-only"]) == 2
    assert "--requests-only runs no part 2" in capsys.readouterr().err


def scores(*loglikelihoods, lengths=(4, 4), label=0) -> list[ItemScore]:
    return [ItemScore(i, label, tuple(values), lengths) for i, values in enumerate(loglikelihoods)]


def test_agreeing_scores_pass():
    ours = scores((-1.0, -2.0), (-3.0, -2.5))
    theirs = scores((-1.0005, -2.0), (-3.0, -2.5009))
    assert SCRIPT["mismatch"](ours, theirs, ("acc", "acc_norm")) is None


@pytest.mark.parametrize("value", [-2.0021, math.nan])
def test_a_log_likelihood_past_the_tolerance_is_named(value):
    message = SCRIPT["mismatch"](scores((-1.0, -2.0), (-3.0, value)), scores((-1.0, -2.0), (-3.0, -2.0)), ("acc",))
    assert message.startswith("item 1, choice 1: log-likelihood ")
    assert "(lm-eval's HFLM)" in message and "tolerance 1e-03" in message and "\n" not in message


def test_a_near_tie_that_flips_acc_fails_on_acc():
    ours, theirs = scores((-1.0, -1.0004), (-5.0, -1.0)), scores((-1.0004, -1.0), (-5.0, -1.0))
    assert SCRIPT["mismatch"](ours, theirs, ("acc", "acc_norm")) == (
        "acc 0.5000 (ours) vs 0.0000 (lm-eval's HFLM); 1 of 2 items differ")


def test_a_near_tie_that_flips_acc_norm_alone_fails_on_acc_norm():
    # lengths 4 and 8: acc picks choice 0 on both sides, acc_norm (per character) flips with a 4e-4 difference
    ours = scores((-1.0, -2.0006), lengths=(4, 8))
    theirs = scores((-1.0, -1.9998), lengths=(4, 8))
    assert SCRIPT["mismatch"](ours, theirs, ("acc", "acc_norm")) == (
        "acc_norm 1.0000 (ours) vs 0.0000 (lm-eval's HFLM); 1 of 1 items differ")
    assert SCRIPT["mismatch"](ours, theirs, ("acc",)) is None  # a task that does not report acc_norm


def test_a_greedy_match_that_differs_fails_on_acc():
    ours = [ItemScore(0, 0, (-1.0,), (2,), True), ItemScore(1, 0, (-2.0,), (2,), False)]
    theirs = [ItemScore(0, 0, (-1.0,), (2,), True), ItemScore(1, 0, (-2.0,), (2,), True)]
    assert SCRIPT["mismatch"](ours, theirs, ("perplexity", "acc")) == (
        "acc 0.5000 (ours) vs 1.0000 (lm-eval's HFLM); 1 of 2 items differ")


def test_part_one_builds_lm_evals_requests_with_lm_evals_code(tmp_path):
    """Needs lm_eval (and jinja2): the installed task YAMLs render hand-made documents of three kinds (a template,
    Winogrande's multiple inputs, MMLU's five shots) to the requests our items make."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("jinja2")
    lm = SCRIPT["LmEval"]()
    arc = SCRIPT["LmEvalTask"](lm, lm.configs["arc/arc_easy.yaml"])
    doc = {"question": "Which is a gas?", "choices": {"text": ["ice", "steam"], "label": ["A", "B"]}, "answerKey": "B"}
    assert arc.requests(doc) == [("Question: Which is a gas?\nAnswer:", " ice"), ("Question: Which is a gas?\nAnswer:",
                                                                                   " steam")]
    assert arc.gold_and_lengths(doc) == (1, (3, 5))
    wino = SCRIPT["LmEvalTask"](lm, lm.configs["winogrande/default.yaml"])
    assert wino.requests({"sentence": "Ann thanked Bea because _ helped.", "option1": "Ann", "option2": "Bea",
                          "answer": "2"}) == [("Ann thanked Bea because Ann", " helped."),
                                              ("Ann thanked Bea because Bea", " helped.")]
    shots = [{"question": f"Q{i} ", "subject": "anatomy", "choices": ["a", "b", "c", "d"], "answer": i % 4}
             for i in range(6)]
    mmlu = SCRIPT["LmEvalTask"](lm, lm.configs["mmlu/default/mmlu_anatomy.yaml"], shots)
    context, continuation = mmlu.requests(shots[5], 5)[1]
    assert continuation == " B" and context.startswith(
        "The following are multiple choice questions (with answers) about anatomy.\n\nQ0\nA. a\nB. b\nC. c\nD. d\n"
        "Answer: A\n\nQ1\n") and context.endswith("Answer: D\n\nQ4\nA. a\nB. b\nC. c\nD. d\nAnswer: A\n\nQ5\nA. a\n"
                                                  "B. b\nC. c\nD. d\nAnswer:")
