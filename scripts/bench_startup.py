"""Startup, phase by phase: the seconds from the command to the end of step 1 of train_llama.py, cold (empty
kernel caches) and warm (the caches the cold run filled), next to torch.compile's warm-up for the same model
measured in the same run (scripts/torch_llama.py's twin of our architecture: from the process start to the end
of its first compiled step, inductor's and Triton's caches empty, then filled).

    python3 scripts/bench_startup.py                        # d12 and llama3.1-8b (the H100 recipe; it needs the
                                                            # Llama 3 tokenizer: scripts/download_starter_pack.py)
    python3 scripts/bench_startup.py --models d12 --no-torch
    python3 scripts/bench_startup.py --hf-folder /tmp/hf8b --make-hf-folder   # and 8B from an HF folder
    python3 scripts/bench_startup.py --scratch /tmp/s --models d12     # then --scratch /tmp/s --models ...: warm

train_llama.py runs as a subprocess with its output in a pipe, where every phase that takes a while says
`NAME: done in S s` (llama/runtime/progress.py; LLAMA_PHASE_TIMES=1 makes even the short ones say so); the table
shows each phase's seconds and `other`, the rest: Python's imports, the data, the plan, step 1 itself. Cold
points PYCUDA_CACHE_DIR and LLAMA_KERNEL_CACHE at an empty folder. --make-hf-folder first writes a folder of
random weights of llama3.1-8b with transformers on the GPU (bf16 safetensors shards, about 16 GB); the HF row
runs the 8B recipe with --init hf:FOLDER, warm.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # scripts.torch_llama and llama, run from anywhere
from llama.runtime.cli import require  # noqa: E402 (after the path)
RECIPES = {  # train_llama.py's arguments, and the torch twin's (B, T, activation checkpointing, optimizer)
    "d12": (["-e", "d12", "-b", "8", "-t", "1024"], (8, 1024, False, "adamw")),
    "llama3.1-8b": (["-e", "llama3.1-8b", "-b", "1", "-t", "4096", "--recompute", "full", "--optimizer", "adamw8bit",
                     "--optimizer-in-backward"], (1, 4096, True, "adamw8bit")),
}
RUN = ["-x", "2", "-v", "0", "-s", "0", "-n", "0", "--overwrite"]  # killed once step 1 is done
STEP_ONE = re.compile(r"^step\s+1/\d+ \|")
PHASE_DONE = re.compile(r"^(?P<name>.+): done in (?P<seconds>[\d.]+) s$")
# llama/runtime/kernel_build.py's line
KERNEL_BUILD = re.compile(r"^compiling \d+ kernels? for .* \.\.\. (?P<seconds>[\d.]+) s$")
PHASES = (("initializing the weights", "init"), ("reading ", "weight load"), ("capturing", "graph capture"))
TORCH_DONE = "first compiled step done"
VOCAB = re.compile(r"\| model .*, vocab (\d+) \|")  # the run's announcement (llama/run/trainer.py)


def needs_tokenizer(models: list[str]) -> str | None:
    """Why Meta's models among `models` cannot run here (None when they can): they need the Llama 3 tokenizer,
    fetched into the per-user cache if it is not there, where the trainer finds it."""
    from llama.config import META_MODELS
    from llama.data.tokenizer import ByteTokenizer, default_tokenizer_path, load_tokenizer
    meta = [m for m in dict.fromkeys(models) if m in META_MODELS]
    if not meta or not isinstance(load_tokenizer(fetch=True, quiet=True), ByteTokenizer):
        return None
    return (f"{', '.join(meta)} need{'s' * (len(meta) == 1)} the Llama 3 tokenizer, which is not at "
            f"{default_tokenizer_path()} and could not be fetched: get it with python3 scripts/download_starter_pack.py"
            f", or time the others alone (--models {' '.join(m for m in RECIPES if m not in META_MODELS) or 'd12'})")


def phase_column(name: str) -> str:
    """The table's column of a phase line's name (the kernel build keeps its own name)."""
    return next((column for prefix, column in PHASES if name.startswith(prefix)), name)


def cache_env(folder: Path, torch: bool = False) -> dict:
    """The environment whose kernel caches (or inductor's and Triton's, for torch) live under folder."""
    names = (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")) if torch else (
        ("PYCUDA_CACHE_DIR", "pycuda"), ("LLAMA_KERNEL_CACHE", "kernels"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLAMA_PHASE_TIMES": "1"}
    for name, sub in names:
        (folder / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(folder / sub)
    return env


def run_until(command: list[str], env: dict, done) -> tuple[float, list[tuple[float, str]]]:
    """Run command with its output in a pipe until a line matches done(line): (seconds from the start to that
    line, every (seconds, line) before it); the process is killed then (a stop signal would make the trainer write
    a checkpoint first). RuntimeError if the line never comes."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in process.stdout:
            now = time.perf_counter() - start
            if done(line.rstrip("\n")):
                return now, lines
            lines.append((now, line.rstrip("\n")))
    finally:
        process.kill()
        process.wait()
    tail = "\n".join(line for _, line in lines[-20:])
    raise RuntimeError(f"{' '.join(command)} ended (exit {process.returncode}) before its first step:\n{tail}")


def time_ours(model: str, cache: Path, out: Path, extra: list[str] = ()) -> tuple[dict, int]:
    """({'total': seconds to the end of step 1, phase column: seconds, ..., 'other': the rest}, the run's vocab)."""
    command = [sys.executable, "train_llama.py", *RECIPES[model][0], *RUN, "-o", str(out), *extra]
    total, lines = run_until(command, cache_env(cache), lambda line: STEP_ONE.match(line) is not None)
    row, vocab = {"total": total}, None
    for _, line in lines:
        match, build = PHASE_DONE.match(line), KERNEL_BUILD.match(line)
        if match or build:
            column = phase_column(match["name"]) if match else "kernel build"
            row[column] = row.get(column, 0.0) + float((match or build)["seconds"])
        vocab = vocab or (int(VOCAB.search(line)[1]) if VOCAB.search(line) else None)
    row["other"] = total - sum(seconds for column, seconds in row.items() if column != "total")
    return row, vocab


def time_torch(model: str, vocab: int, cache: Path) -> dict:
    """{'total': seconds from the start of a Python process to the end of its first compiled step}."""
    command = [sys.executable, __file__, "--torch-child", model, "--vocab", str(vocab)]
    total, _ = run_until(command, cache_env(cache, torch=True), lambda line: line == TORCH_DONE)
    return {"total": total}


def torch_child(model: str, vocab: int) -> None:
    """The torch side's process: one compiled training step of the model, then TORCH_DONE."""
    import torch

    from llama.config import get_preset
    from scripts.torch_llama import training_step
    B, T, checkpoint, optimizer = RECIPES[model][1]
    step, _ = training_step(get_preset(model).replace(vocab_size=vocab), B, T, "bf16", checkpoint, optimizer)
    step()
    torch.cuda.synchronize()
    print(TORCH_DONE, flush=True)


def make_hf_folder(folder: Path, model: str = "llama3.1-8b") -> None:
    """A Hugging Face folder of random weights of the preset, made by transformers on the GPU (bf16)."""
    import torch
    import transformers

    from llama.config import get_preset
    from llama.io.hf import transformers_config
    with torch.device("cuda"):
        hf_model = transformers.LlamaForCausalLM(transformers_config(get_preset(model))).to(torch.bfloat16)
    hf_model.save_pretrained(folder, safe_serialization=True)
    del hf_model
    torch.cuda.empty_cache()


def print_table(rows: dict[str, dict]) -> None:
    """One row per run: the seconds to the end of step 1 and of each phase ('-': no such phase)."""
    phases = [c for row in rows.values() for c in row if c not in ("total", "other")]
    columns = ["total", *dict.fromkeys(phases), "other"]
    width = max(len(name) for name in rows) + 2
    print("seconds".ljust(width) + "".join(f"{c[:22]:>24}" for c in columns))
    for name, row in rows.items():
        print(name.ljust(width) + "".join(f"{row[c]:>24.1f}" if c in row else f"{'-':>24}" for c in columns))


def states(cache: Path) -> tuple[str, ...]:
    """Cold then warm (the cold run fills the cache the warm one reads), or warm alone where an earlier
    invocation filled the cache (--scratch)."""
    return ("warm",) if cache.exists() else ("cold", "warm")


def bench(args, scratch: Path) -> dict[str, dict]:
    """Every run the arguments ask for, each model's torch twin after it, then the HF row."""
    rows = {}
    for model in args.models:
        for state in states(scratch / f"cache-{model}"):
            out = scratch / f"run-{model}-{state}"
            rows[f"{model} {state}"], vocab = time_ours(model, scratch / f"cache-{model}", out)
            print(f"{model} {state}: {rows[f'{model} {state}']['total']:.1f} s", file=sys.stderr, flush=True)
        for state in states(scratch / f"torch-{model}") if not args.no_torch else ():
            rows[f"{model} torch.compile {state}"] = time_torch(model, vocab, scratch / f"torch-{model}")
    if args.hf_folder:
        if args.make_hf_folder:
            start = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--write-hf-folder", args.hf_folder], check=True)
            print(f"wrote {args.hf_folder} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        cache = scratch / "cache-llama3.1-8b"
        state = states(cache)[0]
        rows[f"llama3.1-8b from HF {state}"], _ = time_ours("llama3.1-8b", cache, scratch / "run-hf",
                                                             ["--init", f"hf:{args.hf_folder}"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--no-torch", action="store_true", help="leave out torch.compile's warm-up")
    p.add_argument("--hf-folder", default=None, help="also time llama3.1-8b with --init hf:FOLDER")
    p.add_argument("--make-hf-folder", action="store_true", help="write --hf-folder first (random weights)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--scratch", default=None, help="where the caches and runs live, kept between invocations "
                   "(default: a temporary folder); a model's cache there is warm from an earlier invocation")
    p.add_argument("--torch-child", choices=list(RECIPES), help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--write-hf-folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.torch_child:
        return torch_child(args.torch_child, args.vocab)
    if args.write_hf_folder:
        return make_hf_folder(Path(args.write_hf_folder))
    if args.make_hf_folder and not args.hf_folder:
        p.error("--make-hf-folder needs --hf-folder")
    missing = needs_tokenizer(args.models + ["llama3.1-8b"] * bool(args.hf_folder))
    if missing:
        p.exit(2, f"error: {missing}\n")
    require("scripts/bench_startup.py", gpu=True)
    try:
        if args.scratch:
            rows = bench(args, Path(args.scratch))
        else:
            with tempfile.TemporaryDirectory(prefix="bench_startup_") as scratch:
                rows = bench(args, Path(scratch))
    except RuntimeError as e:  # a run that ended before its first step: its command, exit code and last lines
        p.exit(1, f"error: {e}\n")
    except KeyboardInterrupt:
        p.exit(130, "\ninterrupted\n")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
