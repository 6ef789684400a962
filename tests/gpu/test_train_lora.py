"""train_llama.py --lora and --qlora on the GPU (the bf16 model's adapters): the base read on the host from an HF
folder, the resume bit for bit, a resume against another base refused, and the adapters exported and merged."""

import pytest

from llama.config import get_preset
from llama.io.checkpoint import load_checkpoint
from llama.io.hf import save_hf_folder
from llama.params import init_parameters
from tests.runs import BASE, check_resume_is_exact, run
from tests.system.test_scripts import script

pytestmark = pytest.mark.gpu
D6 = get_preset("d6").replace(vocab_size=264)  # the byte tokenizer's


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_a_fine_tune_with_adapters_resumes_exactly_and_exports(corpus, tmp_path, capsys, qlora):
    for name, seed in (("base", 4), ("other", 5)):
        save_hf_folder(tmp_path / name, D6, init_parameters(D6, seed), "bf16")
    adapters = ["--lora", "8", "--lora-alpha", "16", *["--qlora"] * qlora]
    check_resume_is_exact(tmp_path, corpus, "cuda", "-e", "d6", "-t", "64", "--init", f"hf:{tmp_path / 'base'}",
                          *adapters)
    out = capsys.readouterr().out
    assert f"lora r8 on 7 linears, base {'nf4' if qlora else 'frozen'}" in out
    checkpoint = load_checkpoint(tmp_path / "a" / "ckpt_00000008")
    assert checkpoint["lora"].rank == 8 and checkpoint["params"].size == checkpoint["layout"].size
    assert run(*BASE, "-e", "d6", "-t", "64", "--init", f"hf:{tmp_path / 'other'}", *adapters, *corpus, "-x", "8",
               "-o", "a", "--resume", device="cuda") == 2
    assert "--resume: the checkpoint's adapters were trained on hf:" in capsys.readouterr().err
    export = script("export_hf")
    assert export([str(tmp_path / "a"), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert export([str(tmp_path / "a"), str(tmp_path / "merged"), "--merge"]) == 0
