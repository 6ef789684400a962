"""Where downloaded and prepared data lives: one folder per user, shared by every working directory.

`cache_dir()` is $LLAMA_CUDA_CACHE when set, else $XDG_CACHE_HOME/llama-cuda, else ~/.cache/llama-cuda.
It holds the Llama 3 tokenizer (tokenizer/tokenizer.model), the built-in corpus's shards (builtin/), the
starter pack (tinyshakespeare/), the evaluation tasks' files (eval/) and the compiled kernels (kernels/,
llama/runtime/kernel_build.py). The variables are read on every call, so a test or a job can move
the cache for what it runs.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLE = "LLAMA_CUDA_CACHE"


def cache_dir() -> Path:
    """The per-user cache folder (not created here)."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "llama-cuda"
