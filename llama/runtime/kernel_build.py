"""Kernels built ahead, in parallel, cached: nvcc compiles build units of kernels/*.cu to cubins on every core.

A build unit is one .cu file, or one entry point of a file that guards each of its entry points with
`#if KERNEL_ENTRY(name)` (the GEMMs' and the Hopper flash attention's: each takes a second or more to compile
alone, the whole file many). Cubins live in a persistent cache (cache_dir()) under a key of the unit's source and
every header it includes, nvcc's options (the architecture among them) and nvcc's version; each entry carries a
checksum and is written atomically, so that a corrupt or partial one is rebuilt, never loaded. kernels_for(plan)
names the units a training plan launches (the attention's of the model's head dim), so that the trainer builds
them all before its first step (build(): one process at a time per cache, so that a run's ranks compile each unit
once); anything else builds on first use (cubin_of()).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..cache import cache_dir as user_cache_dir

CACHE_ENV = "LLAMA_KERNEL_CACHE"  # moves the cache
NVCC = "nvcc"
ENTRY_GUARD = re.compile(r"^#if KERNEL_ENTRY\((\w+)\)", re.M)
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
CHECKSUM_BYTES = 32  # a cache entry is the cubin followed by its sha256
# the kernel modules of each training path's launchers (tests/unit/test_kernel_build_plan.py checks them against
# llama/ops); the GEMMs and the attention build come from the plan, the decoder's modules are added for sampling
# (bf16's residual: ZeRO adds a later micro-batch's reduced gradients with it, llama/parallel/zero.py)
BF16_MODULES = ("adamw", "classifier", "convert", "embedding", "global_norm", "init", "residual", "rmsnorm", "swiglu")
PATH_MODULES = {"fp32": ("adamw", "attention", "classifier", "embedding", "global_norm", "init", "matmul", "residual",
                         "rmsnorm", "rope", "swiglu"),
                "bf16": BF16_MODULES, "fp8": BF16_MODULES + ("fp8",)}
DECODER_MODULES = ("decode", "sample")
LORA_MODULES = {"lora": ("lora",), "qlora": ("lora", "nf4")}  # the adapters' updates, and QLoRA's NF4 base
DOC_MASK_MODULE = "document_mask"  # the document bounds of a batch, launched by a model with the document mask
DECODER_GEMV = r"gemv_\w+_b8"  # the training run's sampler decodes one sequence: gemv.cu's entries for B <= 8
HEAD_DIM_ENTRY = re.compile(r"_d(\d+)$")  # an attention entry point built for one head dim, and that dim
GEMM_MMA_MODULE, SPLITK_REDUCE = "gemm_mma", "gemm_splitk_reduce"  # version 1, and every version's split-K reduce


class KernelBuildError(RuntimeError):
    """nvcc could not compile a unit: the file, and nvcc's messages in one block."""


@dataclass(frozen=True)
class Unit:
    """What one nvcc process compiles: source, for code (e.g. 'sm_90a'); entry: the one guarded entry point it
    compiles alone, or None for the whole file."""
    source: Path
    code: str
    entry: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "source", Path(self.source).resolve())

    @property
    def name(self) -> str:
        return self.source.stem + (f":{self.entry}" if self.entry else "")

    def options(self) -> list[str]:
        """nvcc's options: those PyCUDA passed before this cache replaced it (less PyCUDA's own include folder)."""
        one_entry = ["-DKERNEL_ENTRY(name)=KERNEL_ENTRY_##name", f"-DKERNEL_ENTRY_{self.entry}=1"] if self.entry else []
        return ["-std=c++17", "-arch", self.code.replace("sm_", "compute_"), "-code", self.code,
                f"-I{kernel_dir()}", f"-I{self.source.parent}", *one_entry]

    def key(self) -> str:
        """The cache key: sources (the file and its headers), options, nvcc's version. The include folders are left
        out (the headers found there are in), so that checkouts in other places share the cache."""
        digest = hashlib.sha256()
        for path in sources_of(self.source):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        options = [option for option in self.options() if not option.startswith("-I")]
        digest.update("\0".join(options).encode() + b"\0" + nvcc_version().encode())
        return digest.hexdigest()


def kernel_dir() -> Path:
    """kernels/ of a source checkout, or llama/kernels/ inside an installed wheel."""
    package = Path(__file__).resolve().parent.parent  # llama/
    for candidate in (package / "kernels", package.parent / "kernels"):
        if (candidate / "common.cuh").exists():
            return candidate
    raise FileNotFoundError(f"CUDA kernel sources not found next to {package}")


def cache_dir() -> Path:
    """$LLAMA_KERNEL_CACHE, else kernels/ in the per-user cache (llama/cache.py)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return user_cache_dir() / "kernels"


def cores() -> int:
    return len(os.sched_getaffinity(0))


@functools.cache
def nvcc_version() -> str:
    try:
        return subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise KernelBuildError(f"nvcc, which compiles the CUDA kernels, cannot run: {e}") from e


def sources_of(source: Path) -> list[Path]:
    """source and every header it includes in quotes, recursively (found beside the includer, in kernels/ or
    beside source, nvcc's order), in order."""
    found, pending = [], [source]
    while pending:
        path = pending.pop(0)
        if path in found:
            continue
        found.append(path)
        for name in INCLUDE.findall(path.read_text()):
            header = next((c for c in (path.parent / name, kernel_dir() / name, source.parent / name) if c.exists()),
                          None)
            if header is not None:
                pending.append(header.resolve())
    return found


def entries_of(source: Path) -> list[str]:
    """The entry points a file guards one by one (its build units), or [] for a file built whole."""
    return ENTRY_GUARD.findall(source.read_text())


def unit_of(source: Path, code: str, entry: str | None = None) -> Unit:
    """The unit that holds entry (None: the whole file) of source."""
    return Unit(source, code, entry if entry is not None and entry in entries_of(source) else None)


def units_of(source: Path, code: str) -> list[Unit]:
    """Every unit of a file: one per guarded entry point, else the whole file."""
    return [Unit(source, code, entry) for entry in entries_of(source)] or [Unit(source, code)]


def entry_path(unit: Unit, key: str) -> Path:
    """Where the cache holds the unit's cubin of this key."""
    return cache_dir() / f"{unit.name.replace(':', '.')}.{key}.cubin"


def cached(unit: Unit) -> bytes | None:
    """The unit's cubin from the cache, or None when it is missing, partial or corrupt."""
    try:
        data = entry_path(unit, unit.key()).read_bytes()
    except FileNotFoundError:
        return None
    cubin, checksum = data[:-CHECKSUM_BYTES], data[-CHECKSUM_BYTES:]
    return cubin if cubin and hashlib.sha256(cubin).digest() == checksum else None


def store(path: Path, cubin: bytes) -> None:
    """Write a cache entry atomically (a temporary file renamed over it), the cubin then its checksum."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".partial", delete=False) as f:
        try:
            f.write(cubin + hashlib.sha256(cubin).digest())
        except OSError:
            os.unlink(f.name)
            raise
    os.replace(f.name, path)


def compile_unit(unit: Unit) -> bytes:
    """nvcc's cubin of the unit, stored in the cache under the key of the sources it read (taken before);
    KernelBuildError with nvcc's messages when it fails."""
    path = entry_path(unit, unit.key())
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "unit.cubin"
        try:
            result = subprocess.run([NVCC, "--cubin", *unit.options(), "-o", str(output), str(unit.source)],
                                    capture_output=True, text=True)
        except OSError as e:
            raise KernelBuildError(f"nvcc, which compiles the CUDA kernels, cannot run: {e}") from e
        if result.returncode != 0:
            entry = f" (entry point {unit.entry})" if unit.entry else ""
            raise KernelBuildError(f"nvcc could not compile {unit.source}{entry} for {unit.code}:\n"
                                   + (result.stderr + result.stdout).strip())
        cubin = output.read_bytes()
    store(path, cubin)
    return cubin


def cubin_of(unit: Unit) -> bytes:
    """The unit's cubin: from the cache, else compiled now."""
    return cached(unit) or compile_unit(unit)


def build(units, report=None) -> float:
    """Compile the units missing from the cache, one nvcc process each on every core, saying so on `report` in
    one line (sys.stderr by default; nothing when all are cached); the seconds it took. KernelBuildError names the
    first that failed."""
    report = report or sys.stderr
    if all(cached(unit) is not None for unit in units):
        return 0.0
    with building():  # another process building (another rank) first, then what it left
        return build_missing([unit for unit in dict.fromkeys(units) if cached(unit) is None], report)


@contextlib.contextmanager
def building():
    """Held by one process at a time per cache (an advisory lock on a file in it)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_missing(missing: list, report) -> float:
    """build()'s work once it holds the lock: the missing units compiled, the line said."""
    if not missing:
        return 0.0
    workers = min(len(missing), cores())
    start = time.perf_counter()
    print(f"compiling {len(missing)} kernel{'s' * (len(missing) > 1)} for {missing[0].code} on {workers} "
          f"core{'s' * (workers > 1)} (cache {cache_dir()}) ...", end="", file=report, flush=True)
    with ThreadPoolExecutor(workers) as pool:
        builds = [pool.submit(compile_unit, unit) for unit in missing]
    failures = [b.exception() for b in builds if b.exception() is not None]
    seconds = time.perf_counter() - start
    print(f" {seconds:.1f} s" if not failures else " failed", file=report, flush=True)
    if failures:
        raise failures[0]
    return seconds


def gemm_units(chooser, code: str) -> list[Unit]:
    """The GEMM units a plan's chooser may launch: its versions' entry points in kernels/gemm_wgmma.cu (the
    bf16 layouts, or FP8's), and gemm_mma.cu's (version 1's, or only the split-K reduce every version may run)."""
    wgmma, mma = kernel_dir() / "gemm_wgmma.cu", kernel_dir() / f"{GEMM_MMA_MODULE}.cu"
    kind = "fp8" if chooser.fp8 else "(nt|nn|tn)"
    units = [unit_of(mma, code, SPLITK_REDUCE)]
    for version in chooser.name.split("/"):
        units += units_of(mma, code) if version == "mma" else [
            Unit(wgmma, code, entry) for entry in entries_of(wgmma)
            if re.fullmatch(rf"gemm_{version}_{kind}(_128x\d+)?", entry)]
    return units


def attention_units(source: Path, code: str, head_dim: int | None) -> list[Unit]:
    """The flash attention file's units: of its entry points built apart, those of head_dim (named `_d<head_dim>`)
    and those of every head dim (None: all of them)."""
    def wanted(entry: str | None) -> bool:
        built_for = HEAD_DIM_ENTRY.search(entry or "")
        return head_dim is None or built_for is None or int(built_for.group(1)) == head_dim
    return [unit for unit in units_of(source, code) if wanted(unit.entry)]


def kernels_for(plan, code: str, decoder: bool = False, head_dim: int | None = None) -> list[Unit]:
    """The units a plan (llama/run/plan.py) launches on a GPU of this code; decoder: also the sampler's; head_dim:
    the model's, whose attention entry points alone are built where the file builds each apart (None: all)."""
    if plan.path == "cpu":
        return []
    modules = (PATH_MODULES[plan.path] + (PATH_MODULES["bf16"] + DECODER_MODULES if decoder else ())
               + ((DOC_MASK_MODULE,) if plan.doc_mask else ())
               + (LORA_MODULES["qlora" if getattr(plan, "qlora", False) else "lora"] if getattr(plan, "lora", None)
                  else ()))
    units = [unit_of(kernel_dir() / f"{module}.cu", code) for module in dict.fromkeys(modules)]
    if plan.path != "fp32" or decoder:
        units += gemm_units(plan.gemm, code) + attention_units(kernel_dir() / f"{plan.attention.module}.cu", code,
                                                               head_dim)
    if plan.fp8_gemm is not None:
        units += gemm_units(plan.fp8_gemm, code)
    if decoder:
        units += [u for u in units_of(kernel_dir() / "gemv.cu", code) if re.fullmatch(DECODER_GEMV, u.entry or "")]
    return list(dict.fromkeys(units))
