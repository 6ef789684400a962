"""The scoring rules of lm-evaluation-harness on hand-made items: the token boundary of a request, the
window's left truncation, the log-likelihoods of a batched pass against one sequence at a time, acc
against acc_norm, the standard error, HellaSwag's preprocessing, and the ranks' shares."""

import math
import re

import numpy as np
import pytest

from llama.config import get_preset
from llama.data.tokenizer import ByteTokenizer
from llama.eval.runner import Evaluation, accuracy_over_ranks
from llama.eval.scoring import (ItemScore, encode_pair, make_passes, make_request, mean_and_stderr, metrics,
                                item_requests)
from llama.eval.tasks import Item, Task, hellaswag_item
from llama.model.reference import ReferenceModel
from llama.run.plan import cpu_plan, evaluation_plan


class WordTokenizer:
    """A tokenizer whose tokens are words with their leading space (" sat"), or a lone space: where text is
    split changes the tokens, as with a BPE tokenizer."""

    def __init__(self):
        self.ids = {}

    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(piece, len(self.ids)) for piece in re.findall(r" ?[^ ]+| ", text)]


def test_the_continuation_is_what_the_whole_text_adds_after_the_contexts_tokens():
    tok = WordTokenizer()
    context, continuation = encode_pair(tok, "A man sat", " down.")
    assert context == tok.encode("A man sat") and continuation == tok.encode(" down.")


def test_a_contexts_trailing_space_moves_to_the_continuation():
    tok = WordTokenizer()
    context, continuation = encode_pair(tok, "A man ", " sat")  # lm-eval's rule: "A man" | "  sat"
    assert context == tok.encode("A man")
    assert continuation == [tok.ids[" "], tok.ids[" sat"]]


def test_a_request_reads_context_then_continuation_and_predicts_the_continuation_at_its_end():
    tok = ByteTokenizer()
    item = Item("abc", ("de", "x"), 0)
    request = make_request(tok, item, 0, 0, T=16)
    ids = tok.encode("abc de")
    assert request.inputs == ids[:-1] and request.targets == ids[1:]
    assert request.targets[request.start:] == tok.encode(" de")


def test_a_request_longer_than_the_window_loses_tokens_from_the_left():
    tok = ByteTokenizer()
    request = make_request(tok, Item("abcdefgh", ("ij",), 0), 0, 0, T=5)
    ids = tok.encode("abcdefgh ij")
    assert request.inputs == ids[-6:-1] and request.targets == ids[-5:] and request.start == 2
    with pytest.raises(ValueError, match="continuation has 4 tokens; it must have 1 to 3"):
        make_request(tok, Item("ab", ("xyz",), 0), 0, 0, T=3)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


ITEMS = [Item("The cat sat on the", ("mat.", "moon and the stars.", "a"), 0),
         Item("Two plus two is ", ("four", "five"), 1),
         Item("Rain falls", ("down", "up up and away", "sideways", "not"), 3)]


def test_a_batched_pass_gives_each_choice_the_sum_of_its_tokens_log_probs_alone():
    tok = ByteTokenizer()
    config = get_preset("tiny").replace(vocab_size=tok.vocab_size)
    model = ReferenceModel(config, cpu_plan(), seed=3)
    scores = Evaluation(Task("hand", ITEMS), tok, B=4, T=64).run(model)
    for score, item in zip(scores, ITEMS):
        for c, choice in enumerate(item.choices):
            context, continuation = encode_pair(tok, item.context, " " + choice)
            ids = np.array([context + continuation])
            model.forward(ids[:, :-1])
            logp = log_softmax(model.read_logits()[0])
            expected = sum(logp[len(context) - 1 + i, token] for i, token in enumerate(continuation))
            assert score.loglikelihoods[c] == pytest.approx(expected, abs=1e-4)


def test_passes_hold_b_rows_longest_first_padded_to_a_multiple_of_8():
    tok = ByteTokenizer()
    requests = item_requests(tok, ITEMS, T=64)
    passes = make_passes(requests, B=4)
    assert [len(p.requests) for p in passes] == [4, 4, 1]
    lengths = [len(r.inputs) for p in passes for r in p.requests]
    assert lengths == sorted(lengths, reverse=True)
    assert passes[0].tokens.shape[1] == lengths[0]  # the longest request: not padded past it
    assert all(p.tokens.shape[1] % 8 == 0 for p in passes[1:])


def test_acc_takes_the_largest_sum_and_acc_norm_the_largest_sum_per_character():
    score = ItemScore(0, 1, (-4.0, -6.0), (2, 6))  # per character: -2.0 and -1.0
    assert score.prediction == 0 and score.prediction_norm == 1
    assert metrics([score]) == {"acc": 0.0, "acc_stderr": pytest.approx(float("nan"), nan_ok=True),
                                "acc_norm": 1.0, "acc_norm_stderr": pytest.approx(float("nan"), nan_ok=True)}
    assert score.record() == {"index": 0, "label": 1, "loglikelihoods": [-4.0, -6.0], "pred": 0, "pred_norm": 1,
                              "acc": 0, "acc_norm": 1}


def test_the_standard_error_is_lm_evals_sample_stddev_over_root_n():
    values = [1.0, 0.0, 1.0, 1.0, 0.0]
    mean, stderr = mean_and_stderr(values)
    assert mean == 0.6 and stderr == pytest.approx(np.std(values, ddof=1) / math.sqrt(5), rel=1e-12)


def test_hellaswag_items_are_built_as_lm_evals_process_docs():
    doc = {"activity_label": "Making a cake", "ctx_a": "A woman mixes flour.", "ctx_b": "she [header] Then ADDS",
           "endings": ["eggs [title] and milk.", "  a  dog."], "label": "1"}
    item = hellaswag_item(doc)
    # ctx_b.capitalize() lowercases the rest; " [title]" -> ". "; other [tags] go; double spaces become one
    assert item.context == "Making a cake: A woman mixes flour. She then adds"
    assert item.choices == ("eggs. and milk.", "a dog.") and item.label == 1


def test_the_ranks_shares_cover_the_items_once_in_the_same_number_of_passes():
    tok = ByteTokenizer()
    config = get_preset("tiny").replace(vocab_size=tok.vocab_size)
    model = ReferenceModel(config, cpu_plan(), seed=3)
    task = Task("hand", ITEMS)
    whole = {s.index: s for s in Evaluation(task, tok, B=2, T=64).run(model)}
    shares = [Evaluation(task, tok, B=2, T=64, rank=r, world=2) for r in range(2)]
    assert shares[0].pass_count == shares[1].pass_count == 4  # 7 rows and 2 rows of 2: the larger count
    forwards = []
    model.forward = lambda *args, original=model.forward: forwards.append(args[0].shape) or original(*args)
    split = [s for share in shares for s in share.run(model)]
    assert len(forwards) == 8 and forwards[-3:] == [(1, 8)] * 3  # rank 1 fills its last three passes
    assert sorted(s.index for s in split) == [0, 1, 2]
    for s in split:
        assert s.loglikelihoods == pytest.approx(whole[s.index].loglikelihoods, abs=1e-5)
    assert accuracy_over_ranks(split) == accuracy_over_ranks(list(whole.values()))


def test_token_losses_are_each_targets_cross_entropy_and_average_to_the_loss():
    config = get_preset("tiny").replace(vocab_size=ByteTokenizer.vocab_size)
    model = ReferenceModel(config, cpu_plan(), seed=1)
    tokens, targets = np.random.default_rng(0).integers(0, config.vocab_size, (2, 2, 12))
    with pytest.raises(RuntimeError, match="needs a forward"):
        model.token_losses()
    loss = model.forward(tokens, targets)
    losses = model.token_losses()
    logp = log_softmax(model.read_logits())
    assert losses.shape == (2, 12) and losses.mean() == pytest.approx(loss, rel=1e-6)
    assert losses == pytest.approx(-np.take_along_axis(logp, targets[..., None], -1)[..., 0], abs=1e-5)


def test_a_model_that_only_scores_keeps_only_each_layers_input():
    plan = evaluation_plan(get_preset("tiny"), "cpu")
    assert plan.device == "cpu" and plan.recompute == "full"
