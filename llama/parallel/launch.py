"""Start one training process per GPU, like torchrun on one host, and stop them all if one fails.

    python3 -m llama.launch --nproc-per-node 8 train_llama.py -e d12 -o runs/d12

runs `python3 train_llama.py -e d12 -o runs/d12` eight times, with RANK 0..7, WORLD_SIZE 8,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each one's environment (see
llama/parallel/distributed.py for how the ranks then meet). Everything after the script goes to the script.
On several hosts, start one launcher per host with the same --nnodes and --master-addr (the host of
global rank 0) and each host's own --node-rank:

    host0$ python3 -m llama.launch --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr host0 train_llama.py ...
    host1$ python3 -m llama.launch --nproc-per-node 8 --nnodes 2 --node-rank 1 --master-addr host0 train_llama.py ...

The ranks of several processes talk over NCCL: where it cannot be loaded (llama/parallel/nccl.py finds it), the
launcher says so in one line and starts nothing (exit code 2).

Ctrl-C or SIGTERM to the launcher is passed on to every rank (once per signal received, so a second
Ctrl-C stops the trainers at once), and the launcher then waits for them. When a rank exits with an
error while others still run, the launcher stops the others (SIGTERM, then SIGKILL after --grace
seconds) and exits with that rank's code. Ranks also get SIGTERM if the launcher itself dies.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time

from llama.parallel.distributed import DEFAULT_PORT
from llama.parallel.nccl import library_path

POLL = 0.1  # seconds between looks at the ranks
PR_SET_PDEATHSIG = 1
# NVLink multicast (NVLS) stays off: on our shared machines a program that uses it can take the host's
# GPUs out of service. Set only where the user has not chosen.
SAFE_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, not argparse's usage block."""
        self.exit(2, f"launch: error: {message} (see python3 -m llama.launch --help)\n")


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(prog="python3 -m llama.launch", allow_abbrev=False,
                     description="Start one process per GPU running `python SCRIPT ARGS`, with RANK, WORLD_SIZE, "
                                 "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes (GPUs) on this host (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, help="hosts in the job (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1 (default 0)")
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                        help="host of global rank 0 (default $MASTER_ADDR, else 127.0.0.1 on one host)")
    parser.add_argument("--master-port", type=int, default=None,
                        help=f"free TCP port there (default $MASTER_PORT, else {DEFAULT_PORT})")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping the ranks (default 10)")
    parser.add_argument("script", nargs="?", help="the Python program each rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    if args.script is None:
        parser.error("no script given: python3 -m llama.launch [options] SCRIPT [SCRIPT ARGS...]")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {args.nproc_per_node}: must be at least 1")
    if args.nnodes < 1:
        parser.error(f"--nnodes {args.nnodes}: must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank}: must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    if not args.master_addr:
        if args.nnodes > 1:
            parser.error(f"--master-addr is required with --nnodes {args.nnodes}: the host of global rank 0")
        args.master_addr = "127.0.0.1"
    if args.master_port is None:
        port = os.environ.get("MASTER_PORT", str(DEFAULT_PORT))
        try:
            args.master_port = int(port)
        except ValueError:
            parser.error(f"MASTER_PORT={port!r} is not an integer")
    if not 1 <= args.master_port <= 65535:
        parser.error(f"master port {args.master_port} is not a TCP port (1..65535)")
    if args.grace < 0:
        parser.error(f"--grace {args.grace:g}: must not be negative")
    if not os.path.isfile(args.script):
        parser.error(f"{args.script}: no such file")
    missing = nccl_missing() if args.nnodes * args.nproc_per_node > 1 else None
    if missing:
        parser.exit(2, f"launch: error: {missing}\n")
    return args


def nccl_missing() -> str | None:
    """Why NCCL cannot be loaded here (one line), or None when it can."""
    path = library_path()
    try:
        ctypes.CDLL(path)
    except OSError as e:
        return (f"the ranks talk over NCCL, which cannot be loaded here ({e}); install it with "
                f'python3 -m pip install -e ".[cuda]" (nvidia-nccl-cu13), or name the library in LLAMA_NCCL_LIBRARY')
    return None


def rank_environ(args: argparse.Namespace, local_rank: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(args.node_rank * args.nproc_per_node + local_rank),
               WORLD_SIZE=str(args.nnodes * args.nproc_per_node), LOCAL_RANK=str(local_rank),
               LOCAL_WORLD_SIZE=str(args.nproc_per_node), MASTER_ADDR=args.master_addr,
               MASTER_PORT=str(args.master_port))
    for name, value in SAFE_DEFAULTS.items():
        env.setdefault(name, value)
    return env


def _die_with_parent():
    """A preexec_fn: the child gets SIGTERM when the launcher dies (Linux); None where prctl is missing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def preexec():
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def describe(code: int) -> tuple[str, int]:
    """How a rank ended, and the exit code that stands for it (128 + signal for a killed rank)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}", 128 - code
    return f"exited with code {code}", code


class Ranks:
    """The processes of this host, and the launcher's signals passed on to them."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.procs: list[subprocess.Popen] = []
        self.forwarded = False  # a signal reached the ranks: they are stopping on their own

    def start(self) -> None:
        preexec = _die_with_parent()
        command = [sys.executable, self.args.script, *self.args.script_args]
        for local_rank in range(self.args.nproc_per_node):
            self.procs.append(subprocess.Popen(command, env=rank_environ(self.args, local_rank),
                                               start_new_session=True, preexec_fn=preexec))

    def alive(self) -> list[tuple[int, subprocess.Popen]]:
        first = self.args.node_rank * self.args.nproc_per_node
        return [(first + i, p) for i, p in enumerate(self.procs) if p.poll() is None]

    def forward(self, signum: int, frame=None) -> None:
        """The launcher's signal handler: pass the signal on to every live rank."""
        self.forwarded = True
        self.send(signum)

    def send(self, signum: int) -> None:
        for _, proc in self.alive():
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def monitor(self) -> int:
        """Wait for every rank; stop the rest when one fails. The first failure's exit code, else 0."""
        first = self.args.node_rank * self.args.nproc_per_node
        ended: set[int] = set()
        exit_code = 0
        kill_at = None
        while True:
            finished = [(i, proc.poll()) for i, proc in enumerate(self.procs) if i not in ended]
            finished = [(i, code) for i, code in finished if code is not None]
            # a rank killed by a signal is the cause of the others' errors in the same poll: named first
            for i, code in sorted(finished, key=lambda f: f[1] >= 0):
                ended.add(i)
                if code == 0 or exit_code:
                    continue
                how, exit_code = describe(code)
                if kill_at is None and self.alive() and not self.forwarded:
                    print(f"launch: rank {first + i} {how}; stopping the other ranks", file=sys.stderr, flush=True)
                    self.send(signal.SIGTERM)
                    kill_at = time.monotonic() + self.args.grace
                elif not self.forwarded:
                    print(f"launch: rank {first + i} {how}", file=sys.stderr, flush=True)
            alive = self.alive()
            if not alive:
                return exit_code
            if kill_at is not None and time.monotonic() >= kill_at:
                ranks = ", ".join(str(rank) for rank, _ in alive)
                print(f"launch: rank{'s' if len(alive) > 1 else ''} {ranks} still running {self.args.grace:g} s after "
                      "SIGTERM; killing", file=sys.stderr, flush=True)
                self.send(signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(POLL)


def main(argv=None) -> int:
    args = parse_args(argv)
    ranks = Ranks(args)
    previous = {s: signal.signal(s, ranks.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            ranks.start()
        except OSError as e:
            print(f"launch: error: cannot start {args.script}: {e}", file=sys.stderr)
            ranks.send(signal.SIGKILL)
            for proc in ranks.procs:
                proc.wait()
            return 1
        return ranks.monitor()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

