"""Checkpoints that survive a crash, and never let a bad checkpoint replace a good one.

A checkpoint folder `ckpt_<step:08d>/` holds:
  model.safetensors      the trained weights by name, float32: the parameters by Meta name, or in a run with LoRA
                         adapters the adapters by their AdapterLayout names (llama/params.py), the base not at all
  optimizer.safetensors  AdamW first and second moments (flat, in the layout of those weights): float32 adam_m
                         and adam_v, or with adamw8bit as the optimizer holds them, the uint8 codes m_codes
                         and v_codes and their float32 scales m_scales and v_scales (one per QUANT_BLOCK)
  state.json             step, config, data-loader state, sampling RNG state, probe losses, main.log
                         length, training arguments; in a run with adapters their LoraSpec ("lora"), whether the
                         base is NF4 ("qlora") and the base's identity ("base": llama/io/lora_base.py)
  readers.lock           empty; readers hold a shared flock on it (`reading_checkpoint`)
  DONE                   empty; written last

Writing: the files go to `.tmp_ckpt_<step>/`, are fsynced, renamed into place and marked DONE; on
any failure the temporary folder is removed and the error is one line (CheckpointError). Only then
are older checkpoints rotated away, so the newest good checkpoint is never deleted, nor the one with
the lowest probe loss, nor one that a reader (export_hf.py, generate.py) is reading: rotation unmarks
a checkpoint under an exclusive flock of its readers.lock before it removes it, and leaves one whose
lock it cannot take to a later rotation. The kernel drops the lock of a reader that dies.

The trainer writes only good checkpoints (llama/io/guard.py decides). Loading checks everything
before use: files present, the safetensors headers and sizes, the state.json schema and ranges,
every shape against the config, finite weights. `newest_usable()` skips an unusable checkpoint for
the next older one and says why. The resume of one GPU loads a checkpoint without its data and streams
the files into the model (stream_checkpoint), checking the weights of each part on the way; weights that
prove not finite only then send it to the next older checkpoint (the trainer's fallback).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..config import ConfigError, LlamaConfig
from ..optim import QUANT_BLOCK, Quantized
from ..params import AdapterLayout, LoraSpec, ParameterLayout
from .background import report_if_slow
from .read_ahead import ReadAhead
from ..runtime.cuda import runtime
from ..runtime.pinned import PinnedArrays
from ..runtime.progress import phase
from .safetensors_file import (READ_PIECE, SafetensorsError, check_tensors, read_into, read_tensors, tensor_names,
                               write_tensors)
from .safetensors_file import READERS as READS_AT_ONCE

DONE = "DONE"
MODEL, OPTIMIZER, STATE, READERS = "model.safetensors", "optimizer.safetensors", "state.json", "readers.lock"


class AtLeast:
    """A schema entry: an integer of at least `low`."""

    def __init__(self, low: int):
        self.low = low


COUNT, INDEX = AtLeast(1), AtLeast(0)
# state.json: the keys resume needs, with their types (nested dicts are checked key by key; float: finite)
STATE_SCHEMA = {
    "step": INDEX, "config": dict, "sample_rng": dict,
    "run": {"batch_size": COUNT, "seq_len": COUNT, "tokens_per_step": COUNT, "seed": INDEX},
    "loader": {"epoch": INDEX, "shard_pos": INDEX, "batch_pos": INDEX, "seed": INDEX, "files": list, "B": COUNT,
               "T": COUNT, "rank": INDEX, "world_size": COUNT},
}
OPTIONAL_STATE = {"probe_loss": float, "best_probe_loss": float, "log_bytes": INDEX,  # absent in older checkpoints
                  "lora": {"rank": COUNT, "alpha": float, "dropout": float, "targets": list, "use_rslora": bool},
                  "qlora": bool, "base": {"seed": INDEX, "digest": str}}  # a run with adapters only


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, loaded, or does not fit the run; the message is one line."""


def lora_state(spec: LoraSpec) -> dict:
    """state.json's "lora" of a run with adapters of spec."""
    return {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout, "targets": list(spec.targets),
            "use_rslora": spec.use_rslora}


def lora_of(state: dict, where: str = STATE) -> LoraSpec | None:
    """The LoraSpec of a checkpoint's state (None: a full fine-tune's), CheckpointError for one that is no spec."""
    if "lora" not in state:
        return None
    values = state["lora"]
    try:
        return LoraSpec(values["rank"], values["alpha"], values["dropout"], tuple(values["targets"]),
                        values["use_rslora"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}['lora'] is not a LoRA spec: {e}") from None


def trained_layout(config: LlamaConfig, lora: LoraSpec | None) -> ParameterLayout | AdapterLayout:
    """The layout of a checkpoint's weights: the parameters', or with adapters of lora the adapters'."""
    return ParameterLayout(config) if lora is None else AdapterLayout(config, lora)


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / f"ckpt_{step:08d}"


def all_finite(values: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether every value is finite: a chunk's float32 dot product with itself (BLAS, at memory speed, several
    times np.isfinite's) is finite exactly when its values are, unless huge finite values overflow it: only
    then are they looked at one by one."""
    values = values.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return all(math.isfinite(float(np.dot(part, part))) or np.isfinite(part).all()
                   for part in (values[i:i + chunk] for i in range(0, values.size, chunk)))


# ---- writing and rotation


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


FP32_MOMENTS, QUANTIZED_MOMENTS = ("adam_m", "adam_v"), ("m_codes", "m_scales", "v_codes", "v_scales")


def moment_tensors(adam_m: np.ndarray | Quantized, adam_v: np.ndarray | Quantized) -> dict[str, np.ndarray]:
    """optimizer.safetensors' tensors: fp32 moments, or 8-bit ones as their codes and scales."""
    if isinstance(adam_m, Quantized):
        return dict(zip(QUANTIZED_MOMENTS, (adam_m.codes, adam_m.scales, adam_v.codes, adam_v.scales)))
    return dict(zip(FP32_MOMENTS, (adam_m, adam_v)))


def moment_specs(size: int, quantized: bool) -> dict[str, tuple[tuple[int], np.dtype]]:
    """The (shape, dtype) of each tensor of optimizer.safetensors over `size` parameters."""
    if not quantized:
        return {name: ((size,), np.dtype(np.float32)) for name in FP32_MOMENTS}
    codes, scales = ((size,), np.dtype(np.uint8)), ((-(-size // QUANT_BLOCK),), np.dtype(np.float32))
    return dict(zip(QUANTIZED_MOMENTS, (codes, scales, codes, scales)))


def snapshot_moments(snapshot: dict[str, np.ndarray], size: int) -> tuple:
    """(adam_m, adam_v) for save_checkpoint from a model's download_state(): its float32 moments, or its 8-bit
    codes and scales (Quantized), without the padding."""
    if "m_codes" in snapshot:
        return (Quantized(snapshot["m_codes"][:size], snapshot["m_scales"][:-(-size // QUANT_BLOCK)]),
                Quantized(snapshot["v_codes"][:size], snapshot["v_scales"][:-(-size // QUANT_BLOCK)]))
    return snapshot["adam_m"][:size], snapshot["adam_v"][:size]


def save_checkpoint(out_dir: str | Path, step: int, config: LlamaConfig, params: np.ndarray,
                    adam_m: np.ndarray | Quantized, adam_v: np.ndarray | Quantized, state: dict,
                    keep: int = 0) -> Path:
    """Write checkpoint `step` atomically and verify it; then keep only the newest `keep` checkpoints
    up to it (0 keeps all). params: flat, in the layout state's lora says (trained_layout). Raises CheckpointError,
    leaving nothing half-written behind."""
    out_dir = Path(out_dir)
    final = checkpoint_dir(out_dir, step)
    tmp = out_dir / f".tmp_{final.name}"
    layout = trained_layout(config, lora_of(state))
    renamed = False
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_tensors(tmp / MODEL, layout.views(params))
        write_tensors(tmp / OPTIMIZER, moment_tensors(adam_m, adam_v))
        _write_file(tmp / STATE, json.dumps({"step": step, "config": config.to_dict(), **state}, indent=1).encode())
        (tmp / READERS).touch()
        _fsync_path(tmp)
        if final.exists():
            remove_checkpoint(final)
        os.replace(tmp, final)
        renamed = True
        _write_file(final / DONE, b"")
        _fsync_path(out_dir)
    except BaseException as e:  # a full disk, a read-only folder, or Ctrl-C: leave no partial checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        if renamed:
            shutil.rmtree(final, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write checkpoint {final}: {e.strerror or e}") from None
        raise
    try:
        verify_files(final, layout)
    except CheckpointError:
        remove_checkpoint(final)
        raise
    rotate_checkpoints(out_dir, final, keep)
    return final


def remove_checkpoint(path: Path) -> None:
    """Unmark first, so that a crash halfway through leaves an incomplete folder, never a broken one."""
    (path / DONE).unlink(missing_ok=True)
    shutil.rmtree(path)


def rotate_checkpoints(out_dir: str | Path, newest: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints up to `newest` (0 keeps all), keeping
    also the one with the lowest probe loss and those a reader pins; and delete the incomplete ones
    before it (a crash's leftovers). Later ones (unusable leftovers that resume skipped) are left to
    be replaced when the run gets there."""
    for p in Path(out_dir).glob("ckpt_*"):
        if p.name < newest.name and not (p / DONE).exists():
            shutil.rmtree(p)
    if keep <= 0:
        return
    older = [p for p in complete_checkpoints(out_dir) if p.name < newest.name]
    best = best_checkpoint(out_dir, newest)
    for old in older[:max(0, len(older) - (keep - 1))]:
        if old != best:
            _remove_unless_read(old)


def _lock_readers(checkpoint: Path, how: int) -> int | None:
    """An fd of the checkpoint's readers.lock under flock `how` (BlockingIOError when LOCK_NB cannot
    take it); None when it has none: removed, or written before readers.lock existed."""
    try:
        fd = os.open(checkpoint / READERS, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:  # no flock on this filesystem: nothing is pinned
        pass
    return fd


def _remove_unless_read(checkpoint: Path) -> None:
    """Remove a checkpoint unless a reader pins it (a later rotation removes it then). It is
    unmarked under the lock, so a reader that waits for the lock then finds it incomplete; the lock
    is let go before the folder is removed, as some filesystems keep a folder with an open file."""
    try:
        fd = _lock_readers(checkpoint, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    try:
        (checkpoint / DONE).unlink(missing_ok=True)
    finally:
        if fd is not None:
            os.close(fd)
    remove_checkpoint(checkpoint)


# ---- finding and loading


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoint folders with their DONE marker, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.glob("ckpt_*") if (p / DONE).exists())


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def _check_schema(value, schema, where: str) -> None:
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise CheckpointError(f"{where} is not a JSON object")
        for key, sub in schema.items():
            if key not in value:
                raise CheckpointError(f"{where} lacks {key!r}")
            _check_schema(value[key], sub, f"{where}[{key!r}]")
    elif schema is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CheckpointError(f"{where} is not a finite number")
    elif isinstance(schema, AtLeast):
        _check_schema(value, int, where)
        if value < schema.low:
            raise CheckpointError(f"{where} is {value}, expected at least {schema.low}")
    elif schema is bool:
        if not isinstance(value, bool):
            raise CheckpointError(f"{where} is not true or false")
    elif isinstance(value, bool) or not isinstance(value, schema):
        raise CheckpointError(f"{where} is not a {schema.__name__}")


def read_state(path: str | Path) -> dict:
    """state.json of a checkpoint folder, checked against STATE_SCHEMA."""
    where = Path(path) / STATE
    try:
        state = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {where}: {getattr(e, 'strerror', None) or e}") from None
    _check_schema(state, STATE_SCHEMA, str(where))
    for key, kind in OPTIONAL_STATE.items():
        if key in state:
            _check_schema(state[key], kind, f"{where}[{key!r}]")
    if lora_of(state, str(where)) is not None and "base" not in state:
        raise CheckpointError(f"{where} lacks 'base', the identity of its adapters' base")
    loader = state["loader"]
    if loader["rank"] >= loader["world_size"] or loader["shard_pos"] > len(loader["files"]):
        raise CheckpointError(f"{where}['loader'] is out of range: rank {loader['rank']} of world size "
                              f"{loader['world_size']}, shard {loader['shard_pos']} of {len(loader['files'])}")
    try:
        np.random.PCG64().state = state["sample_rng"]
    except (TypeError, ValueError, KeyError):
        raise CheckpointError(f"{where}['sample_rng'] is not a PCG64 generator state") from None
    return state


def _config_of(path: Path, state: dict) -> LlamaConfig:
    try:
        return LlamaConfig.from_dict(state["config"])
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path / STATE}: bad model config: {e}") from None


def verify_files(path: str | Path, layout: ParameterLayout | AdapterLayout) -> bool:
    """Files present and complete, headers and shapes matching the layout of the weights (trained_layout; no data
    read); whether the moments are 8-bit."""
    path = Path(path)
    missing = [name for name in (MODEL, OPTIMIZER, STATE, DONE) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}")
    try:
        check_tensors(path / MODEL, {name: t.shape for name, t in layout.tensors.items()})
        quantized = QUANTIZED_MOMENTS[0] in tensor_names(path / OPTIMIZER)
        specs = moment_specs(layout.size, quantized)
        check_tensors(path / OPTIMIZER, {name: shape for name, (shape, _) in specs.items()},
                      {name: dtype for name, (_, dtype) in specs.items()})
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    return quantized


def load_checkpoint(path: str | Path, read: bool = True) -> dict:
    """{'path', 'config', 'lora' (the adapters' LoraSpec, None in a full fine-tune), 'layout' (trained_layout),
    'quantized' (whether the moments are 8-bit), 'params' (flat float32: the parameters, or the adapters), 'adam_m',
    'adam_v' (float32, or Quantized for 8-bit moments), 'state'} of a checkpoint, verified in full; CheckpointError
    says what is wrong with it. read False: all but the data (params and moments None), which read_data (or
    read_weights) or stream_checkpoint read and check later."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder")
    if not (path / DONE).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {DONE} marker)")
    state = read_state(path)
    config, lora = _config_of(path, state), lora_of(state)
    layout = trained_layout(config, lora)
    checkpoint = {"path": path, "config": config, "lora": lora, "layout": layout,
                  "quantized": verify_files(path, layout), "params": None, "adam_m": None, "adam_v": None,
                  "state": state}
    return read_data(checkpoint) if read else checkpoint


def _read_files(checkpoint: dict, reads: list[tuple[str, dict[str, np.ndarray]]]) -> None:
    """Read (file name, {tensor: array}) of a checkpoint into the arrays; a failure is a CheckpointError."""
    path = checkpoint["path"]
    try:
        with report_if_slow(f"read {path}", sum(a.nbytes for _, arrays in reads for a in arrays.values())):
            for name, arrays in reads:
                read_tensors(path / name, arrays)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None


def read_moments(checkpoint: dict) -> tuple:
    """(adam_m, adam_v) of a checkpoint read on the host: float32 arrays, or Quantized for 8-bit moments."""
    specs = moment_specs(checkpoint["layout"].size, checkpoint["quantized"])
    moments = {name: np.empty(shape, dtype) for name, (shape, dtype) in specs.items()}
    _read_files(checkpoint, [(OPTIMIZER, moments)])
    if checkpoint["quantized"]:
        return (Quantized(moments["m_codes"], moments["m_scales"]), Quantized(moments["v_codes"], moments["v_scales"]))
    return moments["adam_m"], moments["adam_v"]


def read_weights(checkpoint: dict) -> np.ndarray:
    """A checkpoint's weights (flat float32) read on the host and checked to be finite."""
    layout = checkpoint["layout"]
    params = np.empty(layout.size, np.float32)
    _read_files(checkpoint, [(MODEL, layout.views(params))])
    if not all_finite(params):
        raise CheckpointError(f"{checkpoint['path'] / MODEL}: the weights are not finite")
    return params


def read_data(checkpoint: dict) -> dict:
    """The checkpoint with its weights and moments read on the host, the weights checked to be finite."""
    params = read_weights(checkpoint)
    adam_m, adam_v = read_moments(checkpoint)
    return checkpoint | {"params": params, "adam_m": adam_m, "adam_v": adam_v}


def checkpoint_pieces(checkpoint: dict, moments: bool = True) -> list[tuple[Path, int, int, str, int]]:
    """(file, byte offset in it, bytes, state name, byte offset in that) of each tensor of a checkpoint: the
    weights at their layout offsets in 'params', and (moments) the moments by download_state's names."""
    path, layout = checkpoint["path"], checkpoint["layout"]
    try:
        ranges = check_tensors(path / MODEL, {name: t.shape for name, t in layout.tensors.items()})
        pieces = [(path / MODEL, begin, end - begin, "params", 4 * layout.tensors[name].offset)
                  for name, (begin, end) in ranges.items()]
        if moments:
            specs = moment_specs(layout.size, checkpoint["quantized"])
            ranges = check_tensors(path / OPTIMIZER, {name: shape for name, (shape, _) in specs.items()},
                                   {name: dtype for name, (_, dtype) in specs.items()})
            pieces += [(path / OPTIMIZER, begin, end - begin, name, 0) for name, (begin, end) in ranges.items()]
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    return pieces


def checkpoint_ranges(checkpoint: dict) -> list[tuple[Path, int, int]]:
    """(file, byte offset, bytes) of each tensor of a checkpoint, in the order stream_checkpoint reads them: what a
    ReadAhead reads before it."""
    return [(file, at, n) for file, at, n, _, _ in checkpoint_pieces(checkpoint)]


def stream_checkpoint(checkpoint: dict, buffers: list[np.ndarray], upload: Callable[[str, int, np.ndarray], None],
                      moments: bool = True, read_ahead: ReadAhead | None = None) -> None:
    """Read checkpoint_pieces(checkpoint, moments) in parts of a buffer's size (buffers: equal uint8 arrays, the
    caller's page-locked ones), one read per buffer in flight, and hand each part in order to upload(state name,
    byte offset, bytes) in the calling thread, the weights in it checked to be finite first; a buffer is read
    into again once upload returned. Double buffering: the disk reads on while upload copies. read_ahead, of
    checkpoint_ranges(checkpoint), is told each part consumed."""
    size = buffers[0].size
    pieces = checkpoint_pieces(checkpoint, moments)
    parts = iter([(file, at + done, min(size, n - done), name, to + done)
                  for file, at, n, name, to in pieces for done in range(0, n, size)])
    free, in_flight, fds = list(buffers), deque(), {}
    try:
        for file in dict.fromkeys(file for file, *_ in pieces):
            fds[file] = os.open(file, os.O_RDONLY)
        with ThreadPoolExecutor(len(buffers)) as pool:
            def read_next() -> None:
                part = next(parts, None)
                if part is not None:
                    file, at, n, _, _ = part
                    buffer = free.pop()
                    reading = pool.submit(read_into, fds[file], memoryview(buffer[:n]), at, file)
                    in_flight.append((part, buffer, reading))

            for _ in buffers:
                read_next()
            while in_flight:
                (file, _, n, name, to), buffer, reading = in_flight.popleft()
                reading.result()
                if name == "params" and not all_finite(buffer[:n].view(np.float32)):
                    raise CheckpointError(f"{file}: the weights are not finite")
                upload(name, to, buffer[:n])
                if read_ahead is not None:
                    read_ahead.consumed(n)
                free.append(buffer)
                read_next()
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"cannot read {checkpoint['path']}: {e.strerror}") from None
    finally:
        for fd in fds.values():
            os.close(fd)


def load_state_into(model, checkpoint: dict, read_ahead: ReadAhead | None = None) -> None:
    """One GPU: the weights and moments of a checkpoint loaded without its data (load_checkpoint(read=False)),
    streamed from its files into the model's state_buffers() (the master weights and the moments on the device)
    through page-locked buffers while the next parts are read (stream_checkpoint, which checks the weights), and
    the weights the forward reads rounded after (model.set_weights_on_device): the state that model.set_state of the
    host arrays makes, bit for bit. Moments in the other format than the model's optimizer holds (fp32 ones for
    8-bit, or back) are read on the host and converted by set_state's path. read_ahead: the checkpoint's files
    being read into memory ahead (llama/io/read_ahead.py), told what was consumed."""
    targets, drv = model.state_buffers(), runtime().drv
    same_format = checkpoint["quantized"] == ("m_codes" in targets)
    staging = PinnedArrays({f"buffer {i}": ((READ_PIECE,), np.uint8) for i in range(READS_AT_ONCE)})
    buffers = list(staging.wait().values())
    nbytes = sum(b.nbytes for name, b in targets.items() if same_format or name == "params")
    with phase(f"reading {checkpoint['path']}", total=nbytes, unit="B") as progress:
        def upload(name: str, offset: int, data: np.ndarray) -> None:
            drv.memcpy_htod(targets[name].ptr + offset, data)
            progress.update(data.size)

        model.set_weights_on_device(lambda master: stream_checkpoint(checkpoint, buffers, upload, same_format,
                                                                     read_ahead))
    if not same_format:
        model.set_state(None, *read_moments(checkpoint))


def newest_usable(out_dir: str | Path, read: bool = True, before: Path | None = None) -> tuple[dict | None, list[str]]:
    """The newest complete checkpoint (older than `before` if given) that loads (None if none does; read:
    load_checkpoint's), and why each newer one did not."""
    skipped = []
    for path in reversed(complete_checkpoints(out_dir)):
        if before is not None and path.name >= before.name:
            continue
        try:
            return load_checkpoint(path, read), skipped
        except CheckpointError as e:
            skipped.append(str(e))
    return None, skipped


def best_checkpoint(out_dir: str | Path, newest: Path) -> Path | None:
    """The complete checkpoint up to `newest` with the lowest probe loss (None if none records one)."""
    losses = {}
    for path in (p for p in complete_checkpoints(out_dir) if p.name <= newest.name):
        try:
            losses[path] = read_state(path)["probe_loss"]
        except (CheckpointError, KeyError):  # unreadable, or from before probe losses were recorded
            pass
    return min(losses, key=losses.get, default=None)


def _newest_while_rotating(run: Path) -> Path | None:
    """latest_checkpoint(run), listed again when the run's checkpoint folders changed while it looked: a
    rotation can remove the newest between the listing and its DONE check, before the next is listed."""
    while True:
        before = sorted(run.glob("ckpt_*"))
        found = latest_checkpoint(run)
        if found is not None or sorted(run.glob("ckpt_*")) == before:
            return found


@contextlib.contextmanager
def reading_checkpoint(path: str | Path) -> Iterator[Path]:
    """A checkpoint folder itself, or the newest complete checkpoint of a run folder, pinned while
    the block runs (a shared flock on its readers.lock), so that rotation leaves it. When a run's
    newest checkpoint is rotated away before it is pinned, the then newest one is taken."""
    path = Path(path)
    while True:
        found = path if path.name.startswith("ckpt_") else _newest_while_rotating(path)
        if found is None:
            raise CheckpointError(f"{path} holds no complete checkpoint")
        fd = _lock_readers(found, fcntl.LOCK_SH)  # waits while rotation removes it
        try:
            if found == path or (found / DONE).exists():
                yield found
                return
        finally:
            if fd is not None:
                os.close(fd)
