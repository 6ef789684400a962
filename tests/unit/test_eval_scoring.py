"""The scoring rules of lm-evaluation-harness on hand-made items: the token boundary of a request, the
window's left truncation, the log-likelihoods of a batched pass against one sequence at a time, acc
against acc_norm, the standard error, HellaSwag's preprocessing, the ranks' shares, the rows scored from the
logits (shared one-token continuations, greedy matches and perplexity), passes of fewer rows where rows are long,
the suite's centered accuracy, and --limit on a task of parts."""

import base64
import math
import re

import numpy as np
import pytest

from llama.config import get_preset
from llama.data.tokenizer import ByteTokenizer, Llama3Tokenizer, default_tokenizer_path
from llama.eval.benchmarks import hellaswag_item, hellaswag_process
from llama.eval.items import LOGLIKELIHOOD, Item, Task, TaskError
from llama.eval.runner import Evaluation, accuracy_over_ranks
from llama.eval.scoring import (ItemScore, LineTokens, centered, encode_pair, item_requests, make_passes, make_request,
                                mean_and_stderr, metrics, pass_logit_scores, suite_score)
from llama.eval.benchmarks import BENCHMARKS
from llama.eval.tasks import benchmark_task, load_documents
from llama.model.reference import ReferenceModel
from llama.optim import AdamWConfig
from llama.run.plan import cpu_plan, evaluation_plan
from tests.eval_files import EVALDATA, LetterTokenizer, needs_evaldata


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


def line_tokenizer(tmp_path) -> Llama3Tokenizer:
    """The Llama 3 split pattern over bytes and merges across line breaks and spaces, so that a text split where
    the pattern would not split it gets other tokens."""
    pieces = [bytes([i]) for i in range(256)] + [b"\n ", b"\n \n", b"\r\n", b"\n\n", b"  ", b"\nA", b" A", b":\n"]
    (tmp_path / "tokenizer.model").write_bytes(b"".join(base64.b64encode(p) + b" %d\n" % i
                                                         for i, p in enumerate(pieces)))
    return Llama3Tokenizer(tmp_path / "tokenizer.model")


LINES = ["Q1\nA. a\nAnswer: A\n\nQ2\nAnswer:", "a\n \nb\n  c\n\td", "x:\n\n y\r\nz\r\n\r\nw", "1\n2\n345\n's\n'S",
         "\u3000\n\u3000a\n\xa0b\nc\u2028d\n\x85e\n\x1cf", "one line", "\n\nA", "ends\n", "q\n!?\n\n...\n-x"]


def test_a_context_encoded_line_by_line_gives_the_tokens_of_the_whole(tmp_path):
    tok, lines = line_tokenizer(tmp_path), LineTokens(line_tokenizer(tmp_path))
    for context in LINES:
        for continuation in (" A", "A", "\nA", " B.", "\n", "  x"):
            assert encode_pair(tok, context, continuation, lines) == encode_pair(tok, context, continuation), (
                context, continuation)
    # the test can fail: split after every line break, the tokens differ
    naive = lambda text: [i for line in re.split(r"(?<=\n)", text) for i in tok.encode(line)]  # noqa: E731
    assert any(naive(context) != tok.encode(context) for context in LINES)


def test_a_tokenizer_whose_pieces_cross_lines_encodes_whole_texts():
    words = WordTokenizer()  # "a\nb" is one word: line by line it would be two
    (request,) = item_requests(words, [Item("x a\nb", ("c",), 0)], T=64)
    assert request.inputs + request.targets[-1:] == words.encode("x a\nb c")


REAL_TOKENIZER = default_tokenizer_path()  # read at collection, before the tests' own caches: the user's


@needs_evaldata
@pytest.mark.skipif(not REAL_TOKENIZER.exists(), reason="Meta's tokenizer.model is not in the user's cache")
def test_the_real_tasks_requests_line_by_line_are_those_of_the_whole_texts():
    tok = Llama3Tokenizer(REAL_TOKENIZER)
    for name, benchmark in BENCHMARKS.items():
        task = benchmark_task(benchmark, load_documents(benchmark, None, str(EVALDATA)))
        items = [task.items[i] for i in range(0, len(task.items), max(1, len(task.items) // 300))]  # every subject's
        lines = LineTokens(tok)
        for item in items:
            for context, continuation in item.requests():
                assert encode_pair(tok, context, continuation, lines) == encode_pair(tok, context, continuation), (
                    name, context[-200:], continuation)


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
    item = hellaswag_item(hellaswag_process(doc))
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


def test_a_model_that_only_scores_keeps_only_each_layers_input_and_no_training_state():
    config = get_preset("tiny")
    plan = evaluation_plan(config, "cpu")
    assert plan.device == "cpu" and plan.recompute == "full" and plan.optimizer is None
    assert "scoring only" in plan.summary()
    scoring, training = ReferenceModel(config, plan, seed=1), ReferenceModel(config, cpu_plan(), seed=1)
    assert scoring.grads is scoring.optimizer is scoring.decay_mask is None
    tokens, targets = np.random.default_rng(0).integers(0, config.vocab_size, (2, 1, 16))
    assert scoring.forward(tokens, targets) == training.forward(tokens, targets)
    with pytest.raises(ValueError, match="only scores"):
        scoring.train_step([(tokens, targets)], 1e-3, 1, AdamWConfig())


SHARED = [Item("Question: which letter?\nAnswer:", ("A", "B", "C", "D"), 2),
          Item("Q: another, longer question?\nAnswer:", ("A", "B", "C", "D"), 0),
          Item("Odd one", ("out", "in"), 1)]


def test_one_token_continuations_of_the_same_tokens_share_a_row_scored_from_its_logits():
    tok = LetterTokenizer()
    config = get_preset("tiny").replace(vocab_size=tok.vocab_size)
    model = ReferenceModel(config, cpu_plan(), seed=3)
    shared = Evaluation(Task("mmlu-like", SHARED), tok, B=4, T=64)
    assert [len(p.requests) for p in shared.passes if p.logits] == [2]  # two rows answer the eight " A".." D"
    assert sum(p.answered for p in shared.passes) == shared.rows == 10
    alone = Evaluation(Task("mmlu-like", SHARED), tok, B=4, T=64, logits=False)
    assert not any(p.logits for p in alone.passes) and sum(len(p.requests) for p in alone.passes) == 10
    for a, b in zip(shared.run(model), alone.run(model)):
        assert a.loglikelihoods == pytest.approx(b.loglikelihoods, abs=1e-4) and a.greedy is b.greedy is None


def test_a_loglikelihood_task_scores_the_greedy_match_and_perplexity():
    """lm-eval's loglikelihood output type (LAMBADA): acc is whether every continuation token is the argmax of the
    logits before it; perplexity is exp(-mean log-likelihood), its standard error by the delta method."""
    config = get_preset("tiny").replace(vocab_size=ByteTokenizer.vocab_size)
    model = ReferenceModel(config, cpu_plan(), seed=5)
    model.forward(np.array([ByteTokenizer().encode("hello wor")]))
    best = int(np.argmax(model.read_logits(position=-1)[0]))  # the model's next token after "hello wor"

    class GreedyTokenizer(LetterTokenizer):
        """" A" is the model's argmax after "hello wor": the item continuing with it is a greedy match."""
        def encode(self, text: str, bos: bool = False) -> list[int]:
            return [best if i == 260 else i for i in super().encode(text, bos)]

    tok = GreedyTokenizer()
    items = [Item("ab", ("c",), 0), Item("hello wor", ("ld",), 0), Item("x", ("yzzy",), 0),
             Item("hello wor", ("A",), 0)]
    task = Task("lambada-like", items * 2, LOGLIKELIHOOD, ("perplexity", "acc"))
    scores = Evaluation(task, tok, B=2, T=64).run(model)
    for score, item in zip(scores, task.items):
        context, continuation = encode_pair(tok, item.context, " " + item.choices[0])
        model.forward(np.array([context + continuation])[:, :-1])
        logits = model.read_logits()[0, len(context) - 1:]
        logp = log_softmax(logits)
        assert score.loglikelihoods[0] == pytest.approx(sum(logp[i, t] for i, t in enumerate(continuation)), abs=1e-4)
        assert score.greedy == all(np.argmax(logits[i]) == t for i, t in enumerate(continuation))
    assert scores[3].greedy and scores[7].greedy and [s.correct for s in scores] == [s.greedy for s in scores]
    values = metrics(scores, ("perplexity", "acc"))
    lls = [s.loglikelihoods[0] for s in scores]
    assert values["perplexity"] == pytest.approx(math.exp(-np.mean(lls)))
    assert values["perplexity_stderr"] == pytest.approx(math.exp(-np.mean(lls)) * np.std(lls, ddof=1) / math.sqrt(8))
    assert values["acc"] == np.mean([s.greedy for s in scores])
    with pytest.raises(TaskError, match="lambada-like scores greedy matches from the logits, which a run on several "
                                        "GPUs does not read"):
        Evaluation(task, tok, B=2, T=64, rank=0, world=2)


def test_read_logits_takes_a_position_for_each_row():
    config = get_preset("tiny").replace(vocab_size=ByteTokenizer.vocab_size)
    model = ReferenceModel(config, cpu_plan(), seed=1)
    model.forward(np.random.default_rng(0).integers(0, config.vocab_size, (3, 10)))
    full = model.read_logits()
    assert np.array_equal(model.read_logits(np.array([4, 0, 9])), full[[0, 1, 2], [4, 0, 9]])
    assert np.array_equal(model.read_logits(position=2), full[:, 2])
    assert np.array_equal(model.read_logits(np.array([7, 3]), rows=np.array([2, 0])), full[[2, 0], [7, 3]])


def test_rows_scored_from_the_logits_read_only_the_rows_still_continuing():
    """A pass reads the logits one position at a time, each time of only the rows whose continuation reaches it
    (a LAMBADA pass's rows mostly end after one token): as many rows in all as continuation tokens."""
    tok, config = ByteTokenizer(), get_preset("tiny").replace(vocab_size=ByteTokenizer.vocab_size)
    model = ReferenceModel(config, cpu_plan(), seed=2)
    items = [Item("one two", ("three",), 0), Item("four", ("f",), 0), Item("six seven", ("eight nine",), 0)]
    task = Task("lambada-like", items, LOGLIKELIHOOD, ("perplexity", "acc"))
    evaluation = Evaluation(task, tok, B=4, T=64)
    reads = []

    def read_logits(position, rows):
        reads.append(len(rows))
        return model.read_logits(position, rows)

    model.forward(evaluation.passes[0].tokens)
    scores = pass_logit_scores(evaluation.passes[0], read_logits)
    continuations = sorted(len(r.inputs) - r.start for r in evaluation.passes[0].requests)  # the delimiter's space too
    assert continuations == [2, 6, 11] and reads == [3] * 2 + [2] * 4 + [1] * 5
    full = log_softmax(model.read_logits())
    for request, value, _ in scores:
        positions = np.arange(request.start, len(request.inputs))
        row = evaluation.passes[0].requests.index(request)
        expected = full[row, positions, request.targets[request.start:]].sum()
        assert value == pytest.approx(expected, abs=1e-4)


def test_fewer_rows_a_pass_where_rows_are_long():
    tok = ByteTokenizer()
    task = Task("hand", [Item("x" * 100, ("a", "b"), 0), Item("y", ("c", "d"), 1)])
    evaluation = Evaluation(task, tok, B=8, T=256, max_tokens=312)
    assert evaluation.B == 3  # 312 tokens // 104, the longest row (101 tokens) to a multiple of 8
    assert [p.tokens.shape for p in evaluation.passes] == [(3, 101), (1, 8)] and evaluation.T == 101


def test_chance_centered_accuracy_and_the_suite_score():
    two, four = Task("two", [Item("c", ("a", "b"), 0)] * 3), Task("mixed", [Item("c", ("a", "b", "c", "d"), 0),
                                                                            Item("c", ("a", "b"), 0)])
    lambada = Task("greedy", [Item("c", ("a",), 0)], LOGLIKELIHOOD, ("perplexity", "acc"))
    assert two.chance == 0.5 and four.chance == pytest.approx((0.25 + 0.5) / 2) and lambada.chance == 0.0
    assert centered(0.5, 0.5) == 0.0 and centered(1.0, 0.25) == 1.0 and centered(0.25, 0.5) == -0.5
    # (0.75 - 0.5) / 0.5 = 0.5; (0.375 - 0.375) / 0.625 = 0; (0.3 - 0) / 1 = 0.3
    assert suite_score([(two, 0.75), (four, 0.375), (lambada, 0.3)]) == pytest.approx((0.5 + 0.0 + 0.3) / 3)


def test_a_limit_takes_the_first_items_of_each_part_as_lm_evals_does_of_each_subtask():
    items = [Item(f"q{i}", ("a", "b"), 0) for i in range(7)]
    task = Task("mmlu", items, parts=(("mmlu_x", 3), ("mmlu_y", 1), ("mmlu_z", 3)), num_fewshot=5)
    limited = task.limited(2)
    assert [i.context for i in limited.items] == ["q0", "q1", "q3", "q4", "q5"]
    assert limited.parts == (("mmlu_x", 2), ("mmlu_y", 1), ("mmlu_z", 2)) and limited.original == 7
    assert Task("t", items).limited(3).items == items[:3] and task.limited(None) is task
