"""LoRA adapters out into the ecosystem and back: PEFT's adapter folder, and adapters merged into the weights.

A PEFT adapter folder (what peft.PeftModel.from_pretrained(base, FOLDER) loads, as PEFT 0.x's save_pretrained
writes it) holds adapter_config.json (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout,
target_modules under HF's module names, use_rslora, bias none, ...) and adapter_model.safetensors, float32
tensors base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight (r, in) and .lora_B.weight (out, r)
for each targeted linear layer.

Adapters are held here per layer in our (Meta) layout: {Meta weight name: (A, B)}, e.g.
"layers.0.attention.wq.weight": (A (r, dim), B (n_heads * head_dim, r)), with the update scale * B @ A of
that weight. HF's q and k weights are Meta's with their rows permuted per head (llama/io/hf.py: W_hf = P W),
so the update is P (B A) = (P B) A: B's rows are permuted like the weight's, and A, whose rows are the rank's
and whose columns are the layer's inputs (the residual stream, laid out alike in both), is not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import LlamaConfig
from ..params import LORA_TARGETS, AdapterLayout, LoraSpec, ParameterLayout
from ..params import init_adapters as init_adapters_flat
from ..twins.lora import lora_delta
from .hf import _write_safetensors, heads_of, hf_name, hf_to_meta, meta_to_hf, replace_export_folder

PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                "down": "down_proj"}  # HF's (and PEFT's) module of each of our targets (llama/params.py LORA_TARGETS)
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the base model's parameter names, as saved


class PeftError(ValueError):
    """An adapter folder that cannot be read, or does not fit the model; the message is one line."""


def adapted_weights(config: LlamaConfig, spec: LoraSpec) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """The targeted weights in the adapters' layout order: {Meta name: (A's shape, B's shape)}."""
    return {name: (a.shape, b.shape) for name, (a, b) in AdapterLayout(config, spec).adapted().items()}


def adapters_of(layout: AdapterLayout, flat: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{Meta weight name: (A, B)}: views of a flat adapters' buffer of the layout."""
    return {name: tuple(flat[t.offset:t.offset + t.size].reshape(t.shape) for t in pair)
            for name, pair in layout.adapted().items()}


def flat_adapters(layout: AdapterLayout, adapters: dict) -> np.ndarray:
    """The flat float32 buffer of adapters given as {Meta weight name: (A, B)}."""
    flat = np.empty(layout.size, np.float32)
    for name, pair in layout.adapted().items():
        for tensor, values in zip(pair, adapters[name]):
            flat[tensor.offset:tensor.offset + tensor.size] = values.ravel()
    return flat


def init_adapters(config: LlamaConfig, spec: LoraSpec, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Fresh adapters as PEFT initializes them (llama/params.py init_adapters), by weight."""
    layout = AdapterLayout(config, spec)
    return adapters_of(layout, init_adapters_flat(layout, seed))


def peft_names(name: str) -> tuple[str, str]:
    """PEFT's tensor names of A and B for a Meta weight name."""
    module = PEFT_PREFIX + hf_name(name).removesuffix(".weight")
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def _check_adapters(config: LlamaConfig, spec: LoraSpec, adapters: dict) -> None:
    shapes = adapted_weights(config, spec)
    if set(adapters) != set(shapes):
        missing, extra = sorted(set(shapes) - set(adapters)), sorted(set(adapters) - set(shapes))
        raise ValueError(f"adapters for {spec.targets}: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, (a, b) in adapters.items():
        if (a.shape, b.shape) != shapes[name]:
            raise ValueError(f"{name}: adapters {a.shape}, {b.shape}, expected {shapes[name][0]}, {shapes[name][1]}")


def peft_config(spec: LoraSpec, base_model: str | None = None) -> dict:
    """adapter_config.json as PEFT 0.x writes it for a LoRA of a causal LM (the keys every 0.x since 0.9 knows)."""
    return {"alpha_pattern": {}, "base_model_name_or_path": base_model, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "layers_pattern": None,
            "layers_to_transform": None, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "modules_to_save": None, "peft_type": "LORA", "r": spec.rank, "rank_pattern": {}, "revision": None,
            "target_modules": sorted(PEFT_MODULES[t] for t in spec.targets), "task_type": "CAUSAL_LM",
            "use_dora": False, "use_rslora": spec.use_rslora}


def to_peft_state(config: LlamaConfig, adapters: dict) -> dict[str, np.ndarray]:
    """PEFT's tensors (float32, HF layout) of adapters in ours."""
    state = {}
    for name, (a, b) in adapters.items():
        heads = heads_of(name, config)
        a_name, b_name = peft_names(name)
        state[a_name] = np.ascontiguousarray(a, np.float32)
        state[b_name] = np.ascontiguousarray(meta_to_hf(b, heads) if heads else b, np.float32)
    return state


def save_peft_adapter(out: str | Path, config: LlamaConfig, spec: LoraSpec, adapters: dict,
                      base_model: str | None = None) -> list[Path]:
    """Write a PEFT adapter folder; it replaces `out` whole (written beside it, then renamed), and a folder
    holding anything but an earlier adapter export is refused (ExportFolderError). Returns the files."""
    _check_adapters(config, spec, adapters)

    def write(folder: Path) -> list[Path]:
        _write_safetensors(folder / ADAPTER_WEIGHTS, to_peft_state(config, adapters), Path(out) / ADAPTER_WEIGHTS)
        (folder / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec, base_model), indent=2) + "\n", encoding="utf-8")
        return [folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG]

    return replace_export_folder(out, ADAPTER_FILES, write)


def _spec_of(values: dict, where: Path) -> LoraSpec:
    """The LoraSpec of an adapter_config.json, or PeftError for what our adapters cannot be."""
    if values.get("peft_type") != "LORA" or values.get("task_type", "CAUSAL_LM") != "CAUSAL_LM":
        raise PeftError(f"{where}: a {values.get('peft_type')} adapter for {values.get('task_type')}; "
                        "only LoRA adapters of a causal LM load")
    unsupported = [key for key, plain in (("bias", "none"), ("fan_in_fan_out", False), ("use_dora", False),
                                          ("rank_pattern", {}), ("alpha_pattern", {}), ("layers_to_transform", None),
                                          ("modules_to_save", None)) if values.get(key, plain) not in (plain, None)]
    if unsupported:
        raise PeftError(f"{where}: {', '.join(unsupported)} set; our adapters are plain LoRA on every layer")
    modules = values.get("target_modules") or []
    if isinstance(modules, str):
        raise PeftError(f"{where}: target_modules is a pattern ({modules!r}); name the modules")
    by_module = {module: target for target, module in PEFT_MODULES.items()}
    unknown = [m for m in modules if m not in by_module]
    if unknown or not modules:
        raise PeftError(f"{where}: target_modules {unknown or modules}: LoRA on {', '.join(by_module)} only")
    try:
        return LoraSpec(int(values["r"]), float(values["lora_alpha"]), float(values.get("lora_dropout", 0.0)),
                        tuple(t for t in LORA_TARGETS if PEFT_MODULES[t] in modules),
                        bool(values.get("use_rslora", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise PeftError(f"{where}: {e}") from None


def load_peft_adapter(folder: str | Path, config: LlamaConfig) -> tuple[LoraSpec, dict[str, tuple[np.ndarray, ...]]]:
    """(spec, adapters in our layout, float32) of a PEFT LoRA folder for a model of config; PeftError otherwise."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    folder = Path(folder)
    try:
        values = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        tensors = load_file(folder / ADAPTER_WEIGHTS)
    except (OSError, ValueError, SafetensorError) as e:
        raise PeftError(f"cannot read the adapter folder {folder}: {e}") from None
    spec = _spec_of(values, folder / ADAPTER_CONFIG)
    adapters = {}
    for name, shapes in adapted_weights(config, spec).items():
        names = peft_names(name)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise PeftError(f"{folder / ADAPTER_WEIGHTS} has no {missing[0]}; is it an adapter of this model?")
        a, b = (tensors.pop(n).astype(np.float32) for n in names)
        if (a.shape, b.shape) != shapes:
            raise PeftError(f"{folder / ADAPTER_WEIGHTS}: {names[0]} {a.shape} and lora_B {b.shape}, the model's "
                            f"rank {spec.rank} adapters of {name} are {shapes[0]} and {shapes[1]}")
        heads = heads_of(name, config)
        adapters[name] = (a, hf_to_meta(b, heads) if heads else b)
    if tensors:
        raise PeftError(f"{folder / ADAPTER_WEIGHTS} holds tensors for no targeted layer: {sorted(tensors)[:3]}")
    return spec, adapters


def merge_adapters(params: np.ndarray, config: LlamaConfig, spec: LoraSpec, adapters: dict) -> np.ndarray:
    """Flat float32 parameters (our layout) with each adapter merged into its weight, W + scale * B @ A (computed
    in float64, rounded once): what --merge exports. params is not changed."""
    _check_adapters(config, spec, adapters)
    merged = np.array(params, dtype=np.float32)
    views = ParameterLayout(config).views(merged)
    for name, (a, b) in adapters.items():
        views[name][...] = views[name].astype(np.float64) + lora_delta(a.astype(np.float64), b.astype(np.float64),
                                                                      spec.scale)
    return merged
