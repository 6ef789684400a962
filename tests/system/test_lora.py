"""A tiny LoRA and QLoRA fine-tune on the CPU through train_llama.py, from an HF folder as the base: its resume bit for
bit, a resume against another base or other adapters refused in one line, the adapter exported as a PEFT folder and
the merged model as an HF folder whose logits are the run's, and generate.py and eval.py on the run."""

import json
import shutil

import numpy as np
import pytest

from llama.config import get_preset
from llama.io.checkpoint import load_checkpoint
from llama.io.hf import load_hf_folder, save_hf_folder
from llama.io.peft import ADAPTER_CONFIG, load_peft_adapter
from llama.model.reference import ReferenceModel
from llama.params import init_parameters
from llama.run.plan import cpu_plan
from tests.runs import BASE, check_resume_is_exact, run
from tests.system.test_scripts import script

pytestmark = pytest.mark.slow  # several tiny runs and exports
CONFIG = get_preset("tiny").replace(vocab_size=264)  # the byte tokenizer's


@pytest.fixture
def bases(tmp_path, corpus):
    """Two HF folders of random tiny models (the base, and another), and the corpus' arguments."""
    for name, seed in (("base", 4), ("other", 5)):
        save_hf_folder(tmp_path / name, CONFIG, init_parameters(CONFIG, seed), "fp32")
    return tmp_path / "base", tmp_path / "other", corpus


def lora_args(base, *extra) -> list[str]:
    return ["--init", f"hf:{base}", "--lora", "4", "--lora-alpha", "16", *extra]


def one_error_line(capsys) -> str:
    """The one error line on stderr (after the notes, e.g. the byte tokenizer's)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error: ")] == err[-1:], err
    return err[-1]


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_a_tiny_fine_tune_resumes_exactly_exports_and_refuses_another_base(bases, tmp_path, capsys, qlora):
    base, other, corpus = bases
    extra = lora_args(base, *["--qlora"] * qlora)
    check_resume_is_exact(tmp_path, corpus, "cpu", *extra)
    capsys.readouterr()
    checkpoint = load_checkpoint(tmp_path / "a" / "ckpt_00000008")
    assert checkpoint["state"]["base"]["init"] == f"hf:{base.resolve()}" and checkpoint["state"]["qlora"] == qlora
    assert checkpoint["params"].size == checkpoint["layout"].size < init_parameters(CONFIG, 0).size

    # a resume against another base, other adapters, or none: one line each, nothing written
    shutil.copytree(tmp_path / "a" / "ckpt_00000004", tmp_path / "c" / "ckpt_00000004")
    for wrong, message in ((lora_args(other, *["--qlora"] * qlora),
                            f"error: --resume: the checkpoint's adapters were trained on hf:{base.resolve()}, this "
                            f"run's base is hf:{other.resolve()}; resume with the --init (and --seed) they were "
                            "trained on"),
                           (lora_args(base, *["--qlora"] * (not qlora)),
                            "error: --resume: the checkpoint holds other adapters; resume with --lora 4 "
                            "--lora-alpha 16 --lora-targets q,k,v,o,gate,up,down" + " --qlora" * qlora),
                           (["--init", f"hf:{base}"], "error: --resume: the checkpoint holds other adapters; resume "
                            "with --lora 4 --lora-alpha 16 --lora-targets q,k,v,o,gate,up,down" + " --qlora" * qlora)):
        assert run(*BASE, *wrong, *corpus, "-x", "8", "-o", "c", "--resume") == 2
        assert one_error_line(capsys) == message
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["ckpt_00000004"]

    # the adapter as PEFT's folder, and the merged model: its logits are the run's
    export = script("export_hf")
    assert export([str(tmp_path / "a"), "adapter", "--adapter"]) == 0
    assert export([str(tmp_path / "a"), "merged", "--merge", "--dtype", "fp32"]) == 0
    spec, adapters = load_peft_adapter(tmp_path / "adapter", CONFIG)
    assert spec == checkpoint["lora"]
    peft_config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert peft_config["base_model_name_or_path"] == str(base.resolve())
    trained = ReferenceModel(CONFIG, cpu_plan(lora=4, lora_alpha=16, qlora=qlora), params=load_hf_folder(base)[1])
    trained.set_state(checkpoint["params"])
    for name, (a, b) in adapters.items():
        np.testing.assert_array_equal(np.concatenate([a.ravel(), b.ravel()]),
                                      np.concatenate([trained.adapters[t.offset:t.offset + t.size]
                                                      for t in trained.adapter_layout.adapted()[name]]))
    config, merged = load_hf_folder(tmp_path / "merged")
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 24))
    plain = ReferenceModel(config, cpu_plan(), params=merged)
    untrained = ReferenceModel(CONFIG, cpu_plan(lora=4, lora_alpha=16, qlora=qlora), params=load_hf_folder(base)[1])
    trained.forward(tokens), plain.forward(tokens), untrained.forward(tokens)
    np.testing.assert_allclose(plain.read_logits(), trained.read_logits(), rtol=1e-5, atol=1e-5)
    assert np.abs(untrained.read_logits() - trained.read_logits()).max() > 1e-3  # the adapters matter
    capsys.readouterr()

    # generate.py and eval.py take the run (merged on the host) as they take the merged folder
    generate = script("generate")
    for model in ("a", "merged"):
        assert generate([model, "--prompt", "ROMEO", "-n", "12", "--temperature", "0", "--device", "cpu"]) == 0
    texts = capsys.readouterr().out.splitlines()
    assert texts[0] == texts[1] and texts[0].startswith("ROMEO")
    (tmp_path / "task.jsonl").write_text("".join(json.dumps({"context": f"JULIET {i}:", "choices": ["O Romeo", "xyz"],
                                                             "label": 0}) + "\n" for i in range(3)))
    evaluate = script("eval")
    for model in ("a", "merged"):
        assert evaluate([model, "--task", str(tmp_path / "task.jsonl"), "--device", "cpu",
                         "--output", str(tmp_path / f"{model}.jsonl")]) == 0
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "merged.jsonl").read_text()


def test_exports_refuse_what_the_run_is_not(bases, tmp_path, capsys):
    base, _, corpus = bases
    assert run(*BASE, *corpus, "-x", "1", "-v", "0", "-o", "full") == 0
    assert run(*BASE, *lora_args(base), *corpus, "-x", "1", "-v", "0", "-o", "lora") == 0
    capsys.readouterr()
    export = script("export_hf")
    assert export(["full", "out", "--adapter"]) == 2
    assert one_error_line(capsys).endswith("is a full fine-tune's, without adapters: export it without --adapter")
    assert export(["lora", "out"]) == 2
    assert one_error_line(capsys).endswith("holds LoRA adapters: export them with --adapter (a PEFT folder), or the "
                                           "model with them merged with --merge")
    assert export(["lora", "full", "--adapter"]) == 2  # an export replaces only an earlier export
    assert "holds a training run or a checkpoint" in one_error_line(capsys)
    assert export(["lora", "base", "--adapter"]) == 2  # nor a model folder with an adapter's
    assert "holds files an export does not write" in one_error_line(capsys)
    # the base changed since the run: the merge refuses it
    save_hf_folder(base, CONFIG, init_parameters(CONFIG, 6), "fp32")
    assert export(["lora", "merged", "--merge"]) == 2
    assert one_error_line(capsys).endswith(f"its adapters were trained on hf:{base.resolve()}, which has changed since "
                                           "(its weights' digest differs): merge them into that base")
    assert not (tmp_path / "merged").exists() and not (tmp_path / "out").exists()
    # --init a run's adapters as a base, with or without --lora
    for extra in ([], ["--lora", "4"]):
        lora_checkpoint = str(tmp_path / "lora" / "ckpt_00000001")
        assert run(*BASE, *corpus, "--init", lora_checkpoint, *extra, "-x", "1", "-o", "x") == 2
        assert "holds a LoRA run's adapters, not a base: export that run merged" in one_error_line(capsys)


def test_sft_with_accumulation_recompute_and_8_bit_moments_resumes_exactly_with_adapters(tmp_path, monkeypatch):
    """--sft (loss masks, the document mask), two micro-batches a step, --recompute full and adamw8bit, with adapters:
    the resumed run is the uninterrupted one, bit for bit."""
    from tests.unit.test_sft import sft_data, write_chat_shards

    monkeypatch.chdir(tmp_path)
    check_resume_is_exact(tmp_path, sft_data(write_chat_shards(tmp_path)), "cpu", "-d", "256", "--lora", "4",
                          "--recompute", "full", "--optimizer", "adamw8bit")
    state = load_checkpoint(tmp_path / "a" / "ckpt_00000008")["state"]
    assert state["args"]["sft"] and state["lora"]["rank"] == 4 and state["base"]["digest"] == "seed 0"
