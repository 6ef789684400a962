"""Hugging Face transformers <-> Meta naming and layout: comparisons, import and export.

HF rotates (i, i + D/2) pairs ("rotate half") where Meta rotates (2i, 2i+1), so HF's q and k
projection rows are permuted per head; everything else maps by name only.

A Hugging Face Llama folder holds config.json, the weights as model.safetensors or as shards listed
in model.safetensors.index.json (float32, bfloat16 or float16), and usually the tokenizer
(tokenizer.json, or Meta's original/tokenizer.model). load_hf_folder() reads one into our config
and flat float32 parameters; save_hf_folder() writes one that transformers loads.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatch
from pathlib import Path

import numpy as np

from ..config import PRESETS, LlamaConfig
from ..runtime.cuda import BF16
from ..runtime.machine import host_available, require
from ..params import ParameterLayout
from .checkpoint import DONE, OPTIMIZER, STATE, all_finite
from .run_dir import LOCK, LOG

HF_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head",
            "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
            "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
            "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
            "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm"}


def hf_name(name: str) -> str:
    """Meta parameter name -> HF parameter name."""
    base = name.removesuffix(".weight")
    if base.startswith("layers."):
        _, i, rest = base.split(".", 2)
        return f"model.layers.{i}.{HF_NAMES[rest]}.weight"
    return HF_NAMES[base] + ".weight"


def meta_to_hf(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def hf_to_meta(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def heads_of(name: str, config: LlamaConfig) -> int | None:
    """How many heads a tensor's rows are permuted over (q, k), or None."""
    if name.endswith("attention.wq.weight"):
        return config.n_heads
    if name.endswith("attention.wk.weight"):
        return config.n_kv_heads
    return None


def to_hf_state(views: dict[str, np.ndarray], config: LlamaConfig) -> dict[str, np.ndarray]:
    """Named Meta tensors -> HF state dict (numpy)."""
    return {hf_name(k): (meta_to_hf(v, heads_of(k, config)) if heads_of(k, config) else v) for k, v in views.items()}


def llama3_rope(config: LlamaConfig) -> dict:
    """transformers' llama3 RoPE scaling of our config, with original_max_position_embeddings below
    max_position_embeddings (transformers warns otherwise, as for small's 8192 against 512). The scaling
    sees the original context and the two frequency factors only through their ratios (context / low,
    context / high, (context / wavelength - low) / (high - low)), so halving all three leaves every
    frequency the same, bit for bit; _rope_settings doubles them back."""
    context, low, high = config.rope_original_context, config.rope_low_freq_factor, config.rope_high_freq_factor
    while context >= config.max_seq_len and context % 2 == 0:
        context, low, high = context // 2, low / 2, high / 2
    return {"rope_type": "llama3", "factor": config.rope_scale_factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": context}


def transformers_config(config: LlamaConfig, attn_implementation: str = "eager"):
    """A transformers.LlamaConfig with the same architecture (needs transformers)."""
    import transformers

    rope = llama3_rope(config)
    kwargs = dict(vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_hidden_dim,
                  num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                  num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.norm_eps,
                  max_position_embeddings=config.max_seq_len, tie_word_embeddings=config.tie_embeddings,
                  attention_bias=False, mlp_bias=False)
    if "rope_parameters" in transformers.LlamaConfig().to_dict():
        kwargs["rope_parameters"] = {**rope, "rope_theta": config.rope_theta}
    else:
        kwargs.update(rope_scaling=rope, rope_theta=config.rope_theta)
    hf_config = transformers.LlamaConfig(**kwargs)
    hf_config._attn_implementation = attn_implementation
    return hf_config


# ----------------------------------------------------------------------------------------------
# Import and export of Hugging Face folders


class HFError(ValueError):
    """A Hugging Face folder that cannot be read or describes a model we cannot represent."""


class ExportFolderError(ValueError):
    """A folder an export must not replace; the message is one line."""


SAFETENSORS_DTYPES = {"F32": np.float32, "BF16": BF16, "F16": np.float16}
EXPORT_DTYPES = {"bf16": (BF16, "bfloat16"), "fp32": (np.float32, "float32")}
READERS = 4  # tensors read at once
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints saved
# the files an export writes, and those of a training run or checkpoint (check_export_folder)
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "model-*-of-*.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
RUN_FILES = (LOG, LOCK, "ckpt_*", "old_run_*", DONE, STATE, OPTIMIZER)
EXPORT_RECORD = "llama_cuda_export.json"  # written last by an export: its files, so that only it may be replaced


def _rope_settings(values: dict, where: str) -> dict:
    """Our RoPE fields from rope_scaling + rope_theta (transformers 4) or rope_parameters (5)."""
    key = "rope_parameters" if values.get("rope_parameters") else "rope_scaling"
    rope = values.get(key) or {}
    if not isinstance(rope, dict):
        raise HFError(f"{where}: {key} = {rope!r} is not a JSON object")
    theta = rope.get("rope_theta", values.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta), "use_scaled_rope": False}
    if kind != "llama3":
        raise HFError(f"{where}: rope type {kind!r} is not supported (only the default and llama3)")
    context, low, high = (int(rope["original_max_position_embeddings"]), float(rope["low_freq_factor"]),
                          float(rope["high_freq_factor"]))
    while low < 1 and math.frexp(low)[0] == 0.5:  # an exported power-of-two form (llama3_rope): Meta's low is 1
        context, low, high = context * 2, low * 2, high * 2
    return {"rope_theta": float(theta), "use_scaled_rope": True, "rope_scale_factor": float(rope["factor"]),
            "rope_low_freq_factor": low, "rope_high_freq_factor": high, "rope_original_context": context}


def _ffn_settings(dim: int, hidden: int) -> dict:
    """multiple_of and ffn_dim_multiplier giving this FFN width: a preset's own when a preset has
    the same dim and width (so Meta's models come out exactly), else ones that round to it."""
    for preset in PRESETS.values():
        if preset.dim == dim and preset.ffn_hidden_dim == hidden:
            return {"multiple_of": preset.multiple_of, "ffn_dim_multiplier": preset.ffn_dim_multiplier}
    return {"multiple_of": hidden, "ffn_dim_multiplier": hidden / int(2 * (4 * dim) / 3)}


def config_from_hf(values: dict, where: str = "config.json") -> LlamaConfig:
    """Our config of an HF LlamaConfig dict; HFError, in one line, for what we cannot represent."""
    architectures = values.get("architectures") or ["LlamaForCausalLM"]
    if isinstance(architectures, str):
        architectures = [architectures]
    if values.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in architectures:
        raise HFError(f"{where}: {'/'.join(architectures)} ({values.get('model_type')}) is not supported; "
                      "only LlamaForCausalLM")
    for key, unsupported in (("hidden_act", lambda v: v != "silu"), ("attention_bias", bool), ("mlp_bias", bool),
                             ("quantization_config", lambda v: v is not None)):
        if key in values and unsupported(values[key]):
            raise HFError(f"{where}: {key} = {values[key]!r} is not supported")

    def number(key: str, cast=int, default=None):
        value = values.get(key, default)
        if value is None:
            raise HFError(f"{where}: missing {key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HFError(f"{where}: {key} = {value!r} is not a number")
        return cast(value)

    dim, heads = number("hidden_size"), number("num_attention_heads")
    if values.get("head_dim") not in (None, dim // max(heads, 1)):
        raise HFError(f"{where}: head_dim {values['head_dim']} differs from hidden_size / num_attention_heads "
                      f"= {dim // max(heads, 1)}; not supported")
    try:
        return LlamaConfig(vocab_size=number("vocab_size"), dim=dim, n_layers=number("num_hidden_layers"),
                           n_heads=heads, n_kv_heads=number("num_key_value_heads", default=heads),
                           norm_eps=number("rms_norm_eps", float, 1e-6),
                           max_seq_len=number("max_position_embeddings", default=2048),
                           tie_embeddings=bool(values.get("tie_word_embeddings", False)),
                           **_ffn_settings(dim, number("intermediate_size")), **_rope_settings(values, where))
    except (KeyError, TypeError, ValueError) as e:  # ConfigError included
        if isinstance(e, HFError):
            raise
        raise HFError(f"{where}: {'missing ' if isinstance(e, KeyError) else ''}{e}") from None


# The transformers release whose layout config_to_hf writes (Meta's Llama 3.2 configs say 4.45). transformers 5
# reads a local folder whose config.json names no version as a possible Mistral tokenizer, and warns that our
# tokenizer's split pattern is wrong; following its advice (fix_mistral_regex=True) would break the tokens.
WRITTEN_AS = "4.45.0"


def config_to_hf(config: LlamaConfig, torch_dtype: str, bos_id: int | None = None,
                 eos_id: int | None = None) -> dict:
    """config.json of the same model for transformers (4.x reads rope_scaling, 5.x rope_parameters)."""
    rope = llama3_rope(config) if config.use_scaled_rope else None
    values = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
              "hidden_size": config.dim, "intermediate_size": config.ffn_hidden_dim,
              "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
              "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
              "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
              "rope_theta": config.rope_theta, "rope_scaling": rope,
              "rope_parameters": {**(rope or {"rope_type": "default"}), "rope_theta": config.rope_theta},
              "tie_word_embeddings": config.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
              "mlp_bias": False, "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
              "torch_dtype": torch_dtype, "dtype": torch_dtype, "transformers_version": WRITTEN_AS}
    if bos_id is not None:
        values.update(bos_token_id=bos_id, eos_token_id=eos_id)
    return values


def _read_json(path: Path, what: str) -> dict:
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{path.parent} has no {path.name} ({what})") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise HFError(f"{path} must hold a JSON object")
    return values


def _weight_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFError(f"{index} has no weight_map")
        files = {name: folder / file for name, file in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise HFError(f"{index} lists {path.name}, which is missing")
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise HFError(f"{folder} has no model.safetensors or model.safetensors.index.json "
                      "(only safetensors weights are supported)")
    try:
        with safe_open(str(single), framework="np") as f:
            return {name: single for name in f.keys()}
    except Exception as e:
        raise HFError(f"cannot read {single}: {e}") from None


def hf_tokenizer_path(folder: str | Path) -> Path | None:
    """The tokenizer shipped with an HF folder: Meta's tokenizer.model (also under original/),
    else tokenizer.json; None when there is neither."""
    folder = Path(folder)
    for candidate in ("tokenizer.model", "original/tokenizer.model", "tokenizer.json"):
        if (folder / candidate).is_file():
            return folder / candidate
    return None


def read_hf_config(folder: str | Path) -> LlamaConfig:
    """Our config of a local HF Llama folder, from its config.json alone (no weight is read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFError(f"{folder} is not a folder")
    return config_from_hf(_read_json(folder / "config.json", "the model's config"), str(folder / "config.json"))


def _weight_jobs(folder: Path, config: LlamaConfig, layout: ParameterLayout) -> list[tuple[Path, str, str]]:
    """(file, HF name, our name) of every weight of the folder, in the order of the files; HFError for a
    missing or unexpected tensor."""
    files = _weight_files(folder)
    expected = {hf_name(name): name for name in layout.tensors}
    for name in files:
        if name not in expected and not name.endswith(IGNORED_TENSORS) and not (
                name == "lm_head.weight" and config.tie_embeddings):
            raise HFError(f"{files[name].name}: unexpected tensor {name}; not a weight of this Llama config")
    for hf in expected:
        if hf not in files:
            raise HFError(f"{folder}: missing tensor {hf}")
    return sorted(((files[hf], hf, meta) for hf, meta in expected.items()), key=lambda job: str(job[0]))


def _read_weight(path: Path, hf: str, meta: str, config: LlamaConfig, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor of a safetensors file (memory-mapped) as our float32 tensor, checked."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            tensor = f.get_slice(hf)
            found, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
            if found != shape:
                raise HFError(f"{path.name}: {hf} has shape {found}, expected {shape}")
            if dtype not in SAFETENSORS_DTYPES:
                raise HFError(f"{path.name}: {hf} is {dtype}; only F32, BF16 and F16 are supported")
            w = f.get_tensor(hf).astype(np.float32)
    except HFError:
        raise
    except Exception as e:
        raise HFError(f"cannot read {path}: {e}") from None
    w = hf_to_meta(w, heads_of(meta, config)) if heads_of(meta, config) else w
    if not all_finite(w):
        raise HFError(f"{path.name}: {hf} holds NaN or infinite values")
    return w


def _read_weights(folder: Path, config: LlamaConfig, layout: ParameterLayout):
    """(our tensor, float32 values) of every weight of the folder, read by READERS threads at once (numpy and
    the page cache release the GIL) and yielded in order, at most 2 * READERS tensors ahead of the caller."""
    jobs = _weight_jobs(folder, config, layout)
    with ThreadPoolExecutor(READERS) as pool:
        pending = deque()
        for path, hf, meta in jobs:
            tensor = layout.tensors[meta]
            pending.append((tensor, pool.submit(_read_weight, path, hf, meta, config, tensor.shape)))
            if len(pending) >= 2 * READERS:
                tensor, future = pending.popleft()
                yield tensor, future.result()
        while pending:
            tensor, future = pending.popleft()
            yield tensor, future.result()


def load_hf_folder(folder: str | Path, on_tensor=None) -> tuple[LlamaConfig, np.ndarray]:
    """(config, flat float32 parameters in our layout) of a local HF Llama folder; on_tensor(n), when
    given, is called after each tensor with its number of values (a progress bar's update)."""
    folder = Path(folder)
    config = read_hf_config(folder)
    layout = ParameterLayout(config)
    nbytes = np.dtype(np.float32).itemsize * layout.size
    require(nbytes, host_available(), f"the {layout.size:,} parameters of {folder}", "host")
    params = np.empty(layout.size, dtype=np.float32)
    for tensor, values in _read_weights(folder, config, layout):
        params[tensor.offset:tensor.offset + tensor.size] = values.reshape(-1)
        if on_tensor is not None:
            on_tensor(tensor.size)
    return config, params


def load_hf_to_device(folder: str | Path, out, on_tensor=None) -> LlamaConfig:
    """The config of a local HF Llama folder, and its weights uploaded into out (a float32 DeviceArray of the
    layout's size) tensor by tensor while the next ones are read: no host copy of the whole model."""
    folder = Path(folder)
    config = read_hf_config(folder)
    layout = ParameterLayout(config)
    if out.size != layout.size:
        raise ValueError(f"out holds {out.size} values, the folder's model {layout.size}")
    for tensor, values in _read_weights(folder, config, layout):
        out.view(tensor.offset, (tensor.size,)).upload(values.reshape(-1))
        if on_tensor is not None:
            on_tensor(tensor.size)
    return config


def check_export_folder(out: str | Path, files: tuple[str, ...] = EXPORT_FILES) -> None:
    """Refuse a folder that an export, which replaces its folder whole, would destroy: a file, or a folder
    that holds anything but an earlier export of ours as it was written (`files`, patterns: a model's by default,
    an adapter's; EXPORT_RECORD lists them with their sizes and times): a training run, a checkpoint, a Hugging
    Face model of the user's, an export changed since."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportFolderError(f"{out} is a file; choose a folder for the export")
    held = sorted(out.iterdir()) if out.is_dir() else []
    if not held:
        return
    others = [p.name for p in held if not (p.is_file() and any(fnmatch(p.name, name) for name in files))
              and p.name != EXPORT_RECORD]
    recorded = _read_export_record(out)
    if others:
        run = any(fnmatch(name, mark) for name in others for mark in RUN_FILES)
        what = f"{'a training run or a checkpoint' if run else 'files an export does not write'} ({_some(others)})"
    elif recorded is None:
        what = f"a model that scripts/export_hf.py did not write ({_some([p.name for p in held])}; no {EXPORT_RECORD})"
    else:
        changed = [p.name for p in held if p.name != EXPORT_RECORD and recorded.get(p.name) != _file_stamp(p)]
        changed += [name for name in recorded if not (out / name).is_file()]
        if not changed:
            return
        what = f"an export changed since it was written ({_some(sorted(set(changed)))})"
    raise ExportFolderError(f"{out} holds {what}; an export replaces its folder whole: choose a new or empty folder, "
                            "or one that holds only an earlier export")


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _file_stamp(path: Path) -> list[int]:
    """What the export record keeps of a file: its size and modification time (ns)."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _read_export_record(folder: Path) -> dict[str, list[int]] | None:
    """{file: stamp} of the export whose record the folder holds, None without a readable one."""
    try:
        files = json.loads((folder / EXPORT_RECORD).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], shown: Path) -> None:
    """The safetensors library's save_file, with its write failures (a full disk) as one-line OSErrors
    that name the file as `shown`, and the file's mode what the umask gives any other file (the library
    writes 0600)."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as e:
        raise OSError(f"cannot write {shown}: {e}") from None
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_hf_folder(out: str | Path, config: LlamaConfig, params: np.ndarray, dtype: str = "bf16",
                   tokenizer=None, max_shard_bytes: int = 5 << 30) -> list[Path]:
    """Write config.json, generation_config.json, the weights (one model.safetensors, or shards
    of at most max_shard_bytes with model.safetensors.index.json) and, for a Llama 3 tokenizer,
    the tokenizer files. dtype: 'bf16' or 'fp32'. Returns the files written.

    They go to a temporary folder beside `out`, which then replaces `out` whole, so that nothing of
    an earlier export there survives; `check_export_folder` decides whether `out` may be replaced
    (replace_export_folder)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    return replace_export_folder(out, EXPORT_FILES, lambda tmp: _write_export(tmp, Path(out), config, params, dtype,
                                                                               tokenizer, max_shard_bytes))


def replace_export_folder(out: str | Path, files: tuple[str, ...], write) -> list[Path]:
    """An export's folder replaced whole: `write(folder)` writes the export's files into a temporary folder beside
    `out` and returns them, and that folder then takes the place of `out` (which check_export_folder(out, files)
    must allow), with EXPORT_RECORD written last, so that nothing of an earlier export survives and a failure or
    Ctrl-C leaves `out` as it was. Returns the files as they are named in `out`."""
    check_export_folder(out, files)
    target = Path(out).absolute()
    tmp, old = (target.parent / f".{kind}_{target.name}.{os.getpid()}" for kind in ("tmp_export", "old_export"))
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        written = write(tmp)
        record = {"written_by": "scripts/export_hf.py (llama-cuda)", "files": {p.name: _file_stamp(p) for p in written}}
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")  # last: the export is whole
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return [Path(out) / p.name for p in written]


def _write_export(out: Path, shown: Path, config: LlamaConfig, params: np.ndarray, dtype: str, tokenizer,
                  max_shard_bytes: int) -> list[Path]:
    """save_hf_folder's files, written into the folder `out`; errors name them in `shown`, where they go."""
    from ..data.tokenizer import Llama3Tokenizer, hf_tokenizer_files

    np_dtype, torch_dtype = EXPORT_DTYPES[dtype]
    state = to_hf_state(ParameterLayout(config).views(params), config)
    sizes = {name: w.size * np.dtype(np_dtype).itemsize for name, w in state.items()}
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name in state:
        if shards[-1] and shard_bytes + sizes[name] > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += sizes[name]
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    written = []
    for file, shard in zip(names, shards):
        _write_safetensors(out / file, {name: np.ascontiguousarray(state[name].astype(np_dtype)) for name in shard},
                           shown / file)
        written.append(out / file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {name: file for file, shard in zip(names, shards) for name in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / "model.safetensors.index.json")
    bos = eos = None
    if tokenizer is not None:
        bos, eos = tokenizer.bos_id, tokenizer.eos_id
    files = {"config.json": config_to_hf(config, torch_dtype, bos, eos)}
    if tokenizer is not None:
        files["generation_config.json"] = {"bos_token_id": bos, "eos_token_id": list(tokenizer.stop_ids),
                                           "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    if isinstance(tokenizer, Llama3Tokenizer):
        files.update(hf_tokenizer_files(tokenizer, config.max_seq_len))
    for name, values in files.items():
        indent = None if name == "tokenizer.json" else 2  # the vocabulary and merges stay compact
        (out / name).write_text(json.dumps(values, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(out / name)
    return written


def run_tokenizer_path(state: dict) -> str | None:
    """The tokenizer file a training run used, from its recorded arguments: --tokenizer, else the
    tokenizer of its --init hf: folder; None means the default (data/tokenizer/, else bytes)."""
    args = state.get("args", {})
    init = args.get("init") or ""
    if args.get("tokenizer"):
        return args["tokenizer"]
    found = hf_tokenizer_path(init[3:]) if init.startswith("hf:") else None
    return str(found) if found else None
