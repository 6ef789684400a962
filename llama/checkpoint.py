"""Checkpoints that survive a crash: written to a temporary folder, fsynced, renamed, and marked
complete by a DONE file written last. Only marked checkpoints are ever resumed from.

A checkpoint folder `ckpt_<step:08d>/` holds:
  model.safetensors      parameters by Meta name, float32
  optimizer.safetensors  AdamW first and second moments (flat, in the parameter layout)
  state.json             step, config, data-loader state, sampling RNG state, training arguments
  DONE                   empty; written last
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from .config import LlamaConfig
from .params import ParameterLayout

DONE = "DONE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or does not fit the run."""


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / f"ckpt_{step:08d}"


def save_checkpoint(out_dir: str | Path, step: int, config: LlamaConfig, params: np.ndarray,
                    adam_m: np.ndarray, adam_v: np.ndarray, state: dict, keep: int = 0) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep` (0 keeps all)."""
    out_dir = Path(out_dir)
    final = checkpoint_dir(out_dir, step)
    tmp = out_dir / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    layout = ParameterLayout(config)
    save_file({name: np.ascontiguousarray(v) for name, v in layout.views(params).items()}, tmp / "model.safetensors")
    save_file({"adam_m": adam_m, "adam_v": adam_v}, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": config.to_dict(), **state}, indent=1))
    for f in tmp.iterdir():
        _fsync_path(f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    (final / DONE).touch()
    _fsync_path(final / DONE)
    _fsync_path(out_dir)
    if keep > 0:
        for old in complete_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old)
    return final


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoint folders with their DONE marker, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.glob("ckpt_*") if (p / DONE).exists())


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> dict:
    """{'config', 'params' (flat float32), 'adam_m', 'adam_v', 'state'} of a complete checkpoint."""
    path = Path(path)
    if not (path / DONE).exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {DONE} marker)")
    try:
        state = json.loads((path / "state.json").read_text())
        config = LlamaConfig.from_dict(state["config"])
        tensors = load_file(path / "model.safetensors")
        moments = load_file(path / "optimizer.safetensors")
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    layout = ParameterLayout(config)
    params = np.empty(layout.size, dtype=np.float32)
    views = layout.views(params)
    for name, view in views.items():
        if name not in tensors or tensors[name].shape != view.shape:
            raise CheckpointError(f"checkpoint {path} lacks {name} {view.shape}")
        view[...] = tensors[name]
    return {"config": config, "params": params, "adam_m": moments["adam_m"], "adam_v": moments["adam_v"],
            "state": state}


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder itself, or the newest complete checkpoint of a run folder."""
    path = Path(path)
    found = path if path.name.startswith("ckpt_") else latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path} holds no complete checkpoint")
    return found


def run_tokenizer_path(state: dict) -> str | None:
    """The tokenizer file a training run used, from its recorded arguments: --tokenizer, else the
    tokenizer of its --init hf: folder; None means the default (data/tokenizer/, else bytes)."""
    from .hf import hf_tokenizer_path

    args = state.get("args", {})
    init = args.get("init") or ""
    if args.get("tokenizer"):
        return args["tokenizer"]
    found = hf_tokenizer_path(init[3:]) if init.startswith("hf:") else None
    return str(found) if found else None
