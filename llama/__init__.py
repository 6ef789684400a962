"""Llama 3.1 training with hand-written CUDA kernels, driven from plain Python."""

from .config import PRESETS, ConfigError, LlamaConfig, get_preset
from .params import ParameterLayout, count_parameters, init_parameters

__all__ = ["PRESETS", "ConfigError", "LlamaConfig", "ParameterLayout", "count_parameters",
           "get_preset", "init_parameters"]
