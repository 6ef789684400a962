"""A timeline of a step's GPU work, so that what overlaps and what waits is seen, not guessed.

While recording, every call of the named launchers (llama.ops) is bracketed by CUDA events on the compute
stream, and every collective of a Communicator (llama/parallel/nccl.py) by events on its own stream. After
a synchronize, the spans are the events' times relative to the first one; `totals` sums them per label (the
per-kernel breakdown of scripts/bench_step.py), `alone` finds the communication no compute runs beside (what
scripts/bench_multi_gpu.py --trace prints) and `chrome_trace` writes them in the Trace Event Format that
chrome://tracing and Perfetto open: one process per rank, one thread per stream, microseconds.

    timeline = Timeline()
    with timeline.recording(ops, ["gemm", "flash_attention_forward"], comm=model.comm):
        model.train_step(...)
    runtime().synchronize()
    json.dump(timeline.chrome_trace(rank), open("trace.json", "w"))
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from .cuda import runtime

COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce")  # a Communicator's calls that launch work
STREAMS = {"compute": 0, "communication": 1}  # the trace's thread of each stream


@dataclass(frozen=True)
class Span:
    stream: str  # "compute" or "communication"
    label: str
    start_ms: float  # from the first recorded event
    end_ms: float


class Timeline:
    """Spans of launcher and collective calls, recorded with CUDA events. label(name, args, kwargs) names a call
    in the trace, by default the launcher's name; event() makes an event and compute_stream() gives the stream
    the launchers use (by default the driver's events and the runtime's stream)."""

    def __init__(self, label: Callable[[str, tuple, dict], str] | None = None, event: Callable | None = None,
                 compute_stream: Callable | None = None):
        self.label = label or (lambda name, args, kwargs: name)
        self.event, self.compute_stream = event, compute_stream
        self.calls = []  # (stream name, label, start event, end event), in launch order

    @contextlib.contextmanager
    def recording(self, module, names, comm=None):
        """Within the block, module.<name> for each name, and comm's collectives, record their spans; the
        originals come back at its end, also on an error."""
        event = self.event or runtime().drv.Event
        compute_stream = self.compute_stream or (lambda: runtime().stream)

        def launch_track() -> str:  # a launcher's: the communication stream's within Runtime.launching_on
            return "communication" if comm is not None and compute_stream() == comm.stream else "compute"

        targets = [(module, name, launch_track, compute_stream) for name in names]
        if comm is not None:
            targets += [(comm, name, lambda: "communication", lambda: comm.stream) for name in COLLECTIVES]
        originals = [(target, name, getattr(target, name)) for target, name, _, _ in targets]
        for target, name, stream_name, stream in targets:
            setattr(target, name, self._timed(name, getattr(target, name), stream_name, stream, event))
        try:
            yield self
        finally:
            for target, name, original in originals:
                setattr(target, name, original)

    def _timed(self, name: str, fn: Callable, track: Callable, stream: Callable, event: Callable) -> Callable:
        def timed(*args, **kwargs):
            start, end = event(), event()
            start.record(stream())
            result = fn(*args, **kwargs)
            end.record(stream())
            self.calls.append((track(), self.label(name, args, kwargs), start, end))
            return result
        return timed

    def spans(self) -> list[Span]:
        """The recorded calls as spans from the earliest start (read after the work has run), by start time."""
        if not self.calls:
            return []
        first = self.calls[0][2]
        starts = [start.time_since(first) for _, _, start, _ in self.calls]
        origin = min(starts)
        spans = [Span(stream, label, at - origin, end.time_since(first) - origin)
                 for (stream, label, _, end), at in zip(self.calls, starts)]
        return sorted(spans, key=lambda span: span.start_ms)

    def totals(self) -> dict[str, float]:
        """Milliseconds per label, summed over the calls, largest first."""
        sums = {}
        for span in self.spans():
            sums[span.label] = sums.get(span.label, 0.0) + span.end_ms - span.start_ms
        return dict(sorted(sums.items(), key=lambda item: -item[1]))

    def alone(self) -> list[tuple[Span, float, str]]:
        """Each communication span with the milliseconds of it during which the compute stream ran nothing
        recorded (communication in the open: the compute waits for it, or has nothing left to do), and the
        label of the compute span that starts next (what waited), for the spans with any such time."""
        spans = self.spans()
        compute = [span for span in spans if span.stream == "compute"]
        busy = []  # the union of the compute spans, as disjoint (start, end) in order
        for span in compute:
            if busy and span.start_ms <= busy[-1][1]:
                busy[-1] = (busy[-1][0], max(busy[-1][1], span.end_ms))
            else:
                busy.append((span.start_ms, span.end_ms))
        result = []
        for span in spans:
            if span.stream != "communication":
                continue
            covered = sum(max(0.0, min(end, span.end_ms) - max(start, span.start_ms)) for start, end in busy)
            if span.end_ms - span.start_ms - covered > 0:
                after = next((c.label for c in compute if c.start_ms >= span.end_ms), "the step's end")
                result.append((span, span.end_ms - span.start_ms - covered, after))
        return result

    def chrome_trace(self, rank: int = 0) -> dict:
        """The spans as a Trace Event Format object: complete events ("X") in microseconds, process = rank,
        thread = stream, with the names of both as metadata events."""
        events = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}]
        events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": f"{stream} stream"}}
                   for stream, tid in STREAMS.items()]
        events += [{"name": span.label, "cat": span.stream, "ph": "X", "pid": rank, "tid": STREAMS[span.stream],
                    "ts": round(span.start_ms * 1e3, 3), "dur": round((span.end_ms - span.start_ms) * 1e3, 3)}
                   for span in self.spans()]
        return {"traceEvents": events, "displayTimeUnit": "ms"}
