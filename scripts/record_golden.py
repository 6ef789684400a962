"""Record what transformers computes for the golden twins of the tests against transformers: run where torch and
transformers are installed (the GPU machine), from the repository root, and commit what it writes:

    PYTHONPATH=$PWD python3 scripts/record_golden.py tests/data/golden

Each fixture is NAME.json (the versions of torch, transformers and numpy that made it, and the facts) and
NAME.npz (inputs and transformers' outputs, float32); the models and inputs are tests/hf_helpers.py's GOLDEN_*,
their weights drawn from a seed there (the json keeps the weights' sha256). tests/unit/test_golden_hf.py
checks our numpy reference and our HF import and export against them, without torch:

  forward_backward_{untied,tied}   the twin of tests/unit/test_hf_compare.py: transformers' RoPE frequencies,
                                   logits, loss and gradients (HF names and layout) in float64
  save_pretrained_float32_untied,  the twin of test_hf_transformers.py's (and tests/gpu/test_hf.py's) import:
  save_pretrained_bfloat16_tied    the folder save_pretrained writes (NAME/), and the model's logits
  export_{untied,tied}             the twin of its export: our fp32 export as transformers loaded it (each
                                   tensor's sha256), the sha256 of the json files it read, its logits, its
                                   generation config's stop ids and its tokenizer's ids of a text and a chat
"""

import argparse
import copy
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

from llama.data.tokenizer import Llama3Tokenizer
from llama.io.hf import save_hf_folder
from tests.hf_helpers import (GOLDEN_CHAT, GOLDEN_CONFIG, GOLDEN_EXPORT_VOCAB, GOLDEN_TEXT, WEIGHT_SEED, golden_tokens,
                              hf_logits, hf_model_of, seeded_params, sha256, write_fixture)
from tests.sample_files import ranks_file_bytes

EXPORT_JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json")


def provenance(config, params: np.ndarray) -> dict:
    """What every fixture records: who made it with which versions, the config and the weights' seed and sha256."""
    import torch
    import transformers

    return {"made_by": "scripts/record_golden.py",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "numpy": np.__version__, "python": sys.version.split()[0]},
            "config": dataclasses.asdict(config), "weights": {"seed": WEIGHT_SEED, "sha256": sha256(params)}}


def record_forward_backward(out: Path, tied: bool) -> str:
    """transformers' float64 logits, cross-entropy loss and its gradients for the seeded weights."""
    import torch

    config = GOLDEN_CONFIG.replace(tie_embeddings=tied)
    params = seeded_params(config)
    model = hf_model_of(config, params)
    tokens, targets = golden_tokens(config.vocab_size, 2, 16, seed=1), golden_tokens(config.vocab_size, 2, 16, seed=2)
    logits = model(torch.tensor(tokens)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), torch.tensor(targets).reshape(-1))
    loss.backward()
    arrays = {"tokens": tokens, "targets": targets, "inv_freq": model.model.rotary_emb.inv_freq.numpy(),
              "logits": logits.detach().numpy().astype(np.float32)}
    arrays.update({f"grad.{name}": p.grad.numpy().astype(np.float32) for name, p in model.named_parameters()})
    name = f"forward_backward_{'tied' if tied else 'untied'}"
    write_fixture(out, name, {**provenance(config, params), "loss": loss.item()}, arrays)
    return name


def record_save_pretrained(out: Path, dtype: str, tied: bool) -> str:
    """The folder save_pretrained writes in dtype (NAME/), and the float64 logits of the weights it holds."""
    import torch

    config = GOLDEN_CONFIG.replace(tie_embeddings=tied)
    params = seeded_params(config)
    model = hf_model_of(config, params).float()
    with torch.no_grad():  # the weights as stored
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    name = f"save_pretrained_{dtype}_{'tied' if tied else 'untied'}"
    copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(out / name)
    tokens = golden_tokens(config.vocab_size, 2, 16)
    facts = {**provenance(config, params), "dtype": dtype, "files": sorted(p.name for p in (out / name).iterdir())}
    write_fixture(out, name, facts, {"tokens": tokens, "logits": hf_logits(model, tokens).astype(np.float32)})
    return name


def record_export(out: Path, tied: bool) -> str:
    """Our fp32 export with the sample tokenizer as transformers loads it: tensors, logits, stop ids, token ids."""
    import transformers

    config = GOLDEN_CONFIG.replace(vocab_size=GOLDEN_EXPORT_VOCAB, tie_embeddings=tied)
    params = seeded_params(config)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "tokenizer.model").write_bytes(ranks_file_bytes())
        save_hf_folder(folder / "out", config, params, "fp32", Llama3Tokenizer(folder / "tokenizer.model"))
        files = {file: sha256((folder / "out" / file).read_bytes()) for file in EXPORT_JSON_FILES}
        model = transformers.LlamaForCausalLM.from_pretrained(folder / "out").eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "out")
    chat = tokenizer.apply_chat_template(GOLDEN_CHAT, add_generation_prompt=True, tokenize=True)
    tokens = golden_tokens(config.vocab_size, 1, 12)
    facts = {**provenance(config, params), "files": files,
             "tensors": {n: sha256(p.detach().numpy()) for n, p in model.named_parameters()},
             "eos_token_id": model.generation_config.eos_token_id,
             "text_ids": tokenizer(GOLDEN_TEXT)["input_ids"],
             "chat_ids": list(chat if isinstance(chat, list) else chat["input_ids"])}
    name = f"export_{'tied' if tied else 'untied'}"
    write_fixture(out, name, facts, {"tokens": tokens, "logits": hf_logits(model, tokens).astype(np.float32)})
    return name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("out_dir", type=Path, help="where the fixtures go (tests/data/golden)")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    names = [record_forward_backward(args.out_dir, tied) for tied in (False, True)]
    names += [record_save_pretrained(args.out_dir, *kind) for kind in (("float32", False), ("bfloat16", True))]
    names += [record_export(args.out_dir, tied) for tied in (False, True)]
    print(f"recorded {', '.join(names)} in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
