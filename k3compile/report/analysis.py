"""The numbers of the trace report, one function per question, over the events of a step.

Results are plain dataclasses (times in microseconds) so that the text renderer and `--json`
print the same numbers. `analyze` also runs attribution, roofline and the critical path (their own
modules) on the same trace model (`trace.py`) and step segmentation (`steps.py`).
"""
from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from k3compile.report.attribution import attribute
from k3compile.report.categories import CATEGORIES, classify
from k3compile.report.critical_path import CLASSES, CriticalPath, critical_path
from k3compile.report.occupancy import LaunchShape, launch_shapes
from k3compile.report.roofline import RooflineReport, analyze_roofline
from k3compile.report.steps import DEFAULT_STEP_PATTERN, Segmentation, StepEvents, segment
from k3compile.report.trace import KERNEL, MEMCPY, MEMSET, Event, Trace, exclusive_ns, is_graph_launch


def _us(ns: int | float) -> float:
    return round(ns / 1000, 3)


@dataclass
class CategoryStats:
    count: int = 0
    time_us: float = 0.0


@dataclass
class StreamGaps:
    """Idle time on one stream between consecutive GPU events of one step."""
    device: int
    stream: int
    events: int
    count: int         # gaps longer than zero
    total_us: float
    largest_us: float


@dataclass
class StepReport:
    index: int
    name: str
    cpu_dur_us: float
    kernels: int              # GPU kernels, including those replayed from CUDA graphs
    memcpy: int
    memset: int
    graph_replayed: int       # kernels launched by a cudaGraphLaunch
    launch_calls: int         # CPU API calls that enqueued this step's GPU work
    graph_launches: int
    by_category: dict[str, CategoryStats]   # GPU events (kernels + copies) per category
    gpu_time_us: float        # sum of GPU event durations (streams may overlap)
    gpu_span_us: float        # first GPU event start → last GPU event end
    gpu_busy_us: float        # union of GPU event intervals (per device, summed)
    busy_fraction: float | None  # busy / span; None for a step with no GPU work
    gaps: list[StreamGaps]
    gap_total_us: float
    gap_count: int
    gap_largest_us: float
    cpu_ops: int              # top-level torch ops
    cpu_ops_by_category: dict[str, CategoryStats]


@dataclass
class NameStats:
    name: str
    category: str
    count: int
    total_us: float
    mean_us: float
    share: float  # of the total over all steps
    # the part of each event after the end of the one before it on its stream, summed: what the name adds to the step.
    # Under programmatic dependent launch a kernel starts (and sits in gdc_wait) while its predecessor runs, so its
    # duration overlaps the predecessor's; the exclusive times of one stream's events sum to its busy span.
    exclusive_us: float = 0.0
    exclusive_mean_us: float = 0.0


@dataclass
class LaunchingOpStats:
    """GPU work per step (means over steps) grouped by the top-level CPU op whose call enqueued it: in an
    eager trace this says which op's internals (a `k3::` custom op, an `aten::to`) cost the kernels."""
    op: str
    kernels: float     # GPU events (kernels, copies, memsets) per step
    copies: float      # of which category "copy"
    gpu_us: float      # their GPU time per step
    share: float       # of all steps' GPU time


GRAPH_REPLAY = "(CUDA graph replay)"
NO_OP = "(launched outside any op)"


@dataclass
class Report:
    path: str
    devices: dict[int, str]
    step_source: str
    step_pattern: str
    has_gpu_events: bool
    steps: list[StepReport]
    mean: dict                      # per-step means of the headline numbers
    outside_steps: int              # GPU events launched outside every step
    top_kernels: list[NameStats]    # over all steps' GPU events
    top_cpu_ops: list[NameStats]    # over all steps' top-level CPU ops
    launching_ops: list[LaunchingOpStats] = field(default_factory=list)  # by GPU time, top N
    categories: tuple[str, ...] = field(default=CATEGORIES)
    attribution_runs: list[dict] = field(default_factory=list)  # label, kernels, nodes of each reference
    roofline: RooflineReport | None = None       # None for CPU-only traces
    critical_paths: list[CriticalPath] = field(default_factory=list)
    critical_path_mean: dict[str, float] = field(default_factory=dict)  # class -> us, and "total"
    kernels_per_step: dict[str, float] = field(default_factory=dict)  # GPU event name -> count per step (--diff)
    launch_shapes: list[LaunchShape] = field(default_factory=list)  # grid vs the GPU's residency, top N by time


def by_category(events: list[Event]) -> dict[str, CategoryStats]:
    counts = dict.fromkeys(CATEGORIES, 0)
    ns = dict.fromkeys(CATEGORIES, 0)
    for e in events:
        c = classify(e.name)
        counts[c] += 1
        ns[c] += e.dur
    return {c: CategoryStats(counts[c], _us(ns[c])) for c in CATEGORIES}


def launch_gaps(events: list[Event]) -> list[StreamGaps]:
    """Per stream: the idle intervals between one GPU event's end and the next one's start."""
    per_stream: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in events:
        per_stream[(e.device, e.stream)].append(e)
    result = []
    for (device, stream), evs in sorted(per_stream.items()):
        evs.sort(key=lambda e: e.ts)
        gaps = []
        busy_until = evs[0].end
        for e in evs[1:]:
            if e.ts > busy_until:
                gaps.append(e.ts - busy_until)
            busy_until = max(busy_until, e.end)
        result.append(StreamGaps(device, stream, len(evs), len(gaps), _us(sum(gaps)),
                                 _us(max(gaps, default=0))))
    return result


def busy_time(events: list[Event]) -> int:
    """ns during which at least one GPU event runs, per device, summed over devices."""
    per_device: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        per_device[e.device].append(e)
    busy = 0
    for evs in per_device.values():
        evs.sort(key=lambda e: e.ts)
        start, end = evs[0].ts, evs[0].end
        for e in evs[1:]:
            if e.ts > end:
                busy += end - start
                start, end = e.ts, e.end
            else:
                end = max(end, e.end)
        busy += end - start
    return busy


def step_report(se: StepEvents) -> StepReport:
    gpu = se.gpu
    gaps = launch_gaps(gpu)
    span = (max(e.end for e in gpu) - min(e.ts for e in gpu)) if gpu else 0
    busy = busy_time(gpu) if gpu else 0
    devices = len({e.device for e in gpu})
    return StepReport(
        index=se.step.index, name=se.step.name, cpu_dur_us=_us(se.step.dur),
        kernels=sum(e.kind == KERNEL for e in gpu),
        memcpy=sum(e.kind == MEMCPY for e in gpu),
        memset=sum(e.kind == MEMSET for e in gpu),
        graph_replayed=sum(e.kind == KERNEL for e in se.graph_replayed),
        launch_calls=se.launch_calls, graph_launches=se.graph_launches,
        by_category=by_category(gpu),
        gpu_time_us=_us(sum(e.dur for e in gpu)),
        gpu_span_us=_us(span), gpu_busy_us=_us(busy),
        # With several devices the busy time is summed over them, so divide by span × devices.
        busy_fraction=round(busy / (span * devices), 4) if span else None,
        gaps=gaps,
        gap_total_us=round(sum(g.total_us for g in gaps), 3),
        gap_count=sum(g.count for g in gaps),
        gap_largest_us=max((g.largest_us for g in gaps), default=0.0),
        cpu_ops=len(se.cpu_ops), cpu_ops_by_category=by_category(se.cpu_ops),
    )


def top_by_total(events: list[Event], n: int) -> list[NameStats]:
    """Names ranked by summed duration (ties: more calls first, then name), with their exclusive time."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    excl = exclusive_ns(events)
    for e in events:
        t = totals[e.name]
        t[0] += 1
        t[1] += e.dur
        t[2] += excl[id(e)]
    grand = sum(t[1] for t in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
    return [NameStats(name, classify(name), count, _us(total), _us(total / count),
                      round(total / grand, 4) if grand else 0.0, _us(ex), _us(ex / count))
            for name, (count, total, ex) in ranked[:n]]


def by_launching_op(trace: Trace, seg: Segmentation, n: int) -> list[LaunchingOpStats]:
    """Each step's GPU events grouped by the top-level op (same thread) around their launch call;
    graph replays and launches outside every op get their own rows."""
    starts: dict[tuple, list[int]] = defaultdict(list)
    ops: dict[tuple, list[Event]] = defaultdict(list)
    for se in seg.steps:
        for op in se.cpu_ops:
            ops[(op.pid, op.tid)].append(op)
    for thread, evs in ops.items():
        evs.sort(key=lambda e: e.ts)
        starts[thread] = [e.ts for e in evs]
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # events, copies, ns
    for se in seg.steps:
        for ev in se.gpu:
            launch = trace.launch_of(ev)
            name = NO_OP
            if launch is not None and is_graph_launch(launch):
                name = GRAPH_REPLAY
            elif launch is not None:
                thread = (launch.pid, launch.tid)
                i = bisect.bisect_right(starts[thread], launch.ts) - 1
                if i >= 0 and launch.ts <= ops[thread][i].end:
                    name = ops[thread][i].name
            t = totals[name]
            t[0] += 1
            t[1] += classify(ev.name) == "copy"
            t[2] += ev.dur
    steps, grand = max(len(seg.steps), 1), sum(t[2] for t in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][2], -kv[1][0], kv[0]))
    return [LaunchingOpStats(name, round(k / steps, 3), round(c / steps, 3), _us(ns / steps),
                             round(ns / grand, 4) if grand else 0.0) for name, (k, c, ns) in ranked[:n]]


def _means(steps: list[StepReport]) -> dict:
    if not steps:
        return {}
    keys = ("kernels", "memcpy", "memset", "graph_replayed", "launch_calls", "gpu_time_us",
            "gpu_busy_us", "gap_total_us", "gap_count", "cpu_dur_us", "cpu_ops")
    means = {k: round(statistics.fmean(getattr(s, k) for s in steps), 3) for k in keys}
    fractions = [s.busy_fraction for s in steps if s.busy_fraction is not None]
    means["busy_fraction"] = round(statistics.fmean(fractions), 4) if fractions else None
    means["by_category"] = {
        c: CategoryStats(round(statistics.fmean(s.by_category[c].count for s in steps), 3),
                         round(statistics.fmean(s.by_category[c].time_us for s in steps), 3))
        for c in CATEGORIES}
    return means


def analyze(trace: Trace, step_pattern: str = DEFAULT_STEP_PATTERN, top: int = 15) -> Report:
    seg: Segmentation = segment(trace, step_pattern)
    steps = [step_report(se) for se in seg.steps]
    roofline, paths, refs = None, [], []
    if trace.gpu_events and seg.steps:
        attr, refs = attribute(trace, seg)
        roofline = analyze_roofline(trace, [se.gpu for se in seg.steps], attr)
        bound = {r.node: r.bound for r in roofline.rows}

        def describe(ev):
            a = attr.get(ev)
            node = a.node.name if a is not None and a.node is not None else None
            return bound.get(node), node
        paths = [p for se in seg.steps if (p := critical_path(trace, se, describe)) is not None]
    cp_mean = {}
    if paths:
        cp_mean = {c: round(statistics.fmean(p.by_class[c] for p in paths), 3) for c in CLASSES}
        cp_mean["total"] = round(statistics.fmean(p.total_us for p in paths), 3)
    return Report(
        path=trace.path, devices=trace.device_names, step_source=seg.source,
        step_pattern=step_pattern, has_gpu_events=bool(trace.gpu_events), steps=steps,
        mean=_means(steps), outside_steps=len(seg.outside),
        top_kernels=top_by_total([e for se in seg.steps for e in se.gpu], top),
        top_cpu_ops=top_by_total([e for se in seg.steps for e in se.cpu_ops], top),
        launching_ops=by_launching_op(trace, seg, top),
        attribution_runs=[{"label": r.label, "range": r.range_name, "kernels": len(r.kernels),
                           "nodes": len(r.nodes)} for r in refs],
        roofline=roofline, critical_paths=paths, critical_path_mean=cp_mean,
        kernels_per_step=_names_per_step(seg),
        launch_shapes=launch_shapes([e for se in seg.steps for e in se.gpu], trace.metadata)[:top],
    )


def _names_per_step(seg: Segmentation) -> dict[str, float]:
    counts: dict[str, int] = defaultdict(int)
    for se in seg.steps:
        for e in se.gpu:
            counts[e.name] += 1
    n = max(len(seg.steps), 1)
    return {k: round(v / n, 3) for k, v in sorted(counts.items())}
