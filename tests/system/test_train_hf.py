"""Fine-tuning from a Hugging Face folder on the CPU, then exporting the result: train_llama.py
--init hf:PATH (its tokenizer.json included), sampling through the KV-cache decoder, and
scripts/export_hf.py."""

import json
import os
import re
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import train_llama
from llama.run import trainer
from llama.io.checkpoint import latest_checkpoint, load_checkpoint
from llama.config import get_preset
from llama.data.datasets import prepare_tinyshakespeare
from llama.model.generate import generate
from llama.model.sampling import Sampling
from llama.model.reference import ReferenceDecoder
from llama.io.hf import load_hf_folder, save_hf_folder
from llama.params import init_parameters
from llama.data.tokenizer import Llama3Tokenizer
from tests.runs import BASE, REPO, TEXT, run
from tests.sample_files import ranks_file_bytes

def child_env() -> dict:
    """The test's environment (its own cache, no package index) with this checkout's llama package."""
    return {**os.environ, "PYTHONPATH": str(REPO)}
CONFIG = get_preset("tiny").replace(vocab_size=517, max_seq_len=64)


@pytest.fixture
def hf_folder(tmp_path, monkeypatch):
    """An HF folder with a tokenizer.json (vocab 517), and shards made with that tokenizer."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(ranks_file_bytes())
    tokenizer = Llama3Tokenizer(tmp_path / "tokenizer.model")
    params = init_parameters(CONFIG, seed=4)
    save_hf_folder(tmp_path / "hf", CONFIG, params, "fp32", tokenizer)
    (tmp_path / "input.txt").write_text(TEXT)
    train, val = prepare_tinyshakespeare(tmp_path / "input.txt", tmp_path / "data", tokenizer)
    return tmp_path / "hf", params, ["-i", str(train), "-j", str(val), "--device", "cpu", "-b", "2", "-t", "16"]


def test_fine_tune_from_hf_then_export(hf_folder, tmp_path, capsys):
    folder, params, data = hf_folder
    # a learning rate far below float32's resolution of the weights: the checkpoint holds exactly the
    # imported weights (the trainer refuses a learning rate of 0)
    assert train_llama.main(["--init", f"hf:{folder}", *data, "-x", "1", "-l", "1e-30", "-v", "0", "-s", "0",
                             "-o", "zero"]) == 0
    assert np.array_equal(load_checkpoint(latest_checkpoint(tmp_path / "zero"))["params"], params)

    assert train_llama.main(["--init", f"hf:{folder}", *data, "-x", "4", "-l", "1e-3", "-s", "2", "-g", "6",
                             "-v", "2", "-m", "1", "-o", "out"]) == 0
    assert re.search(r"--- sample at step 2 ---\n.*\n---", capsys.readouterr().out)
    trained = load_checkpoint(latest_checkpoint(tmp_path / "out"))
    assert not np.array_equal(trained["params"], params)

    result = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), "out", "exported", "--dtype",
                             "fp32"], capture_output=True, text=True, cwd=tmp_path, env=child_env())
    assert result.returncode == 0, result.stderr
    config, exported = load_hf_folder(tmp_path / "exported")
    assert config == CONFIG and np.array_equal(exported, trained["params"])
    # the run's tokenizer (the HF folder's tokenizer.json) went along
    assert Llama3Tokenizer(tmp_path / "exported" / "tokenizer.json").ranks == Llama3Tokenizer(folder / "tokenizer.json").ranks


def test_bad_hf_folder_is_one_line(hf_folder, capsys):
    folder, _, data = hf_folder
    (folder / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    assert train_llama.main(["--init", f"hf:{folder}", *data, "-x", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "GPT2LMHeadModel (gpt2) is not supported; only LlamaForCausalLM" in err
    assert train_llama.main(["--init", "hf:nowhere", *data, "-x", "1"]) == 2
    assert "nowhere is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_hf_weights_that_are_not_finite_are_refused(hf_folder, capsys, bad):
    folder, _, data = hf_folder
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
    save_file(tensors, folder / "model.safetensors")
    assert train_llama.main(["--init", f"hf:{folder}", *data, "-x", "1", "-o", "out"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: model.safetensors: model.layers.1.mlp.up_proj.weight holds NaN or infinite values")


def test_an_hf_model_too_big_for_the_memory_is_refused_before_its_weights_are_read(hf_folder, monkeypatch, capsys):
    """--init hf: reads config.json, then the memory check refuses in one line; no weight is read."""
    folder, _, data = hf_folder

    def read_weights(*args, **kwargs):
        raise AssertionError("the weights were read before the memory check")
    monkeypatch.setattr(trainer, "load_hf_folder", read_weights)
    monkeypatch.setattr(trainer, "host_available", lambda: 1 << 20)
    assert train_llama.main(["--init", f"hf:{folder}", *data, "-x", "1", "-o", "out"]) == 2
    assert re.fullmatch(r"error: the run needs about [\d.]+ MiB of host memory, 1\.0 MiB available; .*",
                        capsys.readouterr().err.strip().splitlines()[-1])


def test_a_2_to_the_31_context_fine_tunes(hf_folder, capsys):
    """max_position_embeddings 2^31: nothing is allocated for positions the run never reaches."""
    folder, _, data = hf_folder
    values = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**values, "max_position_embeddings": 2**31}))
    assert train_llama.main(["--init", f"hf:{folder}", *data, "-x", "1", "-v", "0", "-s", "0", "-o", "out"]) == 0
    assert "done: step 1/1" in capsys.readouterr().out


def test_export_of_a_missing_checkpoint(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(tmp_path), "x"],
                            capture_output=True, text=True, env=child_env())
    assert result.returncode == 2 and "holds no complete checkpoint" in result.stderr  # as the trainer


def no_bigger_files_than(limit: int):
    """A child's preexec_fn: writes past `limit` bytes fail with EFBIG, as on a full disk."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_export_onto_a_full_disk_is_one_line(corpus, tmp_path):
    assert run(*BASE, *corpus, "-x", "1", "-v", "0", "-o", "out") == 0
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), "out", "exported"],
                            capture_output=True, text=True, cwd=tmp_path, env=child_env(),
                            preexec_fn=no_bigger_files_than(20_000))
    assert result.returncode == 2, result.stderr
    assert re.fullmatch(r"error: cannot write exported/model.safetensors: .*File too large.*",
                        result.stderr.splitlines()[-1]), result.stderr


def run_generate(*args, cwd, stdin=None):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), *args, "--device", "cpu"],
                          capture_output=True, text=True, cwd=cwd, input=stdin, env=child_env())


def test_generate_script_streams_what_generate_produces(hf_folder, tmp_path):
    folder, params, _ = hf_folder
    tokenizer = Llama3Tokenizer(folder / "tokenizer.json")
    decoder = ReferenceDecoder(CONFIG, params, max_len=64)
    prompt = "the thin line"
    expected = generate(decoder, tokenizer.encode(prompt, bos=True), 12, Sampling(0.9, top_p=0.8, seed=3),
                        stop_ids=(tokenizer.eos_id,))
    result = run_generate("hf", "--prompt", prompt, "-n", "12", "--temperature", "0.9", "--top-p", "0.8",
                          "--seed", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = [t for t in expected.tokens if t != tokenizer.eos_id]
    assert result.stdout == prompt + tokenizer.decode(shown) + "\n"
    assert re.search(r"\[cpu\] prefill 9 tokens: .* tokens/s \| decode \d+ tokens: .* tokens/s", result.stderr)

    chat = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    expected = generate(decoder, chat, 10, Sampling(temperature=0), stop_ids=tokenizer.stop_ids)
    result = run_generate(f"hf:{folder}", "--chat", "-n", "10", "--temperature", "0", cwd=tmp_path, stdin="hi")
    assert result.returncode == 0, result.stderr
    assert result.stdout == tokenizer.decode([t for t in expected.tokens if t not in tokenizer.stop_ids]) + "\n"


def test_generate_script_from_a_checkpoint_and_bad_models(hf_folder, tmp_path, capsys):
    folder, _, data = hf_folder
    assert train_llama.main(["--init", f"hf:{folder}", *data, "-x", "1", "-v", "0", "-s", "0", "-o", "out"]) == 0
    assert f"| model from hf:{folder}: " in capsys.readouterr().out  # not "from checkpoint" (issue 63 item 17)
    result = run_generate("out", "--prompt", "the", "-n", "5", cwd=tmp_path)  # the run's tokenizer: the HF folder's
    assert result.returncode == 0 and result.stdout.startswith("the"), result.stderr
    result = run_generate(str(tmp_path / "data"), "--prompt", "x", cwd=tmp_path)
    assert result.returncode == 2  # a user's mistake, as in the trainer
    assert result.stderr.strip() == f"error: {tmp_path / 'data'} holds no complete checkpoint"
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    result = run_generate(str(folder), "--prompt", "x", cwd=tmp_path)
    assert result.returncode == 2 and "config.json: missing num_attention_heads" in result.stderr
