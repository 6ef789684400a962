"""How fast checkpoints are written and read on this machine's disk, and (--gpu) what a checkpoint
costs the training loop on the GPU: the snapshot into page-locked memory and the guard's look at the
weights, the stall before training goes on while the write runs in the background.

    python3 scripts/bench_checkpoint.py [--model d12] [--dir bench_ckpt]
    python3 scripts/bench_checkpoint.py --gpu --model llama3.1-8b --optimizer adamw8bit --recompute full -b 1 -t 4096

The disk part writes a checkpoint of the model's size (random weights and moments) with save_checkpoint
(fsynced, as training does), reads it back with load_checkpoint cold (its pages dropped from the cache
first, where the kernel lets us) and warm, and prints GB and GB/s of each. The folder is removed after.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama.config import get_preset  # noqa: E402
from llama.io.checkpoint import load_checkpoint, save_checkpoint, snapshot_moments  # noqa: E402
from llama.io.guard import weights_rms  # noqa: E402
from llama.params import ParameterLayout  # noqa: E402

STATE = {"run": {"batch_size": 1, "seq_len": 1, "tokens_per_step": 1, "seed": 0},
         "sample_rng": np.random.PCG64(0).state,
         "loader": {"epoch": 0, "shard_pos": 0, "batch_pos": 0, "seed": 0, "files": [], "B": 1, "T": 1, "rank": 0,
                    "world_size": 1}}


def drop_from_cache(folder: Path) -> None:
    """Ask the kernel to forget the folder's cached pages (they are fsynced), so that a read comes from the disk."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(what: str, nbytes: int, work) -> object:
    began = time.perf_counter()
    result = work()
    elapsed = time.perf_counter() - began
    print(f"{what:<28} {nbytes / 1e9:7.2f} GB {elapsed:8.2f} s {nbytes / 1e9 / elapsed:7.2f} GB/s")
    return result


def bench_disk(config, folder: Path) -> None:
    size = ParameterLayout(config).size
    rng = np.random.default_rng(0)
    params, m, v = (rng.standard_normal(size, dtype=np.float32) for _ in range(3))
    nbytes = 3 * params.nbytes
    folder.mkdir(parents=True, exist_ok=True)
    try:
        written = timed("write (fsynced)", nbytes, lambda: save_checkpoint(folder, 1, config, params, m, v, STATE))
        drop_from_cache(written)
        loaded = timed("read (cold)", nbytes, lambda: load_checkpoint(written))
        timed("read (warm)", nbytes, lambda: load_checkpoint(written))
        assert all(np.array_equal(loaded[k], a) for k, a in (("params", params), ("adam_m", m), ("adam_v", v)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def bench_gpu(config, args) -> None:
    """The stall of a checkpoint on one GPU: download_state (the first call also pins its host arrays), the
    weights' RMS, and the pieces of 8-bit moments dequantized as the writer does."""
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.plan import make_plan

    plan = make_plan(config, "cuda", "bf16", args.recompute, args.optimizer, args.optimizer_in_backward,
                     batch=(args.batch_size, args.seq_len))
    size = ParameterLayout(config).size
    model = GPUModelBF16(config, args.batch_size, args.seq_len, params=np.zeros(size, np.float32), plan=plan)
    snapshot = None
    for attempt in ("first (pins)", "again"):
        began = time.perf_counter()
        snapshot = model.download_state(snapshot)
        nbytes = sum(a.nbytes for a in snapshot.values())
        elapsed = time.perf_counter() - began
        print(f"download_state {attempt:<14} {nbytes / 1e9:7.2f} GB {elapsed:8.2f} s "
              f"{nbytes / 1e9 / elapsed:7.2f} GB/s")
    timed("weights' RMS (guard)", 4 * size, lambda: weights_rms(snapshot["params"][:size]))
    moment = snapshot_moments(snapshot, size)[0]
    if hasattr(moment, "chunks"):
        timed("dequantize m (writer)", moment.nbytes, lambda: sum(1 for _ in moment.chunks()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="d12")
    parser.add_argument("--dir", default="bench_ckpt", help="the folder to write in (on the disk to measure)")
    parser.add_argument("--gpu", action="store_true", help="measure the snapshot on the GPU instead of the disk")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--recompute", default=None)
    parser.add_argument("--optimizer-in-backward", action="store_true")
    parser.add_argument("-b", "--batch-size", type=int, default=1)
    parser.add_argument("-t", "--seq-len", type=int, default=1024)
    args = parser.parse_args()
    config = get_preset(args.model)
    print(f"{args.model}: {ParameterLayout(config).size / 1e6:,.0f}M parameters")
    if args.gpu:
        bench_gpu(config, args)
    else:
        bench_disk(config, Path(args.dir))


if __name__ == "__main__":
    main()
