"""Cut a trace into steps and give each step its GPU events and CPU ops.

A step is a CPU time range: a user annotation whose name matches the step pattern (default:
`decode_step…` or `k3.step…`), else a `ProfilerStep#N` range that `prof.step()` writes, else the
whole trace. GPU work runs after the CPU has moved on, so a GPU event belongs to the step in which
its *launch* happened (matched by correlation id), not the step its own timestamps fall in; every
kernel a single cudaGraphLaunch replays carries that launch's correlation id and so lands in the
launching step too.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from k3compile.report.trace import ANNOTATION, OP, Event, Trace, is_graph_launch

DEFAULT_STEP_PATTERN = r"^(decode_step|k3\.step)"
_PROFILER_STEP = re.compile(r"^ProfilerStep#\d+$")

# How the steps were found, reported so a reader knows what a "step" means in this report.
FROM_ANNOTATIONS = "annotations"
FROM_PROFILER_STEPS = "profiler_steps"
WHOLE_TRACE = "whole_trace"


@dataclass(frozen=True)
class Step:
    index: int
    name: str
    start: int  # ns, CPU clock
    end: int

    @property
    def dur(self) -> int:
        return self.end - self.start


@dataclass
class StepEvents:
    """What happened in one step: the GPU events it launched (kernels, memcpy, memset, in start
    order), how many of them were replayed from CUDA graphs, and its top-level CPU ops."""
    step: Step
    gpu: list[Event] = field(default_factory=list)
    graph_replayed: list[Event] = field(default_factory=list)
    launch_calls: int = 0    # distinct CPU API calls behind the GPU events
    graph_launches: int = 0  # of which cudaGraphLaunch
    cpu_ops: list[Event] = field(default_factory=list)


@dataclass
class Segmentation:
    source: str
    pattern: str
    steps: list[StepEvents]
    outside: list[Event]  # GPU events whose launch is in no step, or was not captured


def find_steps(trace: Trace, pattern: str = DEFAULT_STEP_PATTERN) -> tuple[list[Step], str]:
    regex = re.compile(pattern)
    ranges = trace.of_kind(ANNOTATION, OP)  # older torch wrote ProfilerStep#N as a cpu_op
    annotated = _outermost([e for e in ranges if e.kind == ANNOTATION and regex.search(e.name)])
    if annotated:
        return _as_steps(annotated), FROM_ANNOTATIONS
    profiler_steps = _outermost([e for e in ranges if _PROFILER_STEP.match(e.name)])
    if profiler_steps:
        return _as_steps(profiler_steps), FROM_PROFILER_STEPS
    if not trace.events:
        return [], WHOLE_TRACE
    start = min(e.ts for e in trace.events)
    end = max(e.end for e in trace.events)
    return [Step(0, "whole trace", start, end)], WHOLE_TRACE


def _as_steps(ranges: list[Event]) -> list[Step]:
    return [Step(i, e.name, e.ts, e.end) for i, e in enumerate(ranges)]


def _outermost(ranges: list[Event]) -> list[Event]:
    """Drop ranges nested in an earlier one (a `decode_step` inside another `decode_step…`)."""
    kept: list[Event] = []
    for e in sorted(ranges, key=lambda r: (r.ts, -r.dur)):
        if kept and e.end <= kept[-1].end:
            continue
        kept.append(e)
    return kept


def segment(trace: Trace, pattern: str = DEFAULT_STEP_PATTERN) -> Segmentation:
    steps, source = find_steps(trace, pattern)
    per_step = [StepEvents(step) for step in steps]
    starts = [s.start for s in steps]

    def step_at(ts: int) -> StepEvents | None:
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ts <= steps[i].end:
            return per_step[i]
        return None

    outside: list[Event] = []
    launches_seen: set[tuple[int, int]] = set()
    for ev in trace.gpu_events:
        launch = trace.launch_of(ev)
        if source == WHOLE_TRACE:
            target = per_step[0]
        else:
            target = step_at(launch.ts) if launch is not None else None
        if target is None:
            outside.append(ev)
            continue
        target.gpu.append(ev)
        if launch is None:
            continue
        if is_graph_launch(launch):
            target.graph_replayed.append(ev)
        key = (target.step.index, ev.correlation)
        if key not in launches_seen:
            launches_seen.add(key)
            target.launch_calls += 1
            target.graph_launches += is_graph_launch(launch)

    for op in _top_level_ops(trace):
        target = step_at(op.ts)
        if target is not None:
            target.cpu_ops.append(op)
    return Segmentation(source, pattern, per_step, outside)


def _top_level_ops(trace: Trace) -> list[Event]:
    """Torch ops not called from inside another op on the same thread (`aten::linear`, not the
    `aten::addmm` it calls), so that op times add up without counting anything twice."""
    top: list[Event] = []
    open_until: dict[tuple, int] = {}  # (pid, tid) → end of the enclosing top-level op
    for e in trace.events:
        if e.kind != OP or _PROFILER_STEP.match(e.name):
            continue
        thread = (e.pid, e.tid)
        if e.ts < open_until.get(thread, -1):
            continue
        open_until[thread] = e.end
        top.append(e)
    return top
