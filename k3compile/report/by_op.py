"""Where a step's time over its floor goes, by op: the attributed kernels summed per op, with their exclusive time.

A fused engine's step is a few hundred kernels of a dozen ops (k3.gemv, k3.fused_moe_decode, k3.norm_route, ...), so
the question "which kernel is next" is answered per op: how much of the step each op takes beyond the bytes it must
move. Kernel sums overstate that under PDL, where a kernel starts, and waits, while its predecessor runs. So the
table ranks ops by their *exclusive* time (trace.exclusive_ns: the part of each kernel after the kernels before
it on its stream ended; one stream's exclusive times sum to its busy span) less their floor (roofline.floor_ns at
the same-run peaks). Session 19 computed this table by hand for the k3-mini-6b profile
(traces/h200_s19/call1/per_op_k3-mini_h100.txt), from kernel sums; here the report prints it.

How to read it: the ops' exclusive times sum to the stream's busy time, so the excesses are an exact split of the
step's time over its floor. Overlap counts toward the earlier kernel. A PDL successor that streams its first weight
tiles while a latency-bound kernel runs makes that kernel's row look worse and its own look better, so an op's
excess is what fusing it away or shortening it could at most give back, not a guaranteed gain.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from k3compile.report.attribution import Attribution
from k3compile.report.trace import Event, exclusive_ns


@dataclass
class OpRow:
    op: str
    nodes: int                # distinct nodes of this op
    launches_per_step: float
    time_us: float            # per step: kernel durations summed (PDL waits included)
    exclusive_us: float       # per step: the kernels' exclusive time
    floor_us: float           # per step: the nodes' floors summed
    excess_us: float          # exclusive - floor: what the op costs beyond its bytes (or FLOPs)
    roofline: float | None    # floor / exclusive
    mbytes: float             # per step


def by_op(rows, steps: list[list[Event]], attr: dict[Event, Attribution]) -> list[OpRow]:
    """One row per op, ranked by excess (largest first): roofline.py's per-node rows (`RooflineRow`: time, launches,
    bytes and floor per step) summed per op, with the exclusive time of each node's kernels over `steps`."""
    n = max(len(steps), 1)
    exclusive: dict[str, int] = defaultdict(int)  # node -> exclusive ns over all steps
    for gpu in steps:
        excl = exclusive_ns(gpu)
        for ev in gpu:
            a = attr.get(ev)
            if a is not None and a.node is not None:
                exclusive[a.node.name] += excl[id(ev)]
    acc: dict[str, list] = {}  # op -> [nodes, launches, time us, exclusive us, floor us, bytes], per step
    for r in rows:
        t = acc.setdefault(r.op, [0, 0.0, 0.0, 0.0, 0.0, 0])
        t[0] += 1
        t[1] += r.launches_per_step
        t[2] += r.time_us
        t[3] += exclusive[r.node] / n / 1000
        t[4] += r.floor_us or 0.0
        t[5] += r.bytes
    out = [OpRow(op, nodes, round(launches, 3), round(time, 3), round(ex, 3), round(floor, 3), round(ex - floor, 3),
                 round(floor / ex, 4) if ex else None, round(nbytes / 1e6, 3))
           for op, (nodes, launches, time, ex, floor, nbytes) in acc.items()]
    out.sort(key=lambda r: (-r.excess_us, r.op))
    return out
