"""How fast checkpoints are written and read on this machine's disk, and (--gpu) what a checkpoint
costs the training loop on the GPU: the page-locking of the snapshot's memory in the background while training
steps run (and their time meanwhile), the snapshot into it and the guard's look at the weights (their RMS on the
device), the stall of the first checkpoint and of a later one, and that write of the snapshot (fsynced, into
--dir); with --resume also its read back into the model as --resume does on one GPU (the read, the upload, both
streamed together, and the way before: a host read, then the upload), and what train_llama.py takes for the
recipe: a run of one step that writes its checkpoint into --dir (its size and write time), then `--resume` of it,
from the command to the end of its first step.

    python3 scripts/bench_checkpoint.py [--model d12] [--dir bench_ckpt]
    python3 scripts/bench_checkpoint.py --gpu --resume --model llama3.1-8b --optimizer adamw8bit --recompute full \
        --optimizer-in-backward -b 1 -t 4096 --dir /tmp/bench_ckpt

The disk part writes a checkpoint of the model's size (random weights and moments) with save_checkpoint
(fsynced, as training does), reads it back with load_checkpoint cold (its pages dropped from the cache
first, where the kernel lets us) and warm, and cold in parts as the GPU resume does, and prints GB and GB/s of
each. The folder is removed after.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama.config import get_preset  # noqa: E402
from llama.io.checkpoint import (checkpoint_pieces, load_checkpoint, read_data, save_checkpoint,  # noqa: E402
                                 load_state_into, snapshot_moments, stream_checkpoint)
from llama.io.safetensors_file import READ_PIECE, READERS  # noqa: E402
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
    print(f"{what:<28} {nbytes / 1e9:7.2f} GB {elapsed:8.2f} s {nbytes / 1e9 / elapsed:7.2f} GB/s" if nbytes
          else f"{what:<28} {elapsed:8.2f} s")
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
        drop_from_cache(written)
        parts = [np.empty(READ_PIECE, np.uint8) for _ in range(READERS)]  # --resume's way on one GPU, without a GPU
        timed("read in parts (cold)", nbytes,
              lambda: stream_checkpoint(load_checkpoint(written, read=False), parts, lambda *part: None))
        assert all(np.array_equal(loaded[k], a) for k, a in (("params", params), ("adam_m", m), ("adam_v", v)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def step_seconds(model, batch, step: int) -> float:
    """One training step's time (its loss and norm come back to the host: the step is done)."""
    from llama.optim import AdamWConfig
    began = time.perf_counter()
    model.train_step([batch], 1e-5, step, AdamWConfig())
    return time.perf_counter() - began


def milliseconds(times: list[float]) -> str:
    return f"median {np.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms" if times else "none"


def bench_background_pinning(model, batch) -> None:
    """reserve_state's page-locking of the snapshot in the background while training steps run: how long it
    takes, and the step time meanwhile against after (does pinning slow the steps?)."""
    for step in (1, 2):  # warm: graphs captured, kernels loaded
        step_seconds(model, batch, step)
    began = time.perf_counter()
    model.reserve_state()
    during = []
    while not model.state_host.ready:
        during.append(step_seconds(model, batch, 3 + len(during)))
    model.state_host.wait()
    pinned_in, nbytes = time.perf_counter() - began, model.state_host.nbytes
    after = [step_seconds(model, batch, 3 + len(during) + i) for i in range(max(3, min(len(during), 10)))]
    print(f"page-locking the snapshot in the background {nbytes / 1e9:7.2f} GB {pinned_in:8.2f} s "
          f"{nbytes / 1e9 / pinned_in:7.2f} GB/s, {len(during)} steps meanwhile")
    print(f"step time while pinning: {milliseconds(during)}; after: {milliseconds(after)}")


def stall_seconds(model, probe) -> float:
    """What a checkpoint stops training for on one GPU: the snapshot's copy beside the probe forward, then the RMS."""
    began = time.perf_counter()
    model.download_state(wait=False)
    model.forward(*probe)
    model.wait_for_state()
    model.weights_rms()
    return time.perf_counter() - began


def drop_and_time(what: str, folder: Path, nbytes: int, work) -> object:
    drop_from_cache(folder)
    return timed(what, nbytes, work)


def bench_streamed_resume(model, folder: Path) -> None:
    """A checkpoint read into the model as --resume does on one GPU, cold: the read alone (parts into page-locked
    buffers, dropped), the upload alone (the same parts from a page-locked buffer), both streamed together
    (load_state_into), and the way before: read_data into host arrays, then set_state."""
    from llama.runtime.cuda import runtime
    from llama.runtime.pinned import PinnedArrays
    checkpoint, drv = load_checkpoint(folder, read=False), runtime().drv
    pieces = checkpoint_pieces(checkpoint)
    nbytes, targets = sum(n for _, _, n, _, _ in pieces), model.state_buffers()
    buffers = list(PinnedArrays({f"buffer {i}": ((READ_PIECE,), np.uint8) for i in range(READERS)}).wait().values())
    drop_and_time("read alone (cold)", folder, nbytes,
                  lambda: stream_checkpoint(checkpoint, buffers, lambda *part: None))

    def upload_alone() -> None:
        for _, _, n, name, to in pieces:
            for done in range(0, n, READ_PIECE):
                drv.memcpy_htod(targets[name].ptr + to + done, buffers[0][:min(READ_PIECE, n - done)])
    timed("upload alone (page-locked)", nbytes, upload_alone)
    drop_and_time("read + upload streamed (cold)", folder, nbytes, lambda: load_state_into(model, checkpoint))
    host = drop_and_time("before: read into host arrays", folder, nbytes, lambda: read_data(checkpoint))
    timed("before: set_state from them", nbytes,
          lambda: model.set_state(host["params"], host["adam_m"], host["adam_v"]))


def bench_gpu(config, args) -> None:
    """The stall of a checkpoint on one GPU, and its parts: the snapshot's page-locking in the background while
    steps run, the probe batch's forward that runs beside the copies, the weights' RMS on the device, the first
    checkpoint's stall and a later one's; then the background writer's part, the snapshot written into --dir, and
    with --resume that checkpoint read back into the model as --resume does (removed after)."""
    from llama.runtime.cuda import runtime
    from llama.runtime.kernel_build import build, kernels_for
    from llama.model.gpu_bf16 import GPUModelBF16
    from llama.options import RunOptions
    from llama.run.plan import make_plan

    options = RunOptions(device="cuda", dtype="bf16", recompute=args.recompute, optimizer=args.optimizer,
                         in_backward=args.optimizer_in_backward, batch=(args.batch_size, args.seq_len))
    plan = make_plan(config, options)
    build(kernels_for(plan, runtime().code, head_dim=config.head_dim))
    model = GPUModelBF16(config, plan, (args.batch_size, args.seq_len))  # weights drawn on the GPU
    rng = np.random.default_rng(0)
    probe = [rng.integers(0, config.vocab_size, (args.batch_size, args.seq_len)) for _ in range(2)]
    bench_background_pinning(model, tuple(probe))
    model.forward(*probe)  # warm
    timed("the probe batch's forward", 0, lambda: model.forward(*probe))
    timed("the weights' RMS on the GPU", 4 * ParameterLayout(config).size, model.weights_rms)
    for which in ("first", "a later"):
        print(f"the stall of {which} checkpoint (the copy beside the probe forward, then the RMS): "
              f"{stall_seconds(model, probe):.2f} s")
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        written = write_snapshot(model, config, folder)
        model.state_host = None  # its page-locked memory freed for the host read below
        if args.resume:
            bench_streamed_resume(model, written)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_snapshot(model, config, folder: Path) -> Path:
    """What the background writer does with the snapshot: its checkpoint written (fsynced) into folder."""
    snapshot, size = model.download_state(), ParameterLayout(config).size
    return timed("write the snapshot (fsynced)", sum(a.nbytes for a in snapshot.values()), lambda: save_checkpoint(
        folder, 1, config, snapshot["params"][:size], *snapshot_moments(snapshot, size), STATE))


def bench_pinning(nbytes: int = 8 << 30) -> None:
    """What page-locking host memory costs per GB: the driver's allocation (download_state's before), and
    PinnedArrays' registration piece by piece (reserve_state's, here waited for)."""
    from llama.runtime.cuda import runtime
    from llama.runtime.pinned import PinnedArrays
    timed("pagelocked_empty", nbytes, lambda: runtime().drv.pagelocked_empty(nbytes, np.uint8))
    timed("PinnedArrays (pieces)", nbytes, lambda: PinnedArrays({"bytes": ((nbytes,), np.uint8)}).wait())


def train_command(args, folder: Path, *extra: str) -> list[str]:
    """train_llama.py with the benchmark's recipe, into folder, keeping one checkpoint (the disk holds one 8B)."""
    recipe = [*(["--recompute", args.recompute] if args.recompute else []),
              *(["--optimizer-in-backward"] if args.optimizer_in_backward else [])]
    return [sys.executable, str(ROOT / "train_llama.py"), "-e", args.model, "-b", str(args.batch_size), "-t",
            str(args.seq_len), "--optimizer", args.optimizer, *recipe, "-v", "0", "-s", "0", "-nk", "1", "-o",
            str(folder), *extra]


def seconds_to_step(command: list[str], step: int, steps: int) -> float:
    """Run command until its llm.c line of `step` (1-based) appears, then kill it (and its checkpoint write, which
    it leaves behind as a kill -9 would); seconds from the start to that line. Its output is printed as it comes,
    each line after the seconds since the start, every phase's time among them (LLAMA_PHASE_TIMES)."""
    began = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, env={**os.environ, "LLAMA_PHASE_TIMES": "1"})
    try:
        for line in child.stdout:
            print(f"[{time.perf_counter() - began:5.1f} s] {line}", end="")
            if re.match(rf"step +{step}/{steps} ", line):
                return time.perf_counter() - began
        raise RuntimeError(f"{command[1]} ended with {child.wait()} before step {step}")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def bench_resume(args) -> None:
    """train_llama.py's checkpoint of the recipe after one step (size, write time), then --resume of it read
    from the disk (its pages dropped from the cache) to the end of the next step."""
    folder = Path(args.dir)
    shutil.rmtree(folder, ignore_errors=True)
    try:
        began = time.perf_counter()
        subprocess.run(train_command(args, folder, "-x", "1"), check=True)
        checkpoint = folder / "ckpt_00000001"
        nbytes = sum(p.stat().st_size for p in checkpoint.iterdir())
        print(f"run of 1 step with its checkpoint: {time.perf_counter() - began:.1f} s; the checkpoint: "
              + ", ".join(f"{p.name} {p.stat().st_size / 1e9:.2f} GB" for p in sorted(checkpoint.iterdir())
                          if p.stat().st_size))
        drop_from_cache(checkpoint)
        resumed = seconds_to_step(train_command(args, folder, "-x", "2", "--resume"), 2, 2)
        print(f"--resume of {nbytes / 1e9:.2f} GB from the command to the end of its first step: {resumed:.1f} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="d12")
    parser.add_argument("--dir", default="bench_ckpt", help="the folder to write in (on the disk to measure)")
    parser.add_argument("--gpu", action="store_true", help="measure the snapshot on the GPU instead of the disk")
    parser.add_argument("--resume", action="store_true",
                        help="with --gpu: also train_llama.py's checkpoint of one step and its --resume, in --dir, and "
                             "the read of a checkpoint into the model in parts")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--recompute", default=None)
    parser.add_argument("--optimizer-in-backward", action="store_true")
    parser.add_argument("-b", "--batch-size", type=int, default=1)
    parser.add_argument("-t", "--seq-len", type=int, default=1024)
    args = parser.parse_args()
    config = get_preset(args.model)
    print(f"{args.model}: {ParameterLayout(config).size / 1e6:,.0f}M parameters")
    if args.gpu:
        if args.resume:  # first, while this process holds no GPU memory
            bench_resume(args)
        bench_gpu(config, args)
        bench_pinning()
    else:
        bench_disk(config, Path(args.dir))


if __name__ == "__main__":
    main()
