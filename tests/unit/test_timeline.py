"""llama/runtime/timeline.py without a GPU: launchers and collectives wrapped while recording (and restored after,
also on an error), spans and totals from the events' times, and the Chrome trace's format."""

import json
from types import SimpleNamespace

import pytest

from llama.runtime.timeline import Timeline

CLOCK = [0.0]  # milliseconds; a fake launcher's work advances it


class FakeEvent:
    """Records the fake clock's time; time_since as CUDA events' (milliseconds)."""

    def record(self, stream):
        self.at, self.stream = CLOCK[0], stream

    def time_since(self, other):
        return self.at - other.at


def working(ms, result=None):
    def launcher(*args, **kwargs):
        CLOCK[0] += ms
        return result
    return launcher


def fakes():
    CLOCK[0] = 5.0
    ops = SimpleNamespace(gemm=working(2.0, "c"), swiglu=working(0.5), other=working(1.0))
    comm = SimpleNamespace(stream="nccl", reduce_scatter=working(3.0), all_gather=working(1.5),
                           all_reduce=working(0.25))
    return ops, comm


def test_recorded_calls_become_spans_and_totals_and_the_originals_come_back():
    ops, comm = fakes()
    originals = (ops.gemm, ops.swiglu, ops.other, comm.reduce_scatter)
    timeline = Timeline(lambda name, args, kwargs: f"{name} {kwargs.get('layout', '')}".strip(), FakeEvent,
                        lambda: "compute")
    with timeline.recording(ops, ["gemm", "swiglu"], comm=comm):
        assert ops.gemm(layout="nt") == "c"  # results pass through
        ops.swiglu()
        CLOCK[0] += 10.0  # host time between launches
        ops.other()  # not recorded
        comm.reduce_scatter()
        ops.gemm(layout="tn")
    assert (ops.gemm, ops.swiglu, ops.other, comm.reduce_scatter) == originals
    spans = timeline.spans()
    assert [(s.stream, s.label, s.start_ms, s.end_ms) for s in spans] == [
        ("compute", "gemm nt", 0.0, 2.0), ("compute", "swiglu", 2.0, 2.5),
        ("communication", "reduce_scatter", 13.5, 16.5), ("compute", "gemm tn", 16.5, 18.5)]
    assert [event.stream for _, _, start, end in timeline.calls for event in (start, end)] == [
        "compute"] * 4 + ["nccl"] * 2 + ["compute"] * 2
    assert timeline.totals() == {"reduce_scatter": 3.0, "gemm nt": 2.0, "gemm tn": 2.0, "swiglu": 0.5}


def test_a_launcher_on_the_communication_stream_is_on_its_track():
    """Runtime.launching_on(comm.stream) sends a launcher's kernels (ZeRO's conversions and adds) to the
    communication stream: its span is there too."""
    ops, comm = fakes()
    current = ["compute"]
    timeline = Timeline(event=FakeEvent, compute_stream=lambda: current[0])
    with timeline.recording(ops, ["gemm", "swiglu"], comm=comm):
        ops.gemm()
        current[0] = comm.stream
        ops.swiglu()
    assert [(s.stream, s.label) for s in timeline.spans()] == [("compute", "gemm"), ("communication", "swiglu")]


def test_an_error_inside_the_block_restores_the_launchers():
    ops, _ = fakes()
    original = ops.gemm
    with pytest.raises(RuntimeError):
        with Timeline(event=FakeEvent, compute_stream=lambda: None).recording(ops, ["gemm"]):
            raise RuntimeError("a failing step")
    assert ops.gemm is original


def test_the_chrome_trace_has_a_process_per_rank_and_a_thread_per_stream_in_microseconds():
    ops, comm = fakes()
    timeline = Timeline(event=FakeEvent, compute_stream=lambda: "compute")
    with timeline.recording(ops, ["gemm"], comm=comm):
        ops.gemm()
        comm.all_gather()
    trace = json.loads(json.dumps(timeline.chrome_trace(rank=3)))  # plain JSON
    assert trace["displayTimeUnit"] == "ms"
    metadata = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {(e["name"], e["tid"], e["args"]["name"]) for e in metadata} == {
        ("process_name", 0, "rank 3"), ("thread_name", 0, "compute stream"), ("thread_name", 1, "communication stream")}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert complete == [
        {"name": "gemm", "cat": "compute", "ph": "X", "pid": 3, "tid": 0, "ts": 0.0, "dur": 2000.0},
        {"name": "all_gather", "cat": "communication", "ph": "X", "pid": 3, "tid": 1, "ts": 2000.0, "dur": 1500.0}]
    assert Timeline().chrome_trace()["traceEvents"][3:] == []  # nothing recorded: metadata only


def test_alone_is_the_communication_no_compute_runs_beside_and_names_what_ran_next():
    """Compute 0-4 and 3-6 (one busy stretch 0-6) and 9-10; a reduce-scatter 5-8 is open 6-8 (2 ms) before the
    compute at 9; an all-gather 1-2 is hidden whole; one at 9.5-12 is open 10-12 at the step's end."""
    from llama.runtime.timeline import Span
    timeline = Timeline()
    spans = [Span("compute", "gemm", 0.0, 4.0), Span("communication", "all_gather 8 MB", 1.0, 2.0),
             Span("compute", "swiglu", 3.0, 6.0), Span("communication", "reduce_scatter 64 MB", 5.0, 8.0),
             Span("compute", "adamw", 9.0, 10.0), Span("communication", "all_gather 8 MB", 9.5, 12.0)]
    timeline.spans = lambda: spans
    assert [(span.label, ms, after) for span, ms, after in timeline.alone()] == [
        ("reduce_scatter 64 MB", 2.0, "adamw"), ("all_gather 8 MB", 2.0, "the step's end")]
