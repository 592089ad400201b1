"""Which graph node (and so which layer and pass) launched every GPU kernel of a step.

The trace carries node tables (top-level key "k3compile", written by engine/profiling.py): for each
attribution run, the range `k3.attribution#i` in which the step graph ran node by node, each node
inside a `k3.node/<name>` range, and per node its op, layer, pass, bytes and FLOPs.

1. Reference: the kernels launched inside the attribution run, in GPU start order, each named by
   the innermost `k3.node/…` range around its launch call → [(kernel name, node)].
2. Direct: a step kernel launched inside a `k3.node/…` range gets that node.
3. CUDA-graph replays: the profiler gives no CPU context, so a step's replayed kernels (in launch,
   then GPU start order) are aligned with the reference whose kernel names match best (`align`:
   identical sequences match one to one; otherwise an in-order walk that resynchronizes after each
   mismatch). A matched replayed kernel gets the reference kernel's node; the rest stay unattributed.
4. Everything else (the executor's input copies, kernels outside any node) is unattributed, with
   the reason, and counted: unattributed time is reported, never dropped.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from k3compile.report.steps import Segmentation
from k3compile.report.trace import ANNOTATION, Event, Trace, is_graph_launch

TRACE_KEY = "k3compile"
NODE_RANGE = "k3.node/"

DIRECT, REPLAY = "direct", "graph replay"
NO_TABLE = "trace has no node table"
NO_MATCH = "graph replay kernel not matched to the attribution run"
OUTSIDE = "launched outside the step graph"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    op: str
    layer: str
    pass_: str
    bytes: int
    flops: int
    exact: bool = True


@dataclass
class Attribution:
    """node: the node's info, or None with `reason`; how: DIRECT or REPLAY."""
    node: NodeInfo | None
    how: str | None = None
    reason: str | None = None


@dataclass
class Reference:
    label: str
    range_name: str
    kernels: list[tuple[str, str]]           # (kernel name, node name) in GPU start order
    nodes: dict[str, NodeInfo]
    kernels_per_node: dict[str, int] = field(default_factory=dict)


def node_tables(trace: Trace) -> list[dict]:
    doc = trace.metadata.get(TRACE_KEY)
    tables = doc.get("attribution", []) if isinstance(doc, dict) else []
    return [t for t in tables if isinstance(t, dict) and isinstance(t.get("nodes"), dict)]


def _node_info(name: str, d: dict) -> NodeInfo:
    return NodeInfo(name, str(d.get("op", "?")), str(d.get("layer", "?")), str(d.get("pass", "?")),
                    int(d.get("bytes", 0)), int(d.get("flops", 0)), bool(d.get("exact", True)))


class _NodeRanges:
    """The `k3.node/…` ranges per CPU thread, to find the innermost one around a launch."""

    def __init__(self, trace: Trace):
        per_thread: dict[tuple, list[Event]] = defaultdict(list)
        for e in trace.events:
            if e.kind == ANNOTATION and e.name.startswith(NODE_RANGE):
                per_thread[(e.pid, e.tid)].append(e)
        self.ranges = {k: sorted(v, key=lambda e: e.ts) for k, v in per_thread.items()}
        self.starts = {k: [e.ts for e in v] for k, v in self.ranges.items()}

    def node_at(self, launch: Event) -> str | None:
        thread = (launch.pid, launch.tid)
        evs = self.ranges.get(thread)
        if not evs:
            return None
        i = bisect.bisect_right(self.starts[thread], launch.ts) - 1
        # node ranges never nest (one per fx node), so the latest one starting before is the only candidate
        while i >= 0:
            e = evs[i]
            if e.ts <= launch.ts <= e.end:
                return e.name[len(NODE_RANGE):]
            if e.end < launch.ts:
                return None
            i -= 1
        return None


def references(trace: Trace, ranges: _NodeRanges | None = None) -> list[Reference]:
    ranges = ranges or _NodeRanges(trace)
    tables = node_tables(trace)
    by_name = {e.name: e for e in trace.events if e.kind == ANNOTATION}
    refs = []
    for t in tables:
        span = by_name.get(t.get("range"))
        nodes = {n: _node_info(n, d) for n, d in t["nodes"].items()}
        kernels = []
        if span is not None:
            for ev in trace.gpu_events:
                launch = trace.launch_of(ev)
                if launch is None or not (span.ts <= launch.ts <= span.end):
                    continue
                node = ranges.node_at(launch)
                if node is not None:
                    kernels.append((ev, node))
        kernels.sort(key=lambda p: (p[0].ts, p[0].stream))
        ref = Reference(str(t.get("label", t.get("range"))), str(t.get("range")),
                        [(ev.name, node) for ev, node in kernels], nodes)
        for _, node in ref.kernels:
            ref.kernels_per_node[node] = ref.kernels_per_node.get(node, 0) + 1
        refs.append(ref)
    return refs


RESYNC_WINDOW = 8    # kernels that must agree after a mismatch before the alignment trusts the new offset
RESYNC_REACH = 256   # how far ahead (kernels skipped in both sequences together) a resync is looked for


def align(reference: list[str], replay: list[str]) -> dict[int, int]:
    """{replay index: reference index}. Walks both sequences in step; at a mismatch it looks for the
    nearest point (fewest kernels skipped in both together) where the next RESYNC_WINDOW names agree
    again. Equal skips on both sides are substitutions (the same nodes launched a differently named
    kernel, e.g. another GEMM variant under graph capture) and are matched by position; unequal skips
    are kernels only one side launched, left unmatched. A global longest-common-block matcher (difflib)
    does badly here: a step repeats the same per-layer kernel sequence, so blocks lock onto the wrong layer."""
    if reference == replay:
        return {i: i for i in range(len(replay))}
    out: dict[int, int] = {}
    p = q = 0
    na, nb = len(reference), len(replay)
    while p < na and q < nb:
        if reference[p] == replay[q]:
            out[q] = p
            p, q = p + 1, q + 1
            continue
        skip = _resync(reference, replay, p, q)
        if skip is None:  # nothing agrees within reach: treat the rest as substituted one for one
            for k in range(min(na - p, nb - q)):
                out[q + k] = p + k
            break
        i, j = skip
        if i == j:
            for k in range(i):
                out[q + k] = p + k
        p, q = p + i, q + j
    return out


def _resync(a: list[str], b: list[str], p: int, q: int) -> tuple[int, int] | None:
    window = min(RESYNC_WINDOW, len(a) - p, len(b) - q)
    for total in range(1, RESYNC_REACH + 1):
        for i in range(total + 1):
            j = total - i
            if p + i + window > len(a) or q + j + window > len(b):
                if p + i >= len(a) or q + j >= len(b):
                    continue
                w = min(len(a) - p - i, len(b) - q - j)
            else:
                w = window
            if w > 0 and a[p + i:p + i + w] == b[q + j:q + j + w]:
                return i, j
    return None


def attribute(trace: Trace, seg: Segmentation) -> tuple[dict[Event, Attribution], list[Reference]]:
    """An Attribution for every GPU event of every step."""
    ranges = _NodeRanges(trace)
    refs = references(trace, ranges)
    nodes_any: dict[str, NodeInfo] = {}
    for r in refs:
        nodes_any.update(r.nodes)
    result: dict[Event, Attribution] = {}
    for se in seg.steps:
        replayed = []
        for ev in se.gpu:
            launch = trace.launch_of(ev)
            if launch is not None and is_graph_launch(launch):
                replayed.append(ev)
                continue
            node = ranges.node_at(launch) if launch is not None else None
            if node is not None and node in nodes_any:
                result[ev] = Attribution(nodes_any[node], DIRECT)
            else:
                result[ev] = Attribution(None, reason=OUTSIDE if refs else NO_TABLE)
        if not replayed:
            continue
        replayed.sort(key=lambda e: (trace.launch_of(e).ts, e.ts, e.stream))
        names = [e.name for e in replayed]
        best, best_map, best_score = None, {}, -1
        for ref in refs:  # the reference with the most same-named matches (positional ones do not count)
            ref_names = [k for k, _ in ref.kernels]
            mapping = align(ref_names, names)
            score = sum(ref_names[p] == names[q] for q, p in mapping.items())
            if score > best_score:
                best, best_map, best_score = ref, mapping, score
        for i, ev in enumerate(replayed):
            if best is not None and i in best_map:
                node = best.kernels[best_map[i]][1]
                info = best.nodes.get(node)
                result[ev] = Attribution(info, REPLAY) if info else Attribution(None, reason=NO_MATCH)
            else:
                result[ev] = Attribution(None, reason=NO_MATCH if refs else NO_TABLE)
    return result, refs
