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


def by_op(steps: list[list[Event]], attr: dict[Event, Attribution], floor_of: dict[str, float]) -> list[OpRow]:
    """One row per op over the attributed kernels of `steps`, ranked by excess (largest first). floor_of: per node,
    ns per step."""
    n = max(len(steps), 1)
    acc: dict[str, list] = {}  # op -> [nodes, launches, dur ns, exclusive ns, bytes per step]
    for gpu in steps:
        excl = exclusive_ns(gpu)
        for ev in gpu:
            a = attr.get(ev)
            if a is None or a.node is None:
                continue
            row = acc.setdefault(a.node.op, [set(), 0, 0, 0, {}])
            row[0].add(a.node.name)
            row[1] += 1
            row[2] += ev.dur
            row[3] += excl[id(ev)]
            row[4][a.node.name] = a.node.bytes
    out = []
    for op, (nodes, launches, dur, ex, nbytes) in acc.items():
        floor = sum(floor_of.get(name, 0.0) for name in nodes)  # ns per step
        ex_step = ex / n
        out.append(OpRow(op, len(nodes), round(launches / n, 3), round(dur / n / 1000, 3), round(ex_step / 1000, 3),
                         round(floor / 1000, 3), round((ex_step - floor) / 1000, 3),
                         round(floor / ex_step, 4) if ex_step else None, round(sum(nbytes.values()) / 1e6, 3)))
    out.sort(key=lambda r: (-r.excess_us, r.op))
    return out
