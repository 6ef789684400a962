"""The background job runner of the checkpoint writer (llama/io/background.py): one job in flight,
results and failures handed back once, never lost."""

import threading

import pytest

from llama.io.background import BackgroundJob, report_if_slow


def test_a_job_runs_while_the_caller_goes_on_and_its_result_is_collected_once():
    release, job = threading.Event(), BackgroundJob("test")
    job.start(lambda: release.wait(10) and "written")
    assert job.busy and job.collect() is None  # not finished: nothing yet, and no waiting
    release.set()
    assert job.collect(wait=True) == "written" and not job.busy
    assert job.collect(wait=True) is None  # handed back once


def test_a_second_job_waits_for_the_first_so_that_at_most_one_runs():
    running, most, lock = [0], [0], threading.Lock()

    def work(value):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threading.Event().wait(0.02)
        with lock:
            running[0] -= 1
        return value

    job = BackgroundJob("test")
    assert job.start(lambda: work(1)) is None
    assert job.start(lambda: work(2)) == 1  # start() hands back what it waited for
    assert job.collect(wait=True) == 2 and most[0] == 1


def test_a_failed_job_raises_in_the_caller_and_the_next_job_does_not_start():
    job, started = BackgroundJob("test"), []

    def fail():
        raise OSError(28, "No space left on device")

    job.start(fail)
    with pytest.raises(OSError, match="No space left"):
        job.start(lambda: started.append(1))
    assert started == [] and job.collect(wait=True) is None  # reported once, and nothing runs


def test_slow_io_says_how_long_it_took(capsys, monkeypatch):
    import llama.io.background as background
    with report_if_slow("reading x", 10**9):
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(background, "SLOW", -1.0)
    with report_if_slow("reading x", 2 * 10**9):
        pass
    err = capsys.readouterr().err
    assert err.startswith("reading x: 2.00 GB in 0.0 s (") and err.endswith(" GB/s)\n")
