"""The evaluation on the GPU models: token_losses() against the reference's, the scores of hand-made
items (with rows of several lengths a pass, and passes shorter than the model's B and T) against the
reference's: fp32 to 1e-3 in each log-likelihood, bf16 within its rounding; the rows scored from the logits
(read_logits at a position of each row: greedy matches, rows shared by one-token continuations) likewise; and
--eval in a bf16 training run: the same losses as without it, the same eval lines after a resume."""

import json

import numpy as np
import pytest

from llama.config import get_preset
from llama.data.tokenizer import ByteTokenizer
from llama.eval.runner import Evaluation
from llama.eval.items import LOGLIKELIHOOD, Item, Task
from llama.model.reference import ReferenceModel
from llama.options import RunOptions
from llama.run.plan import cpu_plan, make_plan
from llama.params import init_parameters
from tests.eval_files import LetterTokenizer
from tests.gpu_helpers import ERRORS
from tests.runs import BASE, check_resume_is_exact, log_lines, run
from tests.system.test_eval_train import ITEMS as TRAINING_ITEMS

pytestmark = pytest.mark.gpu
CONFIG = get_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=ByteTokenizer.vocab_size,
                                    multiple_of=64, max_seq_len=128)
ITEMS = [Item("The cat sat on the", ("mat.", "moon and the stars.", "a"), 0),
         Item("Two plus two is ", ("four", "five"), 1),
         Item("Rain falls", ("down", "up up and away, far over the hills", "sideways", "not"), 3)] * 3


def gpu_model(dtype: str, params: np.ndarray, B: int, T: int):
    if dtype == "fp32":
        from llama.model.gpu_fp32 import GPUModelFP32
        return GPUModelFP32(CONFIG, make_plan(CONFIG, RunOptions("cuda", "fp32")), (B, T), params=params)
    from llama.model.gpu_bf16 import GPUModelBF16
    return GPUModelBF16(CONFIG, make_plan(CONFIG, RunOptions("cuda", "bf16")), (B, T), params=params)


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-4), ("bf16", 0.05)])
def test_token_losses_match_the_references(dtype, tolerance):
    params = init_parameters(CONFIG, seed=2)
    tokens, targets = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 3, 40))
    model = gpu_model(dtype, params, B=4, T=48)
    with pytest.raises(RuntimeError, match="needs a forward"):
        model.token_losses()
    loss = model.forward(tokens, targets)
    reference = ReferenceModel(CONFIG, cpu_plan(), params=params, dtype=np.float64)
    reference.forward(tokens, targets)
    losses = model.token_losses()
    error = float(np.abs(losses - reference.token_losses()).max())
    ERRORS.append((f"eval_token_losses_{dtype}", error))
    assert losses.shape == (3, 40) and error < tolerance and losses.mean() == pytest.approx(loss, abs=1e-3)
    model.forward(tokens)
    with pytest.raises(RuntimeError, match="needs a forward"):
        model.token_losses()


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-3), ("bf16", 0.5)])
def test_scores_match_the_references(dtype, tolerance):
    params = init_parameters(CONFIG, seed=5)
    task, tok = Task("hand", ITEMS), ByteTokenizer()
    reference = ReferenceModel(CONFIG, cpu_plan(), params=params, dtype=np.float64)
    expected = Evaluation(task, tok, B=4, T=64).run(reference)
    scores = Evaluation(task, tok, B=4, T=64).run(gpu_model(dtype, params, B=4, T=64))
    error = max(abs(a - b) for s, e in zip(scores, expected) for a, b in zip(s.loglikelihoods, e.loglikelihoods))
    ERRORS.append((f"eval_loglikelihood_{dtype}", error))
    assert error < tolerance
    if dtype == "fp32":
        assert [s.record()["pred"] for s in scores] == [e.record()["pred"] for e in expected]


SHARED = [Item("Question: which letter?\nAnswer:", ("A", "B", "C", "D"), 2),  # one-token continuations: one row
          Item("Q: and this one, longer?\nAnswer:", ("A", "B", "C", "D"), 0)] * 3
GREEDY = [Item("The cat sat on the", ("mat",), 0), Item("Two plus two is", ("four and more",), 0),
          Item("Rain", ("falls",), 0)] * 3


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-3), ("bf16", 0.5)])
@pytest.mark.parametrize("task", [Task("shared", SHARED), Task("greedy", GREEDY, LOGLIKELIHOOD, ("perplexity", "acc"))],
                         ids=["shared_rows", "greedy"])
def test_rows_scored_from_the_logits_match_the_references(dtype, tolerance, task):
    params = init_parameters(CONFIG, seed=7)
    tok = LetterTokenizer()
    expected = Evaluation(task, tok, B=4, T=64).run(ReferenceModel(CONFIG, cpu_plan(), params=params, dtype=np.float64))
    evaluation = Evaluation(task, tok, B=4, T=64)
    assert all(p.logits for p in evaluation.passes)
    assert sum(len(p.requests) for p in evaluation.passes) == (2 if task.name == "shared" else 9)  # rows
    scores = evaluation.run(gpu_model(dtype, params, B=4, T=64))
    error = max(abs(a - b) for s, e in zip(scores, expected) for a, b in zip(s.loglikelihoods, e.loglikelihoods))
    ERRORS.append((f"eval_logits_{task.name}_{dtype}", error))
    assert error < tolerance
    if dtype == "fp32":
        assert [s.correct for s in scores] == [e.correct for e in expected]


def test_eval_in_a_bf16_run_leaves_its_losses_alone_and_resumes_exactly(corpus, tmp_path):
    items = tmp_path / "romeo.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in TRAINING_ITEMS))
    d6 = ["-e", "d6", "-t", "64"]
    check_resume_is_exact(tmp_path, corpus, "cuda", *d6, "--eval", str(items), "--eval-every", "3")
    a, b = log_lines(tmp_path / "a", "eval"), log_lines(tmp_path / "b", "eval")
    assert sorted(a) == [0, 3, 6, 7] and b == {step: line for step, line in a.items() if step >= 4}
    assert run(*BASE, *d6, *corpus, "-x", "8", "-n", "4", "-o", "plain", device="cuda") == 0
    assert log_lines(tmp_path / "plain") == log_lines(tmp_path / "a")  # the train loss lines, bit for bit
