"""The ranks of a data-parallel job: reading the launcher's environment, meeting over TCP, noticing a
lost peer, and the watchdog. Rank 0 runs in the test process, the others as real processes."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from llama.parallel.distributed import DistributedEnv, DistributedError, Rendezvous, Watchdog
from tests.runs import REPO

# ---- from_environ ------------------------------------------------------------------------------


def test_single_process_when_no_launcher_set_anything():
    assert DistributedEnv.from_environ({"HOME": "/root"}) == DistributedEnv()
    assert DistributedEnv().is_main and DistributedEnv().world_size == 1


def test_torchrun_variables():
    env = DistributedEnv.from_environ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "host0",
                                       "MASTER_PORT": "1234"})
    assert env == DistributedEnv(rank=5, world_size=8, local_rank=1, master_addr="host0", master_port=1234)
    assert not env.is_main


def test_torchrun_with_one_rank_needs_no_local_rank_nor_master():
    assert DistributedEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1"}) == DistributedEnv()


def test_srun_variables_and_a_single_task_allocation():
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3", "MASTER_ADDR": "node7"}
    assert DistributedEnv.from_environ(slurm) == DistributedEnv(3, 4, 3, "node7", 29500)
    assert DistributedEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}) == \
        DistributedEnv()
    assert DistributedEnv.from_environ({"SLURM_PROCID": "0", "SLURM_JOB_ID": "17"}) == DistributedEnv()
    # inside an srun step the step's own task count wins over the allocation's
    step = {**slurm, "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "4"}
    assert DistributedEnv.from_environ(step).world_size == 4


def test_open_mpi_and_mpich_variables():
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "40000"}
    assert DistributedEnv.from_environ(ompi) == DistributedEnv(2, 4, 0, "10.0.0.1", 40000)
    mpich = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "h"}
    assert DistributedEnv.from_environ(mpich) == DistributedEnv(1, 2, 1, "h", 29500)


def test_torchrun_variables_win_over_slurm_and_slurm_over_mpi():
    both = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "a",
            "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
            "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert DistributedEnv.from_environ(both) == DistributedEnv(1, 2, 1, "a", 29500)
    del both["RANK"], both["WORLD_SIZE"], both["LOCAL_RANK"]
    both.update(SLURM_PROCID="2", SLURM_NTASKS="4", SLURM_LOCALID="2")
    assert DistributedEnv.from_environ(both) == DistributedEnv(2, 4, 2, "a", 29500)


@pytest.mark.parametrize("environ, names", [
    ({"RANK": "one", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, ["RANK", "'one'"]),
    ({"RANK": "0", "WORLD_SIZE": "2x", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, ["WORLD_SIZE", "'2x'"]),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, ["RANK=2", "WORLD_SIZE=2"]),
    ({"RANK": "-1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, ["RANK=-1"]),
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, ["WORLD_SIZE=0"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1", "MASTER_ADDR": "h"}, ["LOCAL_RANK=-1"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, ["LOCAL_RANK", "WORLD_SIZE=2"]),
    ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
    ({"WORLD_SIZE": "4"}, ["WORLD_SIZE", "RANK"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["MASTER_ADDR"]),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, ["MASTER_ADDR", "scontrol show hostnames"]),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, ["SLURM_LOCALID"]),
    ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, ["SLURM_PROCID", "'x'"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, ["OMPI_COMM_WORLD_SIZE"]),
    ({"PMI_RANK": "3", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "h"}, ["PMI_RANK=3"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     ["MASTER_PORT=70000"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "0"}, ["MASTER_PORT=0"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "http"},
     ["MASTER_PORT", "'http'"]),
])
def test_a_bad_launcher_environment_is_one_line_naming_the_variable(environ, names):
    with pytest.raises(DistributedError) as error:
        DistributedEnv.from_environ(environ)
    message = str(error.value)
    assert "\n" not in message
    for name in names:
        assert name in message


def test_from_environ_reads_os_environ_by_default(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_")) or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "h")
    monkeypatch.setenv("MASTER_PORT", "31000")
    assert DistributedEnv.from_environ() == DistributedEnv(1, 3, 1, "h", 31000)


# ---- Rendezvous --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(rank: int, world: int, port: int, mode: str = "broadcast") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.rendezvous_rank", str(rank), str(world), str(port), mode],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> str:
    """Close the rank's stdin (a watching rank then closes its Rendezvous), wait for it, return its stdout."""
    try:
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    return out


def rank0(world: int, port: int, timeout: float = 10.0) -> Rendezvous:
    return Rendezvous(DistributedEnv(0, world, 0, "127.0.0.1", port), timeout=timeout)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_rank_0s_bytes(world):
    port = free_port()
    others = [start_rank(rank, world, port) for rank in range(1, world)]  # they wait for rank 0 to listen
    nccl_id = os.urandom(128)
    with rank0(world, port) as rdv:
        assert rdv.broadcast(nccl_id) == nccl_id
    for proc in others:
        assert finish(proc) == nccl_id.hex() + "\n"
        assert proc.returncode == 0


def test_one_process_needs_no_network():
    with Rendezvous(DistributedEnv(), timeout=0.1) as rdv:
        assert rdv.broadcast(b"id") == b"id"
        rdv.watch(lambda message: pytest.fail(message))


@pytest.mark.slow
def test_a_rank_without_rank_0_gives_up_at_the_timeout_naming_the_address():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(DistributedError) as error:
        Rendezvous(DistributedEnv(1, 2, 1, "127.0.0.1", port), timeout=1.0)
    assert time.monotonic() - start < 5
    assert f"rank 1 could not reach rank 0 at 127.0.0.1:{port} within 1 s" in str(error.value)


@pytest.mark.slow
def test_rank_0_without_the_others_names_the_missing_ranks():
    port = free_port()
    with pytest.raises(DistributedError) as error:
        rank0(3, port, timeout=0.5)
    assert str(error.value) == f"rank 0 waited 0.5 s at 0.0.0.0:{port} for ranks 1, 2 to connect"
    rank1 = start_rank(1, 3, port)
    with pytest.raises(DistributedError) as error:
        rank0(3, port, timeout=2.0)
    assert str(error.value) == f"rank 0 waited 2 s at 0.0.0.0:{port} for rank 2 to connect"
    assert "error: rank 1: rank 0 at 127.0.0.1" in finish(rank1)  # rank 0 went away before its broadcast


def test_a_port_in_use_is_named():
    with socket.socket() as other_job:
        other_job.bind(("0.0.0.0", 0))
        other_job.listen()
        port = other_job.getsockname()[1]
        with pytest.raises(DistributedError, match=f"port {port} .*another job may hold it; choose another MASTER_"):
            rank0(2, port)


def test_rank_0_rejects_a_rank_of_another_world_size():
    port = free_port()
    stranger = start_rank(1, 3, port)
    with pytest.raises(DistributedError, match="rank 1 .* has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"):
        rank0(2, port)
    assert f"error: rank 0 at 127.0.0.1:{port} rejected rank 1: rank 1" in finish(stranger)
    assert stranger.returncode == 1


def test_rank_0_rejects_a_connection_that_is_not_a_rank():
    port = free_port()
    errors = []
    rank0_thread = threading.Thread(target=lambda: errors.append(pytest.raises(DistributedError, rank0, 2, port)))
    rank0_thread.start()
    deadline = time.monotonic() + 5
    while True:
        try:
            stranger = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    with stranger:
        stranger.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        rank0_thread.join(5)
        assert stranger.recv(100).startswith(b"R")
    assert "is not one of this job's ranks" in str(errors[0].value)


# ---- liveness ----------------------------------------------------------------------------------


def watched_rank0(world: int, port: int, mode: str):
    others = [start_rank(rank, world, port, mode) for rank in range(1, world)]
    rdv = rank0(world, port)
    nccl_id = rdv.broadcast(os.urandom(16))
    lost, fired = [], threading.Event()
    rdv.watch(lambda message: (lost.append(message), fired.set()))
    for proc in others:
        assert proc.stdout.readline() == nccl_id.hex() + "\n"
        assert proc.stdout.readline() == "watching\n"
    return rdv, others, lost, fired


def test_a_killed_rank_is_reported_once():
    rdv, (rank1, rank2), lost, fired = watched_rank0(3, free_port(), "watch")
    with rdv:
        rank1.send_signal(signal.SIGKILL)
        assert fired.wait(5)
        assert finish(rank2) == "lost: []\n"  # rank 2 still sees rank 0 alive
    finish(rank1)
    assert len(lost) == 1 and lost[0].startswith("rank 1 (127.0.0.1:") and "it has exited or crashed" in lost[0]


def test_rank_1_sees_rank_0_crash():
    port = free_port()
    rank1 = start_rank(1, 2, port, "watch")
    rdv = rank0(2, port)
    rdv.broadcast(b"id")
    assert rank1.stdout.readline() == b"id".hex() + "\n" and rank1.stdout.readline() == "watching\n"
    rdv.close(goodbye=False)  # what rank 0's sockets do when its process dies
    time.sleep(0.3)
    assert finish(rank1) == f"lost: ['rank 0 (127.0.0.1:{port}) closed its connection: it has exited or crashed']\n"


def test_ranks_that_close_cleanly_are_not_reported_in_either_direction():
    rdv, (rank1, rank2), lost, fired = watched_rank0(3, free_port(), "watch")
    assert finish(rank1) == "lost: []\n" and rank1.returncode == 0  # rank 1 closes before rank 0 ...
    time.sleep(0.3)  # (time for rank 0's watcher to see rank 1's goodbye and the end of its connection)
    rdv.close()       # ... and rank 0 before rank 2
    time.sleep(0.3)
    assert finish(rank2) == "lost: []\n" and rank2.returncode == 0
    assert lost == []


def test_an_exception_leaving_the_with_block_says_no_goodbye():
    rdv, (rank1,), lost, fired = watched_rank0(2, free_port(), "raise")
    with rdv:
        assert finish(rank1) == "lost: []\n" and rank1.returncode == 1
        assert fired.wait(5)
    assert len(lost) == 1 and lost[0].startswith("rank 1 ")


# ---- Watchdog ----------------------------------------------------------------------------------


def test_watchdog_fires_once_without_beats():
    fired = []
    with Watchdog(0.2, fired.append, poll=0.02):
        time.sleep(0.6)
    assert len(fired) == 1 and "no progress for" in fired[0]


def test_watchdog_stays_quiet_while_beaten():
    fired = []
    with Watchdog(0.3, fired.append, poll=0.02) as dog:
        for _ in range(20):
            time.sleep(0.03)
            dog.beat()
    assert fired == []


def test_watchdog_reports_a_failing_check():
    fired, calls = [], []

    def nccl_async_error():
        calls.append(1)
        return "NCCL: unhandled system error" if len(calls) >= 3 else None

    with Watchdog(60, fired.append, checks=[lambda: None, nccl_async_error], poll=0.02):
        time.sleep(0.3)
    assert fired == ["NCCL: unhandled system error"] and len(calls) == 3


def test_abort_from_a_thread_ends_the_process_while_the_main_thread_is_busy():
    program = ("import threading, time\n"
               "from llama.parallel.distributed import abort\n"
               "print('buffered', end='')\n"
               "threading.Thread(target=abort, args=('rank 1: lost\\nrank 0', 3)).start()\n"
               "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=20)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "buffered", "error: rank 1: lost rank 0\n")
