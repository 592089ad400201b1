"""Per-node roofline, per-layer table, "next fusions" and the time over the floor by op (by_op.py), from attributed
kernels and the node table's bytes and FLOPs.

Peaks come from the same run: the profiling session times a large device copy (`k3.peak/copy`,
bandwidth = bytes read + written / fastest copy) and a large bf16 GEMM (`k3.peak/gemm`), and their
sizes are in the trace's node table. A trace without them falls back to the best any node achieved
in it (labelled so). A node's floor is max(bytes / peak bandwidth, FLOPs / peak FLOP/s); its
roofline % is floor / measured time; it is compute-bound when the FLOP term is the larger.

A node that launches several kernels is one roofline row (its bytes and FLOPs are per node).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from k3compile.report.attribution import TRACE_KEY, Attribution
from k3compile.report.by_op import OpRow, by_op
from k3compile.report.categories import ATTENTION, GEMM, KDA, MOE, classify
from k3compile.report.trace import ANNOTATION, Event, Trace

COMPUTE, MEMORY = "compute", "memory"
MEASURED, OBSERVED = "measured in this run", "best achieved in this trace (no peak measurement in it)"
UNATTRIBUTED = "(unattributed)"


def _us(ns: float) -> float:
    return round(ns / 1000, 3)


@dataclass
class Peaks:
    bytes_per_s: float | None
    flops_per_s: float | None
    source: str


@dataclass
class RooflineRow:
    node: str
    op: str
    layer: str
    pass_: str
    kernels: list[str]
    launches_per_step: float
    time_us: float            # per step
    bytes: int
    flops: int
    floor_us: float | None    # per step
    roofline: float | None    # floor / time
    achieved_gb_s: float | None
    achieved_tflop_s: float | None
    bound: str
    exact: bool


@dataclass
class LayerRow:
    layer: str
    kernels: float            # per step
    time_us: float
    floor_us: float
    roofline: float | None


@dataclass
class Fusion:
    ops: list[str]
    layers: list[str]
    example_nodes: list[str]
    occurrences: float        # per step
    time_us: float            # per step: span of the chains
    floor_us: float
    recoverable_us: float     # gaps inside the chains + excess over each node's floor


@dataclass
class RooflineReport:
    peaks: Peaks
    rows: list[RooflineRow] = field(default_factory=list)
    layers: list[LayerRow] = field(default_factory=list)
    fusions: list[Fusion] = field(default_factory=list)
    by_op: list[OpRow] = field(default_factory=list)  # time over the floor per op (by_op.py)
    attributed_us: float = 0.0     # per step
    unattributed_us: float = 0.0   # per step
    unattributed_kernels: float = 0.0
    unattributed_reasons: dict[str, float] = field(default_factory=dict)  # reason -> us per step


def measured_peaks(trace: Trace) -> Peaks | None:
    doc = trace.metadata.get(TRACE_KEY)
    peaks = doc.get("peaks") if isinstance(doc, dict) else None
    if not isinstance(peaks, dict):
        return None
    spans = {e.name: e for e in trace.events if e.kind == ANNOTATION}

    def fastest(range_name: str) -> int | None:
        span = spans.get(range_name)
        if span is None:
            return None
        by_name: dict[str, list[int]] = {}
        for ev in trace.gpu_events:
            if (lc := trace.launch_of(ev)) is not None and span.ts <= lc.ts <= span.end and ev.dur > 0:
                by_name.setdefault(ev.name, []).append(ev.dur)
        if not by_name:
            return None
        # the measured op's own kernel is the one that took the most time in the range: a library's small
        # helper launches there (a workspace memset beside cuBLAS's GEMM) must not count as a repetition
        return min(max(by_name.values(), key=sum))

    bw = fl = None
    copy, gemm = peaks.get("copy", {}), peaks.get("gemm", {})
    if (t := fastest(copy.get("range", ""))) and copy.get("bytes"):
        bw = copy["bytes"] / (t * 1e-9)
    if (t := fastest(gemm.get("range", ""))) and gemm.get("flops"):
        fl = gemm["flops"] / (t * 1e-9)
    return Peaks(bw, fl, MEASURED) if bw or fl else None


def floor_ns(nbytes: int, flops: int, peaks: Peaks) -> tuple[float | None, str]:
    mem = nbytes / peaks.bytes_per_s * 1e9 if peaks.bytes_per_s else None
    cmp_ = flops / peaks.flops_per_s * 1e9 if peaks.flops_per_s and flops else None
    if mem is None and cmp_ is None:
        return None, MEMORY
    if cmp_ is not None and (mem is None or cmp_ > mem):
        return cmp_, COMPUTE
    return mem, MEMORY


def _node_times(steps: list[list[Event]], attr: dict[Event, Attribution]):
    """{node: [total ns, launches, kernel names, info]} over all steps."""
    per_node: dict[str, list] = {}
    for gpu in steps:
        for ev in gpu:
            a = attr.get(ev)
            if a is None or a.node is None:
                continue
            acc = per_node.setdefault(a.node.name, [0, 0, [], a.node])
            acc[0] += ev.dur
            acc[1] += 1
            if ev.name not in acc[2]:
                acc[2].append(ev.name)
    return per_node


def analyze_roofline(trace: Trace, steps: list[list[Event]], attr: dict[Event, Attribution]) -> RooflineReport:
    n = max(len(steps), 1)
    per_node = _node_times(steps, attr)
    peaks = measured_peaks(trace)
    if peaks is None:  # best achieved by any node (a lower bound on the real peak)
        bw = max((i.bytes / (t / n * 1e-9) for t, _, _, i in per_node.values() if t and i.bytes), default=None)
        fl = max((i.flops / (t / n * 1e-9) for t, _, _, i in per_node.values() if t and i.flops), default=None)
        peaks = Peaks(bw, fl, OBSERVED)
    rep = RooflineReport(peaks)
    bound_of: dict[str, str] = {}
    floor_of: dict[str, float] = {}
    for name, (total, launches, kernels, info) in per_node.items():
        t = total / n
        floor, bound = floor_ns(info.bytes, info.flops, peaks)
        bound_of[name], floor_of[name] = bound, floor or 0.0
        rep.rows.append(RooflineRow(
            node=name, op=info.op, layer=info.layer, pass_=info.pass_, kernels=kernels,
            launches_per_step=round(launches / n, 3), time_us=_us(t), bytes=info.bytes, flops=info.flops,
            floor_us=_us(floor) if floor is not None else None,
            roofline=round(floor / t, 4) if floor is not None and t else None,
            achieved_gb_s=round(info.bytes / t, 3) if t else None,     # bytes/ns = GB/s
            achieved_tflop_s=round(info.flops / t / 1e3, 4) if t else None,
            bound=bound, exact=info.exact))
    rep.rows.sort(key=lambda r: (-(r.time_us - (r.floor_us or 0)), r.node))

    layers: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    reasons: dict[str, float] = defaultdict(float)
    for gpu in steps:
        for ev in gpu:
            a = attr.get(ev)
            key = a.node.layer if a is not None and a.node is not None else UNATTRIBUTED
            acc = layers[key]
            acc[0] += 1
            acc[1] += ev.dur
            if key == UNATTRIBUTED:
                reasons[(a.reason if a else None) or "unknown"] += ev.dur
    for name, (total, launches, _, info) in per_node.items():
        layers[info.layer][2] += floor_of[name] * n  # floors are per step; layers sum over steps
    rep.layers = [LayerRow(k, round(c / n, 3), _us(t / n), _us(f / n), round(f / t, 4) if t and f else None)
                  for k, (c, t, f) in sorted(layers.items(), key=lambda kv: _layer_key(kv[0]))]
    rep.unattributed_us = _us(layers[UNATTRIBUTED][1] / n) if UNATTRIBUTED in layers else 0.0
    rep.unattributed_kernels = round(layers[UNATTRIBUTED][0] / n, 3) if UNATTRIBUTED in layers else 0.0
    rep.attributed_us = _us(sum(t for k, (_, t, _) in layers.items() if k != UNATTRIBUTED) / n)
    rep.unattributed_reasons = {k: _us(v / n) for k, v in sorted(reasons.items())}
    rep.fusions = next_fusions(steps, attr, bound_of, floor_of)
    rep.by_op = by_op(rep.rows, steps, attr)
    return rep


def _layer_key(label: str):
    if label == "embed":
        return (0, 0)
    if label.startswith("L") and label[1:].isdigit():
        return (1, int(label[1:]))
    return {"head": (2, 0), "inputs": (3, 0)}.get(label, (4, 0)) if label != UNATTRIBUTED else (5, 0)


_NOT_FUSABLE = {GEMM, ATTENTION, MOE, KDA}


def next_fusions(steps: list[list[Event]], attr: dict[Event, Attribution], bound_of: dict[str, str],
                 floor_of: dict[str, float], top: int = 15) -> list[Fusion]:
    """Chains of consecutive (GPU order, one step) memory-bound, fusable kernels of one layer, at
    least two nodes long, grouped by their op sequence; ranked by the time a fused kernel could
    recover: the chain's span minus the sum of its nodes' floors (= the gaps inside the chain plus
    each node's excess over its roofline)."""
    n = max(len(steps), 1)
    groups: dict[tuple, list] = {}

    def close(chain: list[Event]):
        nodes = []
        for ev in chain:
            if attr[ev].node.name not in nodes:
                nodes.append(attr[ev].node.name)
        if len(nodes) < 2:
            return
        infos = {attr[ev].node.name: attr[ev].node for ev in chain}
        ops = tuple(infos[nm].op for nm in nodes)
        span = max(e.end for e in chain) - chain[0].ts
        floor = sum(floor_of.get(nm, 0.0) for nm in nodes)
        g = groups.setdefault(ops, [0, 0, 0.0, [], nodes])
        g[0] += 1
        g[1] += span
        g[2] += floor
        layer = infos[nodes[0]].layer
        if layer not in g[3]:
            g[3].append(layer)

    for gpu in steps:
        chain: list[Event] = []
        for ev in sorted(gpu, key=lambda e: (e.ts, e.stream)):
            a = attr.get(ev)
            fusable = (a is not None and a.node is not None and bound_of.get(a.node.name) == MEMORY
                       and classify(ev.name) not in _NOT_FUSABLE and classify(a.node.op) not in _NOT_FUSABLE)
            if fusable and chain and (attr[chain[-1]].node.layer != a.node.layer or ev.stream != chain[-1].stream):
                close(chain)
                chain = []
            if fusable:
                chain.append(ev)
            else:
                if chain:
                    close(chain)
                chain = []
        if chain:
            close(chain)
    out = [Fusion(list(ops), layers, nodes, round(cnt / n, 3), _us(span / n), _us(floor / n),
                  _us(max(span - floor, 0) / n))
           for ops, (cnt, span, floor, layers, nodes) in groups.items()]
    out.sort(key=lambda f: (-f.recoverable_us, f.ops))
    return out[:top]
