"""The frozen base of a run with LoRA adapters (--lora): where it came from, its identity in the run's checkpoints, and
the base read back with the adapters merged in, for the tools (export_hf.py --merge, generate.py, eval.py).

A run's base is an HF folder (--init hf:PATH), a full fine-tune's checkpoint (--init CKPT) or the weights drawn from
--seed. Its identity, state.json's "base": init (where it was read: "hf:<absolute path>" or the checkpoint's
absolute path; None when drawn), the seed, and the digest that a resume and the tools compare: "seed N" for a drawn
base (the seed and the checkpoint's config fix every weight), else weights_digest, a SHA-256 of the base's config and
of DIGEST_SAMPLE evenly spaced values of each tensor (all of a smaller one).

Why the values rather than the files: the same weights in other files (resharded, in fp32 rather than bf16, a folder
moved, or exported from the checkpoint that was the base) are the same base, while a fine-tune of the same model,
in files of the same names and sizes, is another; and the digest of values read anyway is nothing next to reading
them (a few MB hashed for 8B), where a digest of whole files would read them twice. What it gives up: a base that
differs from the recorded one only between the sampled values passes (a fine-tune changes nearly every value).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..config import LlamaConfig
from ..params import AdapterLayout, ParameterLayout, init_parameters, quantized_base
from .checkpoint import CheckpointError, load_checkpoint, read_weights
from .hf import load_hf_folder
from .peft import adapters_of, merge_adapters

DIGEST_SAMPLE = 4096  # values of each tensor in the digest


def weights_digest(config: LlamaConfig, params: np.ndarray) -> str:
    """"sha256:<hex>" of the config and of DIGEST_SAMPLE evenly spaced values of each tensor of flat params."""
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode())
    for t in ParameterLayout(config).tensors.values():
        values = params[t.offset:t.offset + t.size][::max(1, t.size // DIGEST_SAMPLE)][:DIGEST_SAMPLE]
        digest.update(f"{t.name} {t.shape}".encode())
        digest.update(np.ascontiguousarray(values, np.float32).tobytes())
    return "sha256:" + digest.hexdigest()


def base_init(init: str | None) -> str | None:
    """--init as a base's identity records it: "hf:" and the folder's absolute path, or the checkpoint's."""
    if init is None:
        return None
    return "hf:" + str(Path(init[3:]).resolve()) if init.startswith("hf:") else str(Path(init).resolve())


def base_identity(config: LlamaConfig, init: str | None, seed: int, params: np.ndarray | None) -> dict:
    """state.json's "base" of a base read from init (base_init's; params its weights) or drawn from seed (init None)."""
    return {"init": init, "seed": seed, "digest": f"seed {seed}" if init is None else weights_digest(config, params)}


def describe_base(identity: dict) -> str:
    return identity["init"] or f"the weights drawn from seed {identity['seed']}"


def base_checkpoint(path: str) -> dict:
    """A full fine-tune's checkpoint named as a base (load_checkpoint without its data); CheckpointError for a run's
    with adapters."""
    checkpoint = load_checkpoint(path, read=False)
    if checkpoint["lora"] is not None:
        raise CheckpointError(f"{path} holds a LoRA run's adapters, not a base: export that run merged "
                              "(scripts/export_hf.py RUN OUT --merge) and take --init hf:OUT")
    return checkpoint


def read_base(init: str, on_tensor=None) -> tuple[LlamaConfig, np.ndarray]:
    """(config, flat float32 weights) of the base init names: an HF folder (hf:PATH; on_tensor as load_hf_folder's)
    or a full fine-tune's checkpoint."""
    if init.startswith("hf:"):
        return load_hf_folder(init[3:], on_tensor)
    checkpoint = base_checkpoint(init)
    return checkpoint["config"], read_weights(checkpoint)


def merged_weights(checkpoint: dict) -> np.ndarray:
    """The weights a run with adapters computes with, on the host: its base read again from where its checkpoint says
    (or drawn from its seed), checked against the recorded digest, with QLoRA's NF4 round trip, and the checkpoint's
    adapters (read: load_checkpoint's) merged in (peft.merge_adapters)."""
    config, state = checkpoint["config"], checkpoint["state"]
    recorded = state["base"]
    init = recorded.get("init")
    base_config, base = read_base(init) if init else (config, init_parameters(config, recorded["seed"]))
    if base_identity(base_config, init, recorded["seed"], base)["digest"] != recorded["digest"]:
        raise CheckpointError(f"{checkpoint['path']}: its adapters were trained on {describe_base(recorded)}, "
                              "which has changed since (its weights' digest differs): merge them into that base")
    if state.get("qlora"):
        base = quantized_base(config, base)
    adapters = adapters_of(AdapterLayout(config, checkpoint["lora"]), checkpoint["params"])
    return merge_adapters(base, config, checkpoint["lora"], adapters)
