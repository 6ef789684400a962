"""Data parallelism on 2 GPUs (device kind nvidia-h200-x2): NCCL collectives, the initial weights drawn on each GPU,
ZeRO training (stages 1-3) against one GPU at the same global batch, checkpoints across GPU counts, determinism, and
faults.

The trainer runs as it does for users: `python -m llama.launch --nproc-per-node 2 train_llama.py ...`
(or, for the fault tests, two processes given torchrun's environment by hand)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llama.run import trainer
from llama.io.checkpoint import load_checkpoint
from tests.gpu_helpers import gpu_count
from tests.runs import BASE, REPO, log_lines, losses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")]

FP32 = [*BASE, "-x", "20", "-n", "10", "-nk", "0", "--dtype", "fp32", "--device", "cuda"]  # tiny, fp32
BF16 = [*BASE, "-e", "d6", "-t", "64", "-l", "6e-4", "-x", "20", "-n", "10", "-nk", "0", "--device", "cuda"]  # d6, bf16
ENDLESS = [*BASE, "-x", "100000", "-n", "0", "--device", "cuda", "--dtype", "fp32"]  # until stopped


def environment(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               NCCL_NVLS_ENABLE="0")
    return env | {k: str(v) for k, v in extra.items()}


def train(gpus: int, *args, check=True) -> subprocess.CompletedProcess:
    """train_llama.py on `gpus` GPUs (through llama.launch when more than one)."""
    launch = [sys.executable, "-m", "llama.launch", "--nproc-per-node", str(gpus)] if gpus > 1 else [sys.executable]
    result = subprocess.run([*launch, str(REPO / "train_llama.py"), *args], env=environment(), capture_output=True,
                            text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def relative(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def same_bits(a: Path, b: Path) -> None:
    x, y = load_checkpoint(a), load_checkpoint(b)
    for key in ("params", "adam_m", "adam_v"):
        assert np.array_equal(x[key], y[key]), key


def worker(*args) -> str:
    """tests/multi_gpu_worker.py on 2 GPUs (through llama.launch); its output."""
    result = subprocess.run([sys.executable, "-m", "llama.launch", "--nproc-per-node", "2",
                             str(REPO / "tests" / "multi_gpu_worker.py"), *args], env=environment(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_collectives_and_shards():
    out = worker()
    assert "rank 0: collectives ok" in out and "rank 1: collectives ok" in out


def test_each_gpu_draws_its_shard_of_the_initial_weights():
    """Models built without params on 2 GPUs, at ZeRO stages 1-3 (bf16 with fp32 and 8-bit moments, fp32): each
    rank's master shard, padding included, and the weights the forward reads hold the bits of the same model built
    from init_parameters (tests/multi_gpu_worker.py device_init_matches_host_init)."""
    out = worker("init")
    for rank in (0, 1):
        assert all(f"rank {rank}: device init at ZeRO-{stage} ok" in out for stage in (1, 2, 3))
        assert f"rank {rank}: init ok" in out


@pytest.mark.parametrize("dtype, args, T, tol", [("fp32", FP32, 32, 1e-5), ("bf16", BF16, 64, 1e-2)], ids=["fp32", "bf16"])
def test_two_gpus_match_one_and_checkpoints_move_across_gpu_counts(corpus, tmp_path, dtype, args, T, tol):
    """20 steps at 8 sequences a step: one GPU with B=8 against two with B=4 each; resume 2->1, 1->2
    and 2->2 from step 10; a second identical 2-GPU run."""
    one, two = [*args, *corpus, "-b", "8"], [*args, *corpus, "-b", "4"]
    train(1, *one, "-o", "one")
    result = train(2, *two, "-o", "two", "-s", "10", "-g", "8")  # and a sample from gathered weights
    assert "x 2 GPUs (ZeRO-1 over NCCL)" in result.stdout and "--- sample at step 10 ---" in result.stdout
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 20
    train(1, *args, *corpus, "-b", "4", "-d", str(8 * T), "-o", "one_accumulated")  # control: 2 micro-batches on 1 GPU
    print(f"\n{dtype}: worst relative |2 GPUs - 1 GPU| train loss over 20 steps {relative(b, a):.2e}, "
          f"val {relative(losses(tmp_path / 'two', 'tel'), losses(tmp_path / 'one', 'tel')):.2e}; "
          f"1 GPU in 2 micro-batches: {relative(losses(tmp_path / 'one_accumulated'), a):.2e}\n1 GPU  {a}\n2 GPUs {b}")
    assert relative(b, a) < tol
    assert relative(losses(tmp_path / "two", "tel"), losses(tmp_path / "one", "tel")) < tol

    train(2, *two, "-o", "two_again")  # determinism: the same bits
    same_bits(tmp_path / "two" / "ckpt_00000020", tmp_path / "two_again" / "ckpt_00000020")
    assert log_lines(tmp_path / "two") == log_lines(tmp_path / "two_again")

    for name, gpus, source, batch in (("two_from_two", 2, "two", "4"), ("one_from_two", 1, "two", "8"),
                                      ("two_from_one", 2, "one", "4")):
        (tmp_path / name).mkdir()
        os.symlink(tmp_path / source / "ckpt_00000010", tmp_path / name / "ckpt_00000010")
        train(gpus, *args, *corpus, "-b", batch, "-o", name, "--resume")
        resumed, reference = log_lines(tmp_path / name), log_lines(tmp_path / source)
        assert sorted(resumed) == list(range(10, 20))
        if gpus == 2 and source == "two":  # the same GPU count: bit for bit
            assert all(resumed[s] == reference[s] for s in resumed)
            same_bits(tmp_path / name / "ckpt_00000020", tmp_path / source / "ckpt_00000020")
        else:
            assert relative(losses(tmp_path / name), losses(tmp_path / source)[10:]) < tol


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("dtype, args, T, tol", [("fp32", FP32, 32, 1e-5), ("bf16", BF16, 64, 1e-2)], ids=["fp32", "bf16"])
def test_zero_stages_match_one_gpu_and_resume_across_stages(corpus, tmp_path, stage, dtype, args, T, tol):
    """ZeRO-2 and 3 on two GPUs against one GPU at 8 sequences a step, 20 steps: B=4 each, and B=2 each in two
    micro-batches (the later one's reduction adds to the shard); resume from step 10 2->1, 1->2 and from this
    stage to stage 1."""
    one, two = [*args, *corpus, "-b", "8"], [*args, *corpus, "-b", "4", "--zero", str(stage)]
    train(1, *one, "-o", "one")
    result = train(2, *two, "-o", "two")
    assert f"x 2 GPUs (ZeRO-{stage} over NCCL)" in result.stdout and f"| ZeRO-{stage}" in result.stdout  # the plan
    train(2, *args, *corpus, "-b", "2", "-d", str(8 * T), "--zero", str(stage), "-o", "two_accumulated")
    reference = losses(tmp_path / "one")
    print(f"\n{dtype} ZeRO-{stage}: worst relative |2 GPUs - 1 GPU| train loss {relative(losses(tmp_path / 'two'), reference):.2e}"
          f", in two micro-batches {relative(losses(tmp_path / 'two_accumulated'), reference):.2e}")
    for run in ("two", "two_accumulated"):
        assert len(losses(tmp_path / run)) == 20
        assert relative(losses(tmp_path / run), reference) < tol
    assert relative(losses(tmp_path / "two", "tel"), losses(tmp_path / "one", "tel")) < tol  # (B=2 evaluates others)
    if dtype == "bf16" and stage == 2:  # the gradients reduce-scattered in bf16
        result = train(2, *two, "--reduce-dtype", "bf16", "-o", "two_bf16_reduce")
        assert "bf16 reduce-scatter" in result.stdout
        rounded = losses(tmp_path / "two_bf16_reduce")
        print(f"bf16 reduce-scatter: worst relative |2 GPUs - 1 GPU| train loss {relative(rounded, reference):.2e}, "
              f"last loss {rounded[-1]:.6f} against {reference[-1]:.6f} (fp32 reduce-scatter "
              f"{losses(tmp_path / 'two')[-1]:.6f})")
        assert relative(rounded, reference) < tol
    for name, gpus, source, options in (("one_from_two", 1, "two", ["-b", "8"]),
                                        ("two_from_one", 2, "one", ["-b", "4", "--zero", str(stage)]),
                                        ("stage_1_from_two", 2, "two", ["-b", "4", "--zero", "1"])):
        (tmp_path / name).mkdir()
        os.symlink(tmp_path / source / "ckpt_00000010", tmp_path / name / "ckpt_00000010")
        train(gpus, *args, *corpus, *options, "-o", name, "--resume")
        assert sorted(log_lines(tmp_path / name)) == list(range(10, 20))
        assert relative(losses(tmp_path / name), losses(tmp_path / source)[10:]) < tol, name


@pytest.mark.parametrize("stage", [1, 3])
def test_8bit_moments_on_two_gpus_match_one_and_resume_bit_for_bit(corpus, tmp_path, stage):
    """--optimizer adamw8bit under ZeRO (each rank's shard of whole 256-value blocks: the blocks are the padded
    buffer's, not one GPU's): 20 steps of d6 against one GPU's 8-bit run within the bf16 tolerance; the 2-GPU run
    resumed from step 10 gives the same log lines and checkpoint bits; one GPU resumes it."""
    eight = [*BF16, *corpus, "--optimizer", "adamw8bit"]
    train(1, *eight, "-b", "8", "-o", "one")
    result = train(2, *eight, "-b", "4", "--zero", str(stage), "-o", "two")
    assert f"x 2 GPUs (ZeRO-{stage} over NCCL)" in result.stdout and "adamw8bit" in result.stdout
    reference = losses(tmp_path / "one")
    print(f"\n8-bit moments at ZeRO-{stage}: worst relative |2 GPUs - 1 GPU| train loss "
          f"{relative(losses(tmp_path / 'two'), reference):.2e}")
    assert len(losses(tmp_path / "two")) == 20 and relative(losses(tmp_path / "two"), reference) < 1e-2
    for name, gpus, batch in (("two_from_two", 2, "4"), ("one_from_two", 1, "8")):
        (tmp_path / name).mkdir()
        os.symlink(tmp_path / "two" / "ckpt_00000010", tmp_path / name / "ckpt_00000010")
        train(gpus, *eight, "-b", batch, "--zero", str(stage) if gpus > 1 else "1", "-o", name, "--resume")
        assert sorted(log_lines(tmp_path / name)) == list(range(10, 20))
    resumed, uninterrupted = log_lines(tmp_path / "two_from_two"), log_lines(tmp_path / "two")
    assert all(resumed[s] == uninterrupted[s] for s in resumed)
    same_bits(tmp_path / "two_from_two" / "ckpt_00000020", tmp_path / "two" / "ckpt_00000020")
    assert relative(losses(tmp_path / "one_from_two"), losses(tmp_path / "two")[10:]) < 1e-2


def start_rank(rank: int, port: int, out: Path, *args) -> subprocess.Popen:
    """One rank of a 2-GPU run with the environment torchrun would give it."""
    env = environment(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return subprocess.Popen([sys.executable, str(REPO / "train_llama.py"), *args, "-o", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_steps(out: Path, steps: int, ranks, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not ((out / "main.log").exists() and len(log_lines(out)) >= steps):
        assert time.time() < deadline and all(r.poll() is None for r in ranks), "the run did not start"
        time.sleep(0.2)


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_lost_rank_ends_the_job_with_a_clear_error(corpus, tmp_path, fault):
    """Rank 1 is killed (its sockets close: rank 0 stops at once) or frozen with SIGSTOP (nothing
    closes: rank 0's watchdog stops it after --dist-timeout)."""
    train(1, *ENDLESS, *corpus, "-x", "1", "-o", "warm")  # the kernels are compiled: the first step is quick
    port, out = free_port(), tmp_path / "run"
    args = [*ENDLESS, "--dist-timeout", "20", *corpus]
    ranks = [start_rank(r, port, out, *args) for r in range(2)]
    try:
        wait_for_steps(out, 3, ranks)
        ranks[1].send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        lost = time.time()
        _, err = ranks[0].communicate(timeout=120)
        waited = time.time() - lost
    finally:
        for r in ranks:
            r.kill()
            r.wait()
    print(f"\n{fault}: rank 0 stopped {waited:.1f} s after rank 1 was {fault}: {err.strip().splitlines()[-1]}")
    assert ranks[0].returncode not in (0, None)
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 0: ")
    if fault == "killed":
        assert "rank 1" in last and waited < 20
    else:
        assert "20" in last and waited < 60


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The process id of the launcher's child with RANK=rank (from /proc)."""
    for pid in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return int(pid)
    raise AssertionError(f"the launcher has no rank {rank}")


def test_a_rank_killed_under_the_launcher_leaves_a_checkpoint_that_resumes_bit_for_bit(corpus, tmp_path):
    """As a user runs it: kill -9 on rank 1 of `llama.launch --nproc-per-node 2` ends the job within seconds, with
    at most one line from the launcher and one from rank 0, each naming rank 1, and no traceback; the newest
    complete checkpoint loads, resumes on 2 GPUs with the bits of an uninterrupted run (the same steps and
    weights, moments) and on 1 GPU to 1e-5. A constant learning rate makes the step count -x change nothing."""
    args = [*BASE, "--device", "cuda", "--dtype", "fp32", "-k", "constant", "-nk", "0", *corpus]
    train(1, *args, "-x", "1", "-o", "warm")  # the kernels are compiled: the steps are quick
    out = tmp_path / "killed"
    launcher = subprocess.Popen([sys.executable, "-m", "llama.launch", "--nproc-per-node", "2",
                                 str(REPO / "train_llama.py"), *args, "-x", "100000", "-n", "5", "-o", str(out)],
                                env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(out, 12, [launcher])
        os.kill(rank_pid(launcher, 1), signal.SIGKILL)
        killed = time.time()
        _, err = launcher.communicate(timeout=120)
        waited = time.time() - killed
    finally:
        launcher.kill()
        launcher.wait()
    reports = [line for line in err.splitlines() if line.startswith(("error:", "launch:"))]
    print(f"\nkill -9 on rank 1: the job ended {waited:.1f} s later, exit code {launcher.returncode}:\n" + "\n".join(reports))
    assert launcher.returncode not in (0, None) and waited < 20
    assert "Traceback" not in err and 1 <= len(reports) <= 2 and all("rank 1" in line for line in reports), err[-3000:]
    saved = trainer.find_resume_checkpoint(out)
    assert saved is not None, "no complete checkpoint after the kill"
    done = saved["state"]["step"]
    assert done >= 5 and done % 5 == 0 and Path(saved["path"]).name == f"ckpt_{done:08d}"
    steps = done + 5
    train(2, *args, "-x", str(steps), "-n", "5", "-b", "4", "-o", "uninterrupted")
    reference = log_lines(tmp_path / "uninterrupted")
    killed_lines = log_lines(out)
    assert all(killed_lines[s] == reference[s] for s in range(done))  # -x changed nothing before the kill
    checkpoint = out / f"ckpt_{done:08d}"
    for name, gpus, batch in (("two", 2, "4"), ("one", 1, "8")):
        (tmp_path / name).mkdir()
        os.symlink(checkpoint, tmp_path / name / checkpoint.name)
        train(gpus, *args, "-x", str(steps), "-b", batch, "-o", name, "--resume")
        resumed = log_lines(tmp_path / name)
        assert sorted(resumed) == list(range(done, steps)), name
    assert all(log_lines(tmp_path / "two")[s] == reference[s] for s in range(done, steps))
    same_bits(tmp_path / "two" / f"ckpt_{steps:08d}", tmp_path / "uninterrupted" / f"ckpt_{steps:08d}")
    assert relative(losses(tmp_path / "one"), losses(tmp_path / "uninterrupted")[done:]) < 1e-5


def test_sigterm_to_the_launcher_checkpoints_on_every_gpu_count_and_resumes(corpus, tmp_path):
    """SIGTERM to llama.launch reaches both ranks; they stop at the same step and rank 0 writes a
    checkpoint that a 1-GPU run resumes."""
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "llama.launch", "--nproc-per-node", "2",
                                 str(REPO / "train_llama.py"), *ENDLESS, *corpus, "-o", str(out)], env=environment(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(out, 3, [launcher])
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 143, err[-2000:]
    saved = sorted(out.glob("ckpt_*"))
    assert len(saved) == 1
    done = int(saved[0].name.split("_")[1])
    assert sorted(log_lines(out))[-1] == done - 1
    state = load_checkpoint(saved[0])
    assert state["state"]["run"]["world_size"] == 2
    train(1, *ENDLESS, "-x", str(done + 2), *corpus, "-b", "8", "-o", str(out), "--resume")
    assert sorted(log_lines(out))[-1] == done + 1
