"""scripts/check_eval_lmeval.py's pure parts: the requests as lm-eval's multiple_choice task builds them, the scores
from HFLM's results, and the comparison's one-line verdict (the lm-eval run itself needs torch and its wheels)."""

import math
import runpy
from dataclasses import dataclass
from pathlib import Path

import pytest

from llama.eval.scoring import ItemScore
from llama.eval.tasks import Item

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


def test_each_choice_is_a_loglikelihood_request_of_the_context_and_the_delimited_choice():
    requests = SCRIPT["multiple_choice_instances"](ITEMS, RecordedInstance)
    assert [r.arguments for r in requests] == [("The cat", " sat."), ("The cat", " ran away."), ("A dog  ", " barked"),
                                               ("A dog  ", " slept"), ("A dog  ", " ate")]
    assert [r.idx for r in requests] == [0, 1, 0, 1, 2]
    assert [r.metadata[1] for r in requests] == [0, 0, 1, 1, 1]  # doc_id: the item
    assert {r.request_type for r in requests} == {"loglikelihood"}
    assert requests[2].doc == {"context": "A dog  ", "choices": ["barked", "slept", "ate"], "label": 0}


def test_results_become_item_scores_with_lengths_in_characters():
    results = [(-3.0, False), (-4.0, False), (-1.0, True), (-2.0, False), (-6.0, False)]
    first, second = SCRIPT["scores_from_results"](ITEMS, results)
    assert first == ItemScore(0, 1, (-3.0, -4.0), (4, 9))
    assert first.prediction == 0 and first.prediction_norm == 1  # -4/9 > -3/4
    assert second.loglikelihoods == (-1.0, -2.0, -6.0) and second.lengths == (6, 5, 3)
    with pytest.raises(ValueError, match="4 results for 5 requests"):
        SCRIPT["scores_from_results"](ITEMS, results[:4])


def scores(*loglikelihoods, lengths=(4, 4), label=0) -> list[ItemScore]:
    return [ItemScore(i, label, tuple(values), lengths) for i, values in enumerate(loglikelihoods)]


def test_agreeing_scores_pass():
    ours = scores((-1.0, -2.0), (-3.0, -2.5))
    theirs = scores((-1.0005, -2.0), (-3.0, -2.5009))
    assert SCRIPT["mismatch"](ours, theirs) is None


@pytest.mark.parametrize("value", [-2.0021, math.nan])
def test_a_log_likelihood_past_the_tolerance_is_named(value):
    message = SCRIPT["mismatch"](scores((-1.0, -2.0), (-3.0, value)), scores((-1.0, -2.0), (-3.0, -2.0)))
    assert message.startswith("item 1, choice 1: log-likelihood ")
    assert "(lm-eval's HFLM)" in message and "tolerance 1e-03" in message and "\n" not in message


def test_a_near_tie_that_flips_acc_fails_on_acc():
    ours, theirs = scores((-1.0, -1.0004), (-5.0, -1.0)), scores((-1.0004, -1.0), (-5.0, -1.0))
    assert SCRIPT["mismatch"](ours, theirs) == ("acc 0.5000 (ours) vs 0.0000 (lm-eval's HFLM); 1 of 2 items pick "
                                                "another choice")


def test_a_near_tie_that_flips_acc_norm_alone_fails_on_acc_norm():
    # lengths 4 and 8: acc picks choice 0 on both sides, acc_norm (per character) flips with a 4e-4 difference
    ours = scores((-1.0, -2.0006), lengths=(4, 8))
    theirs = scores((-1.0, -1.9998), lengths=(4, 8))
    assert SCRIPT["mismatch"](ours, theirs) == ("acc_norm 1.0000 (ours) vs 0.0000 (lm-eval's HFLM); 1 of 1 items "
                                                "pick another choice")
