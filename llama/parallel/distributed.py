"""The process side of data-parallel training: one process per GPU, and how they find each other.

`DistributedEnv.from_environ()` says which rank this process is, reading what the launcher set:
torchrun or `python3 -m llama.launch` (RANK, WORLD_SIZE, LOCAL_RANK), Slurm's srun (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID) or mpirun (Open MPI's OMPI_COMM_WORLD_*, MPICH's PMI_RANK/PMI_SIZE);
with none of them it is a single process. Every rank also needs the address of rank 0's host,
MASTER_ADDR, and a free TCP port there, MASTER_PORT (default 29500).

`Rendezvous` is how the ranks meet: rank 0 listens on MASTER_PORT and every other rank connects to
MASTER_ADDR:MASTER_PORT (retrying while rank 0 has not started yet), so the ranks form a TCP star
around rank 0. Rank 0 sends its NCCL unique id down the star (`broadcast`); the connections then stay
open as a liveness channel (`watch`): a rank that exits without saying goodbye (a crash, a kill)
closes its sockets, and the others learn of it at once instead of waiting forever inside an NCCL
collective. `Watchdog` covers the other way a data-parallel job hangs: no step finishes for too
long, or NCCL reports an asynchronous error. `abort` ends the process from such a watcher thread.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, NoReturn

DEFAULT_PORT = 29500
MAGIC = b"LLAMARDV"
VERSION = 1
HELLO = struct.Struct("!8sHii")   # magic, protocol version, rank, world_size: what a connecting rank sends
LENGTH = struct.Struct("!Q")      # the length prefix of a broadcast payload
ACCEPTED, REJECTED = b"A", b"R"   # rank 0's answer to a hello (a rejection is followed by its reason, then EOF)
PAYLOAD, GOODBYE = b"P", b"G"     # what rank 0 broadcasts; what a rank sends when it closes cleanly
MPI_VARIABLES = (("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                 ("mpirun (MPICH)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))  # launcher, rank, size, local rank
SLURM_MASTER_HINT = 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'


class DistributedError(Exception):
    """One-line, user-facing: bad launcher environment, rendezvous failure, lost peer."""


def _integer(environ, name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer") from None


@dataclass(frozen=True)
class DistributedEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ=None) -> "DistributedEnv":
        """This process's place in the job, from the variables its launcher set (os.environ by default)."""
        environ = os.environ if environ is None else environ
        ranks = _launcher_ranks(environ)
        if ranks is None:
            return cls()
        launcher, (rank_var, rank), (size_var, world_size), (local_var, local_rank) = ranks
        if world_size < 1:
            raise DistributedError(f"{size_var}={world_size} must be at least 1")
        if not 0 <= rank < world_size:
            raise DistributedError(f"{rank_var}={rank} is outside 0..{world_size - 1} ({size_var}={world_size})")
        if local_rank < 0:
            raise DistributedError(f"{local_var}={local_rank} must not be negative")
        port = DEFAULT_PORT
        if "MASTER_PORT" in environ:
            port = _integer(environ, "MASTER_PORT")
            if not 1 <= port <= 65535:
                raise DistributedError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
        master_addr = environ.get("MASTER_ADDR", "")
        if world_size > 1 and not master_addr:
            hint = f"; under srun: {SLURM_MASTER_HINT}" if launcher == "srun" else ""
            raise DistributedError(f"MASTER_ADDR is not set: {world_size} ranks ({launcher}) need the address of "
                                   f"rank 0's host{hint}")
        return cls(rank, world_size, local_rank, master_addr or cls.master_addr, port)


def _launcher_ranks(environ):
    """(launcher, (name, rank), (name, world_size), (name, local_rank)), or None for a single process."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        for given, missing in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
            if missing not in environ:
                raise DistributedError(f"{given} is set but {missing} is not: a launcher sets both")
        world_size = _integer(environ, "WORLD_SIZE")
        if "LOCAL_RANK" in environ:
            local = ("LOCAL_RANK", _integer(environ, "LOCAL_RANK"))
        elif world_size == 1:
            local = ("LOCAL_RANK", 0)
        else:
            raise DistributedError(f"LOCAL_RANK is not set: with WORLD_SIZE={world_size} each rank needs it "
                                   "to pick its GPU")
        return "torchrun or llama.launch", ("RANK", _integer(environ, "RANK")), ("WORLD_SIZE", world_size), local
    if "SLURM_PROCID" in environ:
        size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        if size_var not in environ or _integer(environ, size_var) == 1:
            return None
        return ("srun", ("SLURM_PROCID", _integer(environ, "SLURM_PROCID")), (size_var, _integer(environ, size_var)),
                _required(environ, "SLURM_LOCALID", "srun"))
    for launcher, rank_var, size_var, local_var in MPI_VARIABLES:
        if rank_var in environ:
            return (launcher, (rank_var, _integer(environ, rank_var)), _required(environ, size_var, launcher),
                    _required(environ, local_var, launcher))
    return None


def _required(environ, name: str, launcher: str) -> tuple[str, int]:
    if name not in environ:
        raise DistributedError(f"{name} is not set, though {launcher} started this process")
    return name, _integer(environ, name)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    """`size` bytes from sock; fewer only where the peer closed the connection first."""
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _keepalive(sock: socket.socket) -> None:
    """Notice a peer whose host vanished (no FIN ever comes) within about half a minute."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Rendezvous:
    """A TCP star at master_addr:master_port: rank 0 listens, every other rank connects. It carries
    the NCCL unique id (broadcast) and then stays open as a liveness channel (watch).

    With one process it opens nothing: broadcast returns the payload and watch does nothing. Used as a
    context manager it says goodbye on a normal exit and on SystemExit / KeyboardInterrupt (a stop the
    other ranks share), but not when an exception escapes: the peers then learn that this rank failed.
    """

    def __init__(self, env: DistributedEnv, timeout: float = 300.0):
        self.env, self.timeout = env, timeout
        self._peers: dict[int, tuple[socket.socket, str]] = {}  # rank -> (socket, "host:port")
        self._watcher: threading.Thread | None = None
        self._wake_r, self._wake_w = None, None  # a socketpair that stops the watcher's select
        self._closed = False
        if env.world_size == 1:
            return
        deadline = time.monotonic() + timeout
        try:
            if env.is_main:
                self._accept_all(deadline)
            else:
                self._connect(deadline)
        except BaseException:
            self.close(goodbye=False)
            raise

    # ---- meeting -------------------------------------------------------------------------------
    def _accept_all(self, deadline: float) -> None:
        env = self.env
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("0.0.0.0", env.master_port))
            except OSError as e:
                raise DistributedError(f"rank 0 cannot listen on port {env.master_port} ({e.strerror}): another "
                                       "job may hold it; choose another MASTER_PORT") from None
            listener.listen(env.world_size)
            while len(self._peers) < env.world_size - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = ", ".join(str(r) for r in range(1, env.world_size) if r not in self._peers)
                    raise DistributedError(f"rank 0 waited {self.timeout:g} s at 0.0.0.0:{env.master_port} for "
                                           f"rank{'s' if ',' in missing else ''} {missing} to connect")
                listener.settimeout(remaining)
                try:
                    sock, (host, port) = listener.accept()
                except socket.timeout:
                    continue
                self._admit(sock, f"{host}:{port}", deadline)
        finally:
            listener.close()

    def _admit(self, sock: socket.socket, address: str, deadline: float) -> None:
        """Read a connecting rank's hello; keep its socket, or answer why not and raise."""
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            hello = _recv_exactly(sock, HELLO.size)
        except OSError as e:
            sock.close()
            raise DistributedError(f"rank 0: the connection from {address} failed before it said which rank it is "
                                   f"({e})") from None
        if len(hello) < HELLO.size:
            sock.close()
            raise DistributedError(f"rank 0: {address} connected to port {self.env.master_port} and closed without "
                                   "saying which rank it is")
        magic, version, rank, world_size = HELLO.unpack(hello)
        problem = None
        if magic != MAGIC or version != VERSION:
            problem = (f"a connection from {address} to port {self.env.master_port} is not one of this job's ranks "
                       f"(another program, or another version of this one)")
        elif world_size != self.env.world_size:
            problem = (f"rank {rank} ({address}) has WORLD_SIZE={world_size} but rank 0 has "
                       f"WORLD_SIZE={self.env.world_size}: is another job using MASTER_PORT={self.env.master_port}?")
        elif not 0 < rank < world_size:
            problem = f"{address} connected as rank {rank}, which is outside 1..{world_size - 1}"
        elif rank in self._peers:
            problem = (f"rank {rank} connected twice (from {self._peers[rank][1]} and {address}): two processes "
                       "have the same rank")
        if problem is not None:
            try:
                sock.sendall(REJECTED + problem.encode())
            except OSError:
                pass
            sock.close()
            raise DistributedError(problem)
        try:
            sock.sendall(ACCEPTED)
        except OSError as e:
            sock.close()
            raise DistributedError(f"rank 0: rank {rank} ({address}) went away while connecting ({e}): it has exited "
                                   "or crashed") from None
        _keepalive(sock)
        self._peers[rank] = (sock, address)

    def _connect(self, deadline: float) -> None:
        env = self.env
        where = f"{env.master_addr}:{env.master_port}"
        last_error = "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedError(f"rank {env.rank} could not reach rank 0 at {where} within {self.timeout:g} s "
                                       f"({last_error}): is rank 0 running, and MASTER_ADDR/MASTER_PORT right?")
            try:
                sock = socket.create_connection((env.master_addr, env.master_port), timeout=min(remaining, 5.0))
                break
            except OSError as e:  # refused: rank 0 has not started listening yet; also DNS not ready
                last_error = e.strerror or str(e)
                time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(HELLO.pack(MAGIC, VERSION, env.rank, env.world_size))
            answer = _recv_exactly(sock, 1)
            reason = _recv_exactly(sock, 4096) if answer == REJECTED else b""  # rank 0 closes after the reason
        except OSError as e:
            sock.close()
            failure = (f"did not answer within {self.timeout:g} s" if isinstance(e, socket.timeout)
                       else f"failed ({e})")
            raise DistributedError(f"rank {env.rank}: the connection to rank 0 at {where} {failure}") from None
        if answer != ACCEPTED:
            sock.close()
            if answer == REJECTED:
                raise DistributedError(f"rank 0 at {where} rejected rank {env.rank}: {reason.decode(errors='replace')}")
            raise DistributedError(f"rank {env.rank}: {where} closed the connection without accepting it "
                                   "(is it this job's rank 0?)")
        _keepalive(sock)
        self._peers[0] = (sock, where)

    # ---- broadcast -----------------------------------------------------------------------------
    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0 passes bytes and every rank returns them (other ranks pass None)."""
        env = self.env
        if self.env.is_main != (payload is not None):
            raise ValueError("rank 0 passes the payload to broadcast, every other rank passes None")
        if self._closed:
            raise RuntimeError("broadcast on a closed Rendezvous")
        if self._watcher is not None:
            raise RuntimeError("broadcast after watch: the watcher thread owns the sockets now")
        deadline = time.monotonic() + self.timeout
        if env.is_main:
            payload = bytes(payload)
            message = PAYLOAD + LENGTH.pack(len(payload)) + payload
            for rank, (sock, address) in sorted(self._peers.items()):
                try:
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    sock.sendall(message)
                except OSError as e:
                    raise DistributedError(f"rank 0 could not send the broadcast to rank {rank} ({address}): {e}: it "
                                           "has exited or crashed") from None
            return payload
        sock, address = self._peers[0]
        try:
            sock.settimeout(self.timeout)
            header = _recv_exactly(sock, 1 + LENGTH.size)
            if len(header) == 1 + LENGTH.size and header[:1] == PAYLOAD:
                (length,) = LENGTH.unpack(header[1:])
                data = _recv_exactly(sock, length)
                if len(data) == length:
                    return data
        except socket.timeout:
            raise DistributedError(f"rank {env.rank} waited {self.timeout:g} s for rank 0's broadcast from "
                                   f"{address}") from None
        except OSError as e:
            raise DistributedError(f"rank {env.rank}: the connection to rank 0 at {address} failed during the "
                                   f"broadcast ({e})") from None
        raise DistributedError(f"rank {env.rank}: rank 0 at {address} closed its connection during the broadcast: "
                               "it has exited or crashed")

    # ---- liveness ------------------------------------------------------------------------------
    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Start one daemon thread that calls on_lost(message) once if a peer goes away without a goodbye."""
        if self._watcher is not None:
            raise RuntimeError("watch was already called")
        if self._closed:
            raise RuntimeError("watch on a closed Rendezvous")
        if not self._peers:
            return
        self._wake_r, self._wake_w = socket.socketpair()
        self._watcher = threading.Thread(target=self._watch, args=(on_lost,), name="rendezvous-watch", daemon=True)
        self._watcher.start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        watched = {sock: (rank, address) for rank, (sock, address) in self._peers.items()}
        for sock in watched:
            sock.settimeout(None)
        while watched:
            readable, _, _ = select.select([self._wake_r, *watched], [], [])
            if self._wake_r in readable:
                return
            for sock in readable:
                rank, address = watched[sock]
                try:
                    data = sock.recv(1)
                except OSError as e:
                    on_lost(f"the connection to rank {rank} ({address}) failed ({e}): it has exited or crashed")
                    return
                if data == GOODBYE:
                    del watched[sock]
                elif not data:
                    on_lost(f"rank {rank} ({address}) closed its connection: it has exited or crashed")
                    return
                else:
                    on_lost(f"rank {rank} ({address}) sent {data!r} on the liveness channel: not this protocol")
                    return

    # ---- closing -------------------------------------------------------------------------------
    def close(self, goodbye: bool = True) -> None:
        """Say goodbye to every peer (unless goodbye=False: the peers then see this rank as lost), stop the
        watcher and close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._wake_w.send(b"x")
            if self._watcher is not threading.current_thread():
                self._watcher.join()
            self._wake_r.close()
            self._wake_w.close()
        for sock, _ in self._peers.values():
            if goodbye:
                try:
                    sock.settimeout(1.0)
                    sock.sendall(GOODBYE)
                except OSError:
                    pass  # the peer may be gone already
            sock.close()
        self._peers.clear()

    def __enter__(self) -> "Rendezvous":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(goodbye=exc_type is None or not issubclass(exc_type, Exception))


class Watchdog:
    """Calls on_timeout(message) once if beat() is not called for `timeout` seconds, and each poll
    runs the checks (callables returning an error string or None) and calls on_timeout on the first error."""

    def __init__(self, timeout: float, on_timeout: Callable[[str], None],
                 checks: Iterable[Callable[[], str | None]] = (), poll: float = 1.0):
        self.timeout, self.on_timeout, self.checks, self.poll = timeout, on_timeout, tuple(checks), poll
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self._last_beat = time.monotonic()

    def start(self) -> "Watchdog":
        if self._thread is not None:
            raise RuntimeError("the watchdog was already started")
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            quiet = time.monotonic() - self._last_beat
            if quiet >= self.timeout:
                self.on_timeout(f"no progress for {quiet:.0f} s (the watchdog's limit is {self.timeout:g} s): "
                                "a rank may be stuck in a collective")
                return
            for check in self.checks:
                try:
                    error = check()
                except Exception as e:  # a failing check is itself a reason to stop
                    error = f"the watchdog's check {getattr(check, '__name__', check)!s} failed: {e}"
                if error:
                    self.on_timeout(error)
                    return


def abort(message: str, exit_code: int = 1) -> NoReturn:
    """Print 'error: <message>' as one line to stderr, flush, and end the process at once with os._exit:
    called from a watcher thread while the main thread may be blocked inside a CUDA call."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    line = "error: " + " ".join(message.splitlines()) + "\n"
    try:
        os.write(2, line.encode(errors="replace"))
    finally:
        os._exit(exit_code)
