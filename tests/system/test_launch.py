"""python -m llama.launch: each rank's environment, stopping every rank when one fails, passing
signals on, and one-line errors for bad arguments. The ranks are tests/launch_child.py."""

import ctypes.util
import os
import signal
import subprocess
import sys

import pytest

from tests.runs import REPO, wait_for

CHILD = "tests/launch_child.py"
# the launcher starts nothing where NCCL does not load; the children here do not use it, and any library
# that loads stands in for it
NCCL_STAND_IN = {"LLAMA_NCCL_LIBRARY": ctypes.util.find_library("c")}


def launch(*args, env=None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llama.launch", *args], cwd=REPO,
                            env={**(os.environ if env is None else env), **NCCL_STAND_IN},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def finish(proc: subprocess.Popen, timeout: float = 20) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


def is_alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting for a reaper that is not the launcher counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_each_rank_gets_its_place_and_the_script_its_arguments(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NCCL_NVLS_ENABLE")}
    code, out, err = finish(launch("--nproc-per-node", "3", "--master-port", "31234", CHILD, "env", str(tmp_path),
                                   "--nproc-per-node", "7", "--grace=1", "-x", env=env))
    assert code == 0, err
    for rank in range(3):
        values = dict(line.split("=", 1) for line in (tmp_path / f"env{rank}").read_text().splitlines())
        assert values == {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3",
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "31234", "NCCL_NVLS_ENABLE": "0",
                          "ARGS": "--nproc-per-node 7 --grace=1 -x"}


def test_a_second_host_numbers_its_ranks_after_the_first(tmp_path):
    env = {**os.environ, "MASTER_PORT": "30000", "NCCL_NVLS_ENABLE": "0"}
    code, out, err = finish(launch("--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                   "host0", CHILD, "env", str(tmp_path), env=env))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env2", "env3"]
    values = dict(line.split("=", 1) for line in (tmp_path / "env3").read_text().splitlines())
    assert values["RANK"] == "3" and values["WORLD_SIZE"] == "4" and values["LOCAL_RANK"] == "1"
    assert values["MASTER_ADDR"] == "host0" and values["MASTER_PORT"] == "30000"


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path):
    code, out, err = finish(launch("--nproc-per-node", "2", CHILD, "fail", str(tmp_path)), timeout=15)
    assert code == 3
    assert err == "launch: rank 1 exited with code 3; stopping the other ranks\n"
    assert not is_alive(int((tmp_path / "pid0").read_text()))


@pytest.mark.slow
def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    code, out, err = finish(launch("--nproc-per-node", "2", "--grace", "0.5", CHILD, "fail", str(tmp_path), "stubborn"),
                            timeout=15)
    assert code == 3
    assert err.splitlines() == ["launch: rank 1 exited with code 3; stopping the other ranks",
                                "launch: rank 0 still running 0.5 s after SIGTERM; killing"]
    assert not is_alive(int((tmp_path / "pid0").read_text()))


def test_a_rank_killed_by_a_signal_gives_128_plus_its_number(tmp_path):
    launcher = launch("--nproc-per-node", "2", CHILD, "term", str(tmp_path))
    try:
        wait_for(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(), timeout=15)
        os.kill(int((tmp_path / "ready1").read_text()), signal.SIGKILL)
        code, out, err = finish(launcher)
    finally:
        launcher.kill()
    assert code == 128 + signal.SIGKILL
    assert err == "launch: rank 1 was killed by SIGKILL; stopping the other ranks\n"
    assert (tmp_path / "term0").read_text() == "SIGTERM\n"


def test_a_killed_rank_is_named_before_the_rank_that_failed_because_of_it(tmp_path):
    """Rank 1 killed, and rank 0 exiting on its peer's death, both before the launcher looks again (it is stopped
    meanwhile): the one line names rank 1 and its signal, the cause, not rank 0's error."""
    launcher = launch("--nproc-per-node", "2", CHILD, "peer", str(tmp_path))
    try:
        wait_for(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(), timeout=15)
        rank0 = int((tmp_path / "ready0").read_text())
        os.kill(launcher.pid, signal.SIGSTOP)
        os.kill(int((tmp_path / "ready1").read_text()), signal.SIGKILL)
        wait_for(lambda: not is_alive(rank0), timeout=15)
        os.kill(launcher.pid, signal.SIGCONT)
        code, out, err = finish(launcher)
    finally:
        launcher.kill()
    assert code == 128 + signal.SIGKILL
    assert err == "launch: rank 1 was killed by SIGKILL\n"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_reaches_every_rank_once(tmp_path, signum):
    launcher = launch("--nproc-per-node", "2", CHILD, "term", str(tmp_path))
    try:
        wait_for(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(), timeout=15)
        launcher.send_signal(signum)
        code, out, err = finish(launcher)
    finally:
        launcher.kill()
    assert code == 128 + signum and err == ""  # a stop everyone got is not a failure to report
    for rank in range(2):
        assert (tmp_path / f"term{rank}").read_text() == signal.Signals(signum).name + "\n"


def test_a_second_ctrl_c_is_passed_on_again(tmp_path):
    launcher = launch("--nproc-per-node", "2", CHILD, "term", str(tmp_path), "twice")
    terms = [tmp_path / "term0", tmp_path / "term1"]
    try:
        wait_for(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(), timeout=15)
        launcher.send_signal(signal.SIGINT)
        wait_for(lambda: all(t.exists() and t.read_text() == "SIGINT\n" for t in terms), timeout=10)
        launcher.send_signal(signal.SIGINT)
        code, out, err = finish(launcher)
    finally:
        launcher.kill()
    assert code == 130 and err == ""
    assert [t.read_text() for t in terms] == ["SIGINT\nSIGINT\n"] * 2


def test_the_ranks_get_sigterm_when_the_launcher_is_killed(tmp_path):
    launcher = launch("--nproc-per-node", "2", CHILD, "term", str(tmp_path))
    try:
        wait_for(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(), timeout=15)
        launcher.send_signal(signal.SIGKILL)
        pids = [int((tmp_path / f"ready{rank}").read_text()) for rank in range(2)]
        wait_for(lambda: not any(is_alive(pid) for pid in pids), timeout=10)
    finally:
        launcher.kill()
        for ready in tmp_path.glob("ready*"):  # orphans, where the test failed
            if is_alive(pid := int(ready.read_text())):
                os.kill(pid, signal.SIGKILL)
        launcher.communicate()
    assert [(tmp_path / f"term{rank}").read_text() for rank in range(2)] == ["SIGTERM\n"] * 2


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0", CHILD], "--nproc-per-node 0: must be at least 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", CHILD], "--node-rank 2: must be in 0..1"),
    (["--nnodes", "2", CHILD], "--master-addr is required with --nnodes 2"),
    (["--master-port", "65536", CHILD], "master port 65536 is not a TCP port"),
    (["--grace", "-1", CHILD], "--grace -1: must not be negative"),
    (["--nproc-per-node", "two", CHILD], "invalid int value: 'two'"),
    (["no_such_script.py", "--flag"], "no_such_script.py: no such file"),
    ([], "no script given"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    code, out, err = finish(launch(*args, env=env))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("launch: error: ") and message in err


def test_without_nccl_the_launcher_starts_nothing_and_says_so_in_one_line(tmp_path):
    """Issue 49: a traceback of NCCLError from rank 0, then rank 1's lost connection, exit code 1."""
    proc = subprocess.Popen([sys.executable, "-m", "llama.launch", "--nproc-per-node", "2", CHILD, "env", str(tmp_path)],
                            cwd=REPO, env={**os.environ, "LLAMA_NCCL_LIBRARY": str(tmp_path / "libnccl.so.2")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, out, err = finish(proc)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("launch: error: the ranks talk over NCCL, which cannot be loaded here") and \
        'install it with python3 -m pip install -e ".[cuda]"' in err
    assert list(tmp_path.iterdir()) == []  # no rank started
