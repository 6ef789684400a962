"""The model a command names: a checkpoint folder, a run folder (its newest checkpoint) or a Hugging Face
folder (config.json and safetensors, also written hf:PATH), with the tokenizer it was made for. Shared by
scripts/generate.py and scripts/eval.py. A run with LoRA adapters gives its base with the adapters merged in
(llama/io/lora_base.py merged_weights)."""

from __future__ import annotations

from pathlib import Path

from ..data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from .checkpoint import load_checkpoint, reading_checkpoint
from .hf import hf_tokenizer_path, load_hf_folder, run_tokenizer_path
from .lora_base import merged_weights


def load_model(name: str, tokenizer_path: str | None):
    """(config, flat float32 params, tokenizer) of a checkpoint or an HF folder."""
    path = Path(name.removeprefix("hf:"))
    if name.startswith("hf:") or (path / "config.json").is_file():
        config, params = load_hf_folder(path)
        tokenizer_path = tokenizer_path or hf_tokenizer_path(path)
    else:
        with reading_checkpoint(path) as checkpoint:  # a training run's rotation leaves it meanwhile
            loaded = load_checkpoint(checkpoint)
        config, params = loaded["config"], loaded["params"] if loaded["lora"] is None else merged_weights(loaded)
        tokenizer_path = tokenizer_path or run_tokenizer_path(loaded["state"])
    # a model with more ids than bytes needs the Llama 3 tokenizer: fetch it when it is not on disk
    tokenizer = load_tokenizer(tokenizer_path, quiet=True, fetch=config.vocab_size > ByteTokenizer.vocab_size)
    if tokenizer.vocab_size != config.vocab_size:
        raise TokenizerError(f"the tokenizer ({tokenizer.name}, vocab {tokenizer.vocab_size}) does not fit the "
                             f"model's vocab {config.vocab_size}; pass the model's tokenizer with --tokenizer")
    return config, params, tokenizer

