"""The critical path of a step: the chain of waits that set when its last GPU event finished.

Walk back from the GPU event that ends last. At each kernel, of the things it could have waited
for, the one that became ready last is what it waited for:
  * the previous event on its stream (its end; with programmatic dependent launch (PDL) the
    kernel starts while that one still runs, and only the part after it ends is on the path),
  * its launch call on the CPU (the call's end; for a CUDA-graph replay, the cudaGraphLaunch),
  * work on another stream that ended after both and before the kernel started (a cross-stream
    event wait, which graph replays do not show us otherwise).
Time between that ready point and the kernel's start is a launch gap. When the launch was the
last to be ready, the path goes to the CPU: the CPU-bound stretch runs back from the launch call
to the end of the last blocking synchronization on that thread (then to the GPU event that sync
waited for), or to the step's start.

Edge kinds follow HolisticTraceAnalysis's critical-path graph (hta.analyzers.critical_path_analysis:
operator/kernel spans, kernel launch delay, kernel-kernel delay, sync dependency); the walk itself is
ours because HTA's graph has no CUDA-graph replays (one launch, thousands of kernels) or PDL overlap,
and it rounds times to whole microseconds.

Each segment is classified: compute-bound kernels, memory-bound kernels (roofline bound of the
node; an unattributed GEMM counts as compute), copies, communication, launch gaps, CPU-bound.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from k3compile.report.categories import COMMUNICATION, COPY, GEMM, classify
from k3compile.report.steps import StepEvents
from k3compile.report.trace import KERNEL, RUNTIME, Event, Trace, is_graph_launch

COMPUTE_BOUND, MEMORY_BOUND, COPIES, COMM, LAUNCH_GAP, CPU_BOUND = (
    "compute-bound kernels", "memory-bound kernels", "copies", "communication", "launch gaps", "CPU-bound")
CLASSES = (COMPUTE_BOUND, MEMORY_BOUND, COPIES, COMM, LAUNCH_GAP, CPU_BOUND)
_SYNC_WORDS = ("synchronize", "memcpy", "eventsync", "streamwait")


def _us(ns: float) -> float:
    return round(ns / 1000, 3)


@dataclass
class Segment:
    kind: str        # one of CLASSES
    name: str        # kernel name, or what was waited for
    start_us: float  # relative to the step's start
    dur_us: float
    node: str | None = None


@dataclass
class CriticalPath:
    step: int
    total_us: float                   # path start -> last GPU event's end
    by_class: dict[str, float]
    segments: list[Segment] = field(default_factory=list)   # in time order
    pdl_overlaps: int = 0             # kernels that started before their stream predecessor ended
    cross_stream_waits: int = 0


def _is_sync(e: Event) -> bool:
    n = e.name.lower()
    return e.kind == RUNTIME and any(w in n for w in _SYNC_WORDS) and "async" not in n


def critical_path(trace: Trace, se: StepEvents, describe) -> CriticalPath | None:
    """`describe(ev)` -> (roofline bound "compute" / "memory" / None when unknown, node name or None)."""
    gpu = sorted(se.gpu, key=lambda e: (e.ts, e.end))
    if not gpu:
        return None
    origin = se.step.start
    streams: dict[tuple, list[Event]] = defaultdict(list)
    for e in gpu:
        streams[(e.device, e.stream)].append(e)
    index = {id(e): i for evs in streams.values() for i, e in enumerate(evs)}
    ends_sorted = sorted(gpu, key=lambda e: e.end)
    end_times = [e.end for e in ends_sorted]
    syncs: dict[tuple, list[Event]] = defaultdict(list)
    for e in trace.events:
        if _is_sync(e) and se.step.start <= e.ts <= se.step.end:
            syncs[(e.pid, e.tid)].append(e)

    segs: list[Segment] = []
    pdl = cross = 0

    def add(kind, name, start, end, node=None):
        if end > start:
            segs.append(Segment(kind, name, _us(start - origin), _us(end - start), node))

    def kernel_kind(ev: Event) -> str:
        cat = classify(ev.name)
        if ev.kind != KERNEL or cat == COPY:
            return COPIES
        if cat == COMMUNICATION:
            return COMM
        bound = describe(ev)[0]
        if bound is None:
            bound = "compute" if cat == GEMM else "memory"
        return COMPUTE_BOUND if bound == "compute" else MEMORY_BOUND

    cur: Event | None = max(gpu, key=lambda e: (e.end, e.ts))
    path_start = cur.end
    tail_end = cur.end  # the part of `cur` still to account for ends here
    seen = set()
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        evs = streams[(cur.device, cur.stream)]
        i = index[id(cur)]
        prev = evs[i - 1] if i > 0 else None
        launch = trace.launch_of(cur)
        stream_ready = prev.end if prev is not None else None
        # a kernel may start before its launch call returns: then the call was ready when it started
        # (a cudaGraphLaunch enqueues its kernels as it goes: its kernels were ready from the call's start)
        launch_ready = None
        if launch is not None:
            launch_ready = min(launch.ts if is_graph_launch(launch) else launch.end, cur.ts)
        ready = max([t for t in (stream_ready, launch_ready) if t is not None], default=None)
        # cross-stream: latest end on another stream after `ready`, no later than our start
        j = bisect.bisect_right(end_times, cur.ts) - 1
        other = None
        while j >= 0 and (ready is None or end_times[j] > ready):
            cand = ends_sorted[j]
            if (cand.device, cand.stream) != (cur.device, cur.stream) and id(cand) not in seen:
                other = cand
                break
            j -= 1
        node = describe(cur)[1]
        if prev is not None and prev.end > cur.ts:  # PDL: overlapped its predecessor
            pdl += 1
            add(kernel_kind(cur), cur.name, prev.end, tail_end, node)
            path_start, tail_end, cur = prev.end, prev.end, prev
            continue
        add(kernel_kind(cur), cur.name, cur.ts, tail_end, node)
        path_start = cur.ts
        if other is not None:
            cross += 1
            add(LAUNCH_GAP, f"wait for stream {other.stream}", other.end, cur.ts)
            path_start, tail_end, cur = other.end, other.end, other
            continue
        if ready is None:
            break
        if stream_ready is not None and (launch_ready is None or stream_ready >= launch_ready):
            add(LAUNCH_GAP, "kernel-kernel delay", prev.end, cur.ts)
            path_start, tail_end, cur = prev.end, prev.end, prev
            continue
        # the launch call was the last thing ready: the CPU was on the path
        add(LAUNCH_GAP, "kernel launch delay", launch_ready, cur.ts)
        thread = syncs.get((launch.pid, launch.tid), [])
        before = [s for s in thread if s.end <= launch.ts]
        if before:
            sync = before[-1]
            add(CPU_BOUND, launch.name, sync.end, launch_ready)
            waited = [e for e in gpu if e.end <= sync.end and id(e) not in seen]
            path_start = sync.end
            if waited:
                last = max(waited, key=lambda e: e.end)
                add(CPU_BOUND, sync.name, last.end, sync.end)  # the sync returning after the GPU finished
                path_start, tail_end, cur = last.end, last.end, last
                continue
            break
        add(CPU_BOUND, launch.name, se.step.start, launch_ready)
        path_start = min(se.step.start, launch_ready)
        break

    segs.reverse()
    by_class = dict.fromkeys(CLASSES, 0.0)
    for s in segs:
        by_class[s.kind] = round(by_class[s.kind] + s.dur_us, 3)
    total = _us(max(e.end for e in gpu) - path_start)
    return CriticalPath(se.step.index, total, by_class, segs, pdl, cross)
