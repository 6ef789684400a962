"""Chat fine-tuning and the document mask through the trainer (issue 44): --sft and --doc-mask in the command
line and the plan, the loss mask in the reference (targets < 0 not counted), the step's normalisation by its
counted targets (the same update whatever the accumulation), and a tiny --sft run on shards that
llama/data/prepare.py wrote from conversations."""

import base64
import json

import numpy as np
import pytest

import train_llama
from llama.config import get_preset
from llama.data.dataloader import DataLoader
from llama.data.prepare import PrepareOptions, prepare_dataset
from llama.data.shards import ShardError, mask_path, write_shard
from llama.data.tokenizer import Llama3Tokenizer
from llama.model.reference import ReferenceModel
from llama.optim import AdamWConfig
from llama.params import init_parameters
from llama.options import RunOptions
from llama.run.plan import PlanError, cpu_plan, make_plan
from llama.twins.classifier import fused_classifier
from tests.gradcheck import model_gradient_errors
from tests.runs import check_resume_is_exact, losses
from tests.sample_files import ranks_file_bytes

BOS = 1
V = 23


def tiny_model(**options) -> ReferenceModel:
    """The tiny reference in float64 with a CPU plan of these RunOptions."""
    config = get_preset("tiny").replace(dim=16, n_heads=4, n_kv_heads=2, vocab_size=V)
    model = ReferenceModel(config, cpu_plan(**options), dtype=np.float64, seed=1)
    model.params *= 5  # larger weights than init, so that every path matters
    return model


# ---- the command line and the plan

@pytest.mark.parametrize("argv, doc_mask, sft", [([], False, False), (["--sft"], True, True),
                                                 (["--doc-mask", "on"], True, False),
                                                 (["--sft", "--doc-mask", "on"], True, True),
                                                 (["--doc-mask", "off"], False, False)])
def test_doc_mask_and_sft_reach_the_plan(argv, doc_mask, sft):
    args = train_llama.parse_args([*argv, "--device", "cpu"])
    plan = make_plan(get_preset("tiny"), RunOptions.from_args(args, bos_id=BOS))
    assert (plan.doc_mask, plan.doc_mask_bos, plan.sft) == (doc_mask, BOS if doc_mask else None, sft)
    assert ("document mask" in plan.summary()) == doc_mask
    assert ("SFT loss mask" in plan.summary()) == sft


def test_the_document_mask_needs_the_bos_id_it_starts_documents_at():
    with pytest.raises(PlanError, match="the document mask needs the tokenizer's BOS id"):
        make_plan(get_preset("tiny"), RunOptions(device="cpu", doc_mask="on"))
    assert make_plan(get_preset("tiny"), RunOptions(device="cpu", doc_mask="off")).doc_mask_bos is None


def test_sft_refuses_the_mask_off_and_a_bad_value_is_a_usage_error(capsys):
    with pytest.raises(PlanError, match="--sft with --doc-mask off"):
        make_plan(get_preset("tiny"), RunOptions(device="cpu", doc_mask="off", sft=True))
    with pytest.raises(SystemExit) as exit_info:
        train_llama.parse_args(["--doc-mask", "maybe"])
    assert exit_info.value.code == 2 and "invalid choice: 'maybe'" in capsys.readouterr().err


# ---- the loss mask in the reference

def test_ignored_targets_have_no_loss_and_no_gradient():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 7))
    targets = np.array([3, -1, 0, -1, 6])
    losses, dlogits = fused_classifier(logits, targets, 0.5)
    full_losses, full_dlogits = fused_classifier(logits, np.where(targets < 0, 2, targets), 0.5)
    counted = targets >= 0
    np.testing.assert_array_equal(losses[counted], full_losses[counted])
    np.testing.assert_array_equal(dlogits[counted], full_dlogits[counted])
    assert not losses[~counted].any() and not dlogits[~counted].any()


@pytest.mark.slow
def test_reference_loss_mask_is_the_mean_over_counted_targets():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (2, 9))
    targets = rng.integers(0, V, (2, 9))
    targets[0, :4] = targets[1, 6:] = -1
    model = tiny_model()
    loss = model.forward(tokens, targets)
    logits = model.read_logits()
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    by_hand = [-log_probs[b, t, targets[b, t]] for b, t in zip(*np.nonzero(targets >= 0))]
    assert loss == pytest.approx(np.mean(by_hand), rel=1e-12)
    errors = model_gradient_errors(tiny_model(), tokens, targets, rng)
    assert max(errors.values()) < 1e-6, errors
    assert model.forward(tokens, np.full_like(targets, -1)) == 0.0
    model.backward()
    assert not model.grads.any()


def test_two_documents_in_one_row_are_the_documents_alone():
    """With the document mask and the loss mask, a row packing two conversations gives the loss and gradients
    of the two run alone, each weighted by its counted targets."""
    rng = np.random.default_rng(2)
    lengths = (7, 6)
    docs = [np.concatenate([[BOS], rng.integers(2, V, n - 1)]) for n in lengths]
    doc_targets = [rng.integers(0, V, n) for n in lengths]
    for targets in doc_targets:
        targets[:2] = -1  # the prompt
    doc_targets[0][-1] = -1  # the first document's last target is the second's BOS
    tokens, targets = np.concatenate(docs)[None], np.concatenate(doc_targets)[None]
    counted = int(np.count_nonzero(targets >= 0))
    packed = tiny_model(doc_mask="on", bos_id=BOS)
    loss = packed.forward(tokens, targets)
    packed.backward()
    alone, alone_loss = tiny_model(), 0.0
    for doc, doc_target in zip(docs, doc_targets):
        share = np.count_nonzero(doc_target >= 0) / counted
        alone_loss += alone.forward(doc[None], doc_target[None]) * share
        alone.backward(loss_scale=share)
    assert loss == pytest.approx(alone_loss, rel=1e-12)
    np.testing.assert_allclose(packed.grads, alone.grads, rtol=1e-9, atol=1e-12)


# ---- the step's normalisation

def masked_batch(rng, B=4, T=10):
    tokens = rng.integers(0, V, (B, T))
    targets = rng.integers(0, V, (B, T))
    targets[rng.random((B, T)) < np.linspace(0.1, 0.8, B)[:, None]] = -1  # rows count unequally
    return tokens, targets


def one_step_whole_and_in_two(make_model, tokens, targets) -> tuple:
    """Two models of make_model() after the same step on (tokens, targets) normalised by its counted targets, whole
    and in two micro-batches, their losses and norms checked to agree: (one, two, the loss, the counted targets)."""
    counted = float(np.count_nonzero(targets >= 0))
    opt = AdamWConfig(weight_decay=0.1, grad_clip=1.0)
    one, two = make_model(), make_model()
    loss_one, norm_one = one.train_step([(tokens, targets)], 1e-3, 1, opt, counted=counted)
    loss_two, norm_two = two.train_step([(tokens[:2], targets[:2]), (tokens[2:], targets[2:])], 1e-3, 1, opt,
                                        counted=counted)
    assert loss_one == pytest.approx(loss_two, rel=1e-12) and norm_one == pytest.approx(norm_two, rel=1e-12)
    np.testing.assert_allclose(one.get_params(), two.get_params(), rtol=1e-12, atol=1e-15)
    return one, two, loss_one, counted


def test_sft_normalisation_does_not_depend_on_the_accumulation():
    rng = np.random.default_rng(3)
    tokens, targets = masked_batch(rng)
    _, _, loss_one, counted = one_step_whole_and_in_two(tiny_model, tokens, targets)
    plain = tiny_model()
    assert loss_one == pytest.approx(plain.forward(tokens, targets), rel=1e-12)  # the mean over counted targets
    # one micro-batch a step: the optimizer in the backward takes the same step (unclipped: its first step clips
    # by an estimate of the norm)
    unclipped = AdamWConfig(weight_decay=0.1, grad_clip=0.0)
    inside, after = tiny_model(in_backward=True), tiny_model()
    assert inside.train_step([(tokens, targets)], 1e-3, 1, unclipped, counted=counted)[0] == pytest.approx(loss_one)
    after.train_step([(tokens, targets)], 1e-3, 1, unclipped, counted=counted)
    np.testing.assert_allclose(inside.params, after.params, rtol=1e-12, atol=1e-15)


def test_a_step_without_counted_targets_changes_nothing_and_divides_by_nothing():
    rng = np.random.default_rng(4)
    tokens, _ = masked_batch(rng)
    model = tiny_model()
    before = model.params.copy()
    loss, norm = model.train_step([(tokens, np.full_like(tokens, -1))], 1e-3, 1, AdamWConfig(weight_decay=0.0),
                                  counted=0.0)
    assert (loss, norm) == (0.0, 0.0)
    np.testing.assert_array_equal(model.params, before)


# ---- through the trainer, on chat shards

CONVERSATIONS = [{"messages": [{"role": "user", "content": f"what is {i} and {i + 1}?"},
                               {"role": "assistant", "content": f"{i} and {i + 1} make {2 * i + 1}."}]}
                 for i in range(120)]


def write_chat_shards(tmp_path) -> tuple:
    """(tokenizer.model, the folder of the chat shards) in tmp_path: the tests' Llama 3 format tokenizer with three
    more merges, 264 ranks and 256 special tokens, a vocab of 520 (bf16 rows of whole 16-byte vectors on the GPU)."""
    merges = [b"er", b"on", b"an"]
    tokenizer_path = tmp_path / "tokenizer.model"
    tokenizer_path.write_bytes(ranks_file_bytes() + b"".join(base64.b64encode(token) + b" %d\n" % (261 + i)
                                                             for i, token in enumerate(merges)))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    prepare_dataset([str(tmp_path / "chat.jsonl")], Llama3Tokenizer(tokenizer_path),
                    PrepareOptions(name="chat", out_dir=tmp_path / "data", val_every=10))
    return tokenizer_path, tmp_path / "data"


@pytest.fixture
def chat_shards(tmp_path):
    return write_chat_shards(tmp_path)


@pytest.mark.slow
def test_a_tiny_sft_run_trains_on_the_assistant_tokens(tmp_path, chat_shards, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["-e", "tiny", "-b", "2", "-t", "64", "-d", "256", "-l", "1e-2", "-x", "12", "-s", "0", "-v", "6",
            "-m", "2", *sft_data(chat_shards), "-o", "run", "--device", "cpu"]
    assert train_llama.main(args) == 0
    assert "document mask | SFT loss mask" in capsys.readouterr().out
    trained = losses(tmp_path / "run")
    assert len(trained) == 12 and all(np.isfinite(trained)) and trained[-1] < trained[0]
    # step 0's validation: the initial weights' mean loss over the counted targets of both batches, masked
    tokenizer = Llama3Tokenizer(chat_shards[0])
    config = get_preset("tiny").replace(vocab_size=tokenizer.vocab_size)
    model = ReferenceModel(config, cpu_plan(doc_mask="on", bos_id=tokenizer.bos_id), params=init_parameters(config, 0))
    loader = DataLoader(str(chat_shards[1] / "chat_val_*.bin"), 2, 64, shuffle=False)
    batches = [loader.next_batch(with_mask=True) for _ in range(2)]
    token_losses = []
    for inputs, targets, mask in batches:
        model.forward(inputs, targets)
        token_losses.append(model.token_losses()[mask == 1])
    assert losses(tmp_path / "run", "tel")[0] == pytest.approx(np.mean(np.concatenate(token_losses)), abs=2e-6)


def sft_data(chat_shards) -> list[str]:
    """The arguments of an --sft run on the chat shards."""
    tokenizer, data = chat_shards
    return ["--tokenizer", str(tokenizer), "-i", str(data / "chat_train_*.bin"), "-j", str(data / "chat_val_*.bin"),
            "--sft"]


@pytest.mark.slow
def test_an_sft_run_resumes_bit_for_bit(tmp_path, chat_shards, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_resume_is_exact(tmp_path, sft_data(chat_shards), "cpu", "-d", "256")


def test_sft_on_shards_without_loss_masks_names_the_shard(tmp_path, chat_shards, capsys):
    tokenizer, data = chat_shards
    shard = data / "chat_train_000000.bin"
    mask_path(shard).unlink()
    args = ["-e", "tiny", "-b", "2", "-t", "64", "-x", "1", "-s", "0", "-v", "0", "--tokenizer", str(tokenizer),
            "-i", str(data / "chat_train_*.bin"), "--sft", "-o", str(tmp_path / "run"), "--device", "cpu"]
    assert train_llama.main(args) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"error: {shard} has no loss mask" in error


def test_check_masks_names_the_first_shard_without_one(tmp_path):
    for name in ("a.bin", "b.bin"):
        write_shard(tmp_path / name, np.arange(100) % 7, 7)
    with pytest.raises(ShardError, match=r"a\.bin has no loss mask \(a\.mask\.bin\)"):
        DataLoader(str(tmp_path / "*.bin"), 2, 8).check_masks()


def test_every_run_option_travels_by_its_name_to_the_plan():
    """RunOptions.from_args reads each field from the option of its name, and the plan answers what it decides
    nothing about as the run asked: a new run option is a RunOptions field and a flag, read from the plan."""
    args = train_llama.parse_args(["--device", "cpu", "--sft", "--optimizer-in-backward", "--recompute", "full"])
    options = RunOptions.from_args(args, gpus=1, batch=(4, 64), bos_id=BOS)
    assert (options.in_backward, options.recompute, options.sft, options.batch) == (True, "full", True, (4, 64))
    plan = make_plan(get_preset("tiny"), options)
    assert plan.options is options and (plan.batch, plan.bos_id, plan.gpus) == ((4, 64), BOS, 1)
    assert plan.recompute == "full" and plan.doc_mask is True and plan.doc_mask_bos == BOS  # decided: its own
    with pytest.raises(AttributeError):
        plan.no_such_option
