"""A torch.profiler chrome trace as data: events, GPU streams, and the CPU launch behind each GPU event.

Why a parser of our own and not HolisticTraceAnalysis (HTA 0.5.0, the library built for these
traces): we tried it on torch 2.11/2.13 traces from an H200 and a CPU run. It rounds every
timestamp and duration down to whole microseconds (a 0.9 µs elementwise kernel became 0 µs, a
2.53 µs GEMM 2 µs) — decode kernels and launch gaps are 1–5 µs, so that error is the size of the
thing we measure; its idle-time and temporal breakdowns fail on CPU-only traces; and it pulls in
jupyterlab, pytest and ~75 other packages at install time. The subset of the chrome trace format
that torch.profiler writes is small and stable, so reading it here is the smaller dependency.

Times are kept as integer nanoseconds (the trace stores microseconds with three decimals), so
sums and gaps are exact.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

# Event kinds, from the chrome-trace `cat` torch.profiler writes.
KERNEL = "kernel"
MEMCPY = "memcpy"
MEMSET = "memset"
RUNTIME = "runtime"        # a CUDA runtime or driver API call on a CPU thread (launches, syncs, …)
OP = "op"                  # a torch operator (`aten::mm`, `k3::kda_decode`)
ANNOTATION = "annotation"  # record_function / ProfilerStep#N ranges
OTHER = "other"

GPU_KINDS = (KERNEL, MEMCPY, MEMSET)
_LINKED_KINDS = GPU_KINDS + (RUNTIME,)  # the two ends of a launch, tied by a correlation id

_KIND_OF_CAT = {
    "kernel": KERNEL,
    "gpu_memcpy": MEMCPY,
    "gpu_memset": MEMSET,
    "cuda_runtime": RUNTIME,
    "cuda_driver": RUNTIME,
    "cpu_op": OP,
    "user_annotation": ANNOTATION,
}


class TraceError(ValueError):
    """The file is not a torch.profiler chrome trace we can read."""


@dataclass(frozen=True, slots=True)
class Event:
    """One complete ('X') event. GPU events carry their device and stream; CPU events do not."""
    name: str
    kind: str
    cat: str
    ts: int   # ns
    dur: int  # ns
    pid: Any
    tid: Any
    correlation: int | None = None
    device: int | None = None
    stream: int | None = None
    args: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def end(self) -> int:
        return self.ts + self.dur

    @property
    def on_gpu(self) -> bool:
        return self.kind in GPU_KINDS


@dataclass
class Stream:
    """The GPU events of one stream on one device, in start order."""
    device: int
    id: int
    events: list[Event] = field(default_factory=list)


@dataclass
class Trace:
    path: str
    events: list[Event]           # every complete event, CPU and GPU, in start order
    device_names: dict[int, str]  # from the trace's deviceProperties
    metadata: dict                # the top-level keys other than traceEvents
    gpu_events: list[Event] = field(init=False)
    streams: dict[tuple[int, int], Stream] = field(init=False)
    launches: dict[int, Event] = field(init=False)  # correlation id → the CPU API call

    def __post_init__(self) -> None:
        self.gpu_events = [e for e in self.events if e.on_gpu]
        self.streams = {}
        for e in self.gpu_events:
            key = (e.device, e.stream)
            self.streams.setdefault(key, Stream(e.device, e.stream)).events.append(e)
        self.launches = {}
        for e in self.events:
            if e.kind == RUNTIME and e.correlation is not None:
                self.launches.setdefault(e.correlation, e)

    def launch_of(self, gpu_event: Event) -> Event | None:
        """The CPU call (cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch, cudaMemcpyAsync …)
        that enqueued this GPU event, or None when it was enqueued outside the profiled window."""
        if gpu_event.correlation is None:
            return None
        return self.launches.get(gpu_event.correlation)

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]


def is_graph_launch(event: Event) -> bool:
    """cudaGraphLaunch / cuGraphLaunch (CUPTI may add suffixes such as `_v10000` or `_ptsz`)."""
    return "graphlaunch" in event.name.lower()


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a chrome trace written by `prof.export_chrome_trace` or `tensorboard_trace_handler`
    (plain or gzipped JSON)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace file not found: {path}")
    if os.path.isdir(path):
        raise TraceError(f"{path}: is a directory; pass one trace file (*.json or *.json.gz)")
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise TraceError(f"{path}: gzip data is corrupt ({e})") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise TraceError(f"{path}: not a chrome trace: no top-level 'traceEvents' "
                         "(expected the JSON written by torch.profiler's export_chrome_trace)")
    raw_events = doc["traceEvents"]
    if not isinstance(raw_events, list):
        raise TraceError(f"{path}: 'traceEvents' is a {type(raw_events).__name__}, not a list")
    return Trace(path=path, events=_parse_events(path, raw_events),
                 device_names=_device_names(doc.get("deviceProperties")),
                 metadata={k: v for k, v in doc.items() if k != "traceEvents"})


def _ns(value: Any, what: str, path: str, index: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"{path}: event #{index} ({name!r}) has no numeric '{what}' (got {value!r})")
    return round(value * 1000)


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None


def _parse_events(path: str, raw_events: list) -> list[Event]:
    events = []
    unlinked = []  # indexes into `events` of GPU events and API calls without a correlation arg
    for index, e in enumerate(raw_events):
        if not isinstance(e, dict):
            raise TraceError(f"{path}: event #{index} is a {type(e).__name__}, not an object")
        if e.get("ph") != "X":
            continue  # metadata, instant and flow events carry no duration
        name = e.get("name")
        if not isinstance(name, str):
            raise TraceError(f"{path}: event #{index} has no name")
        cat = str(e.get("cat", ""))
        kind = _KIND_OF_CAT.get(cat.lower(), OTHER)
        ts = _ns(e.get("ts"), "ts", path, index, name)
        dur = max(0, _ns(e.get("dur"), "dur", path, index, name))
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        correlation = _int_or_none(args.get("correlation"))
        if correlation is None and kind in _LINKED_KINDS:
            unlinked.append(len(events))
        device = stream = None
        if kind in GPU_KINDS:
            # GPU events sit on pid = device, tid = stream; args repeat both when present.
            device = _int_or_none(args.get("device"))
            device = device if device is not None else _int_or_none(e.get("pid"))
            stream = _int_or_none(args.get("stream"))
            stream = stream if stream is not None else _int_or_none(e.get("tid"))
            if device is None or stream is None:
                raise TraceError(f"{path}: GPU event #{index} ({name!r}) names no device/stream")
        events.append(Event(name=name, kind=kind, cat=cat, ts=ts, dur=dur, pid=e.get("pid"),
                            tid=e.get("tid"), correlation=correlation, device=device,
                            stream=stream, args=args))
    if unlinked:
        flow_at = _flow_ids(raw_events)
        for i in unlinked:
            ev = events[i]
            events[i] = dataclasses.replace(ev, correlation=flow_at.get((ev.pid, ev.tid, ev.ts)))
    events.sort(key=lambda ev: (ev.ts, -ev.dur))  # parents before the children they contain
    return events


def _flow_ids(raw_events: list) -> dict[tuple, int]:
    """Flow events ('s' on the launching CPU thread, 'f' on the GPU stream, cat "ac2g") carry the
    correlation id too, at the same thread and timestamp as the events they link."""
    flow_at: dict[tuple, int] = {}
    for e in raw_events:
        if e.get("ph") in ("s", "f") and e.get("cat") == "ac2g":
            flow_id = _int_or_none(e.get("id"))
            if flow_id is not None and isinstance(e.get("ts"), (int, float)):
                flow_at[(e.get("pid"), e.get("tid"), round(e["ts"] * 1000))] = flow_id
    return flow_at


def _device_names(props: Any) -> dict[int, str]:
    names = {}
    for p in props if isinstance(props, list) else []:
        if isinstance(p, dict) and _int_or_none(p.get("id")) is not None:
            names[int(p["id"])] = str(p.get("name", "?"))
    return names


def exclusive_ns(events: list[Event]) -> dict[int, int]:
    """id(event) -> the part of its duration after the latest end of the events that started before it on its
    (device, stream): what it adds to the stream's busy time beyond its predecessors (PDL overlaps a kernel's start,
    and its wait, with the kernel before it)."""
    out: dict[int, int] = {}
    by_stream: dict[tuple, list[Event]] = defaultdict(list)
    for e in events:
        by_stream[(e.device, e.stream)].append(e)
    for evs in by_stream.values():
        evs.sort(key=lambda e: (e.ts, e.end))
        reached = None
        for e in evs:
            begin = e.ts if reached is None else max(e.ts, reached)
            out[id(e)] = max(0, e.end - begin)
            reached = e.end if reached is None else max(reached, e.end)
    return out
