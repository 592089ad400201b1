"""The trace report as text for a terminal, and as a JSON-ready dict with the same numbers."""
from __future__ import annotations

import dataclasses
from collections import Counter

from k3compile.report.analysis import NameStats, Report
from k3compile.report.categories import CATEGORIES
from k3compile.report.critical_path import CLASSES
from k3compile.report.steps import FROM_ANNOTATIONS, FROM_PROFILER_STEPS

JSON_SCHEMA = "k3compile.report/1"

_SHORT = {"norm/elementwise": "norm/elem", "communication": "comm", "attention": "attn"}
_COLUMNS = [_SHORT.get(c, c) for c in CATEGORIES]
_MEAN = "mean per step"
_NAME_WIDTH = 100
_JSON_SEGMENTS = 50
_TOP_NODES = 20


def to_json(report: Report) -> dict:
    doc = {"schema": JSON_SCHEMA, "time_unit": "us", **dataclasses.asdict(report)}
    for path in doc["critical_paths"]:  # thousands of segments per step: keep the longest
        path["segments"] = sorted(path["segments"], key=lambda g: -g["dur_us"])[:_JSON_SEGMENTS]
    doc["categories"] = list(report.categories)
    doc["devices"] = {str(k): v for k, v in report.devices.items()}
    return doc


def render_text(report: Report) -> str:
    out: list[str] = [f"k3compile report: {report.path}"]
    if report.devices:
        out.append("devices: " + ", ".join(f"{i}: {n}" for i, n in sorted(report.devices.items())))
    out.append(_steps_line(report))
    if not report.steps:
        out.append("The trace holds no events.")
    elif report.has_gpu_events:
        if report.outside_steps:
            out.append(f"GPU events launched outside every step (not counted below): "
                       f"{report.outside_steps}" + (" (including the attribution run and peak measurements)"
                                                    if report.attribution_runs else ""))
        out += _gpu_sections(report, _labels(report))
        out += _analysis_sections(report)
    else:
        out.append("No GPU kernels in this trace (CPU-only profile: no CUDA activity was recorded). "
                   "Showing top-level CPU ops per step instead.")
        out += _cpu_sections(report, _labels(report))
    return "\n".join(out) + "\n"


def _steps_line(report: Report) -> str:
    n = len(report.steps)
    if report.step_source == FROM_ANNOTATIONS:
        return f"steps: {n}, from annotations matching '{report.step_pattern}'"
    if report.step_source == FROM_PROFILER_STEPS:
        return f"steps: {n}, from ProfilerStep#N ranges (no annotation matched '{report.step_pattern}')"
    return "steps: no step annotations or ProfilerStep#N ranges: the whole trace is one step"


def _labels(report: Report) -> list[str]:
    """Step names, numbered when several steps share one (`k3.step` every time)."""
    seen = Counter(s.name for s in report.steps)
    return [s.name if seen[s.name] == 1 else f"{s.index} {s.name}" for s in report.steps]


def _gpu_sections(report: Report, labels: list[str]) -> list[str]:
    steps, mean = report.steps, report.mean
    several = len(steps) > 1

    out = ["", "GPU events per step by category (count; kernels include those replayed from CUDA "
               "graphs; launches = CPU API calls)"]
    rows = [[label] + [s.by_category[c].count for c in CATEGORIES]
            + [s.kernels, s.graph_replayed, s.launch_calls, s.memcpy + s.memset]
            for label, s in zip(labels, steps)]
    if several:
        rows.append([_MEAN] + [_count(mean["by_category"][c].count) for c in CATEGORIES]
                    + [_count(mean[k]) for k in ("kernels", "graph_replayed", "launch_calls")]
                    + [_count(mean["memcpy"] + mean["memset"])])
    out += _table(["step"] + _COLUMNS + ["kernels", "graph", "launches", "copies"], rows)

    out += ["", "GPU time per step by category (us)"]
    rows = [[label] + [s.by_category[c].time_us for c in CATEGORIES] + [s.gpu_time_us]
            for label, s in zip(labels, steps)]
    if several:
        rows.append([_MEAN] + [mean["by_category"][c].time_us for c in CATEGORIES]
                    + [mean["gpu_time_us"]])
    out += _table(["step"] + _COLUMNS + ["total"], rows)

    out += ["", "Launch gaps per step: idle time between consecutive GPU events on one stream; "
                "busy = GPU time (any stream) / span from first start to last end"]
    rows = [[label, s.gpu_span_us, s.gpu_busy_us, _pct(s.busy_fraction), s.gap_count,
             s.gap_total_us, s.gap_largest_us] for label, s in zip(labels, steps)]
    if several:
        rows.append([_MEAN, None, mean["gpu_busy_us"], _pct(mean["busy_fraction"]),
                     _count(mean["gap_count"]), mean["gap_total_us"], None])
    out += _table(["step", "span us", "busy us", "busy", "gaps", "gap total us", "largest us"],
                  rows, labels)

    streams: dict[tuple[int, int], list] = {}
    for s in steps:
        for g in s.gaps:
            acc = streams.setdefault((g.device, g.stream), [0, 0, 0.0, 0.0])
            acc[0] += g.events
            acc[1] += g.count
            acc[2] += g.total_us
            acc[3] = max(acc[3], g.largest_us)
    if streams:
        out += ["", "Launch gaps per stream, all steps"]
        out += _table(["device/stream", "events", "gaps", "gap total us", "largest us"],
                      [[f"{d}/{st}", n, c, round(t, 3), big]
                       for (d, st), (n, c, t, big) in sorted(streams.items())])

    out += ["", "Top GPU kernels (and copies) by total GPU time, all steps (excl. us: mean time after the end of the "
                "event before it on its stream; under PDL a kernel starts, and waits, while its predecessor runs)"]
    out += _names_table(report.top_kernels)

    if report.launch_shapes:
        out += ["", "Launch shapes by GPU time: blocks an SM holds at once (from registers, shared memory, threads; the "
                    "binding one named) and the waves the grid needs on the device's SMs (> 1: the last blocks wait "
                    "for the first to finish)"]
        rows = [[str(i + 1), x.blocks, x.threads, x.registers, x.shared_bytes, x.resident_per_sm, x.limited_by,
                 x.waves, x.launches, x.mean_us, _shorten(x.name)] for i, x in enumerate(report.launch_shapes)]
        out += _table(["#", "blocks", "threads", "regs", "smem B", "per SM", "bound by", "waves", "count", "mean us",
                       "name"], rows, ("bound by", "name"))

    out += ["", "GPU work per step by the top-level op that launched it (eager traces; a CUDA graph "
                "replay is one row)"]
    rows = [[_shorten(o.op), _count(o.kernels), _count(o.copies), o.gpu_us, _pct(o.share)]
            for o in report.launching_ops]
    out += _table(["op", "kernels", "copies", "GPU us", "share"], rows) if rows else ["(none)"]
    return out


def _analysis_sections(report: Report) -> list[str]:
    out = []
    cp = report.critical_path_mean
    if cp:
        out += ["", "Critical path per step (us; mean over steps): the chain of waits that ends at the "
                    "step's last GPU event"]
        rows = [[f"step {p.step}", p.total_us] + [p.by_class[c] for c in CLASSES]
                + [p.pdl_overlaps, p.cross_stream_waits] for p in report.critical_paths]
        if len(rows) > 1:
            rows.append([_MEAN, cp["total"]] + [cp[c] for c in CLASSES] + [None, None])
        out += _table(["step", "total"] + list(CLASSES) + ["PDL", "x-stream"], rows)
    rl = report.roofline
    if rl is None:
        return out
    out += ["", f"Attribution: {len(report.attribution_runs)} node table(s) in the trace"
                + "".join(f"; {r['label']}: {r['kernels']} kernels from {r['nodes']} nodes"
                          for r in report.attribution_runs)]
    out.append(f"  attributed {rl.attributed_us:.1f} us/step, unattributed {rl.unattributed_us:.1f} us/step "
               f"({_count(rl.unattributed_kernels)} kernels)"
               + "".join(f"; {why}: {us:.1f} us" for why, us in rl.unattributed_reasons.items()))
    pk = rl.peaks
    bw = f"{pk.bytes_per_s / 1e9:.0f} GB/s" if pk.bytes_per_s else "-"
    fl = f"{pk.flops_per_s / 1e12:.0f} TFLOP/s" if pk.flops_per_s else "-"
    out += ["", f"Roofline per node (peaks {pk.source}: {bw}, {fl}); floor = max(bytes / bandwidth, "
                f"FLOPs / FLOP/s); sorted by time over the floor, top {_TOP_NODES}"]
    rows = [[r.node, r.op.removeprefix("aten."), r.layer, r.pass_, _count(r.launches_per_step), r.time_us,
             r.floor_us, _pct(r.roofline), r.achieved_gb_s, r.bound + ("" if r.exact else "?")]
            for r in rl.rows[:_TOP_NODES]]
    out += _table(["node", "op", "layer", "pass", "kernels", "us", "floor us", "roofline", "GB/s", "bound"],
                  rows, left=("op", "layer", "pass", "bound")) if rows else ["(no attributed kernels)"]
    out += ["", "Time over the floor by op, per step (exclusive us: the kernels' time after the kernel before each "
                "ended on its stream, summing to the busy time; under PDL a kernel starts, and waits, while its "
                "predecessor runs, so `kernel us` counts waits, and overlap counts toward the earlier kernel); largest "
                "excess first"]
    rows = [[r.op.removeprefix("aten.").removesuffix(".default"), r.nodes, _count(r.launches_per_step), r.time_us,
             r.exclusive_us, r.floor_us, r.excess_us, _pct(r.roofline), r.mbytes] for r in rl.by_op]
    out += _table(["op", "nodes", "kernels", "kernel us", "exclusive us", "floor us", "excess us", "roofline", "MB"],
                  rows, left=("op",)) if rows else ["(no attributed kernels)"]
    out += ["", "Per layer (per step)"]
    out += _table(["layer", "kernels", "us", "floor us", "roofline"],
                  [[r.layer, _count(r.kernels), r.time_us, r.floor_us, _pct(r.roofline)] for r in rl.layers])
    out += ["", "Next fusions: chains of adjacent memory-bound kernels of one layer, by recoverable time "
                "(gaps + excess over roofline) per step"]
    rows = [[str(i + 1), f.recoverable_us, f.time_us, _count(f.occurrences), _layers(f.layers),
             _shorten(" > ".join(o.removeprefix("aten.").removesuffix(".default") for o in f.ops)),
             _shorten(", ".join(f.example_nodes))] for i, f in enumerate(rl.fusions)]
    out += _table(["#", "recoverable us", "span us", "per step", "layers", "ops", "nodes (first)"], rows,
                  left=("layers", "ops", "nodes (first)")) if rows else ["(none: no attributed memory-bound chains)"]
    return out


def _layers(labels: list[str]) -> str:
    return ",".join(labels) if len(labels) <= 4 else f"{','.join(labels[:3])},... ({len(labels)})"


def _cpu_sections(report: Report, labels: list[str]) -> list[str]:
    steps = report.steps
    out = ["", "Top-level CPU ops per step by category (count)"]
    rows = [[label] + [s.cpu_ops_by_category[c].count for c in CATEGORIES] + [s.cpu_ops]
            for label, s in zip(labels, steps)]
    out += _table(["step"] + _COLUMNS + ["ops"], rows)
    out += ["", "CPU time per step by category (us, top-level ops)"]
    rows = [[label] + [s.cpu_ops_by_category[c].time_us for c in CATEGORIES] + [s.cpu_dur_us]
            for label, s in zip(labels, steps)]
    out += _table(["step"] + _COLUMNS + ["step us"], rows)
    out += ["", "Top CPU ops by total time, all steps"]
    out += _names_table(report.top_cpu_ops)
    return out


def _names_table(stats: list[NameStats]) -> list[str]:
    if not stats:
        return ["(none)"]
    rows = [[str(i + 1), s.total_us, _pct(s.share), s.count, s.mean_us, s.exclusive_mean_us, s.category,
             _shorten(s.name)] for i, s in enumerate(stats)]
    return _table(["#", "total us", "share", "count", "mean us", "excl. us", "category", "name"], rows,
                  left=("category", "name"))


def _table(header: list[str], rows: list[list], left: tuple[str, ...] = ()) -> list[str]:
    """Columns right-aligned (numbers) except the first (labels, cut at 28 characters) and those
    named in `left`."""
    first_width = min(28, max(len(str(r[0])) for r in [header, *rows]))
    widths = [first_width] + [max(len(h), *(len(_cell(r[i])) for r in rows))
                              for i, h in enumerate(header) if i > 0]

    def line(cells):
        parts = [str(cells[0])[:first_width].ljust(first_width)]
        for h, c, w in zip(header[1:], cells[1:], widths[1:]):
            parts.append(_cell(c).ljust(w) if h in left else _cell(c).rjust(w))
        return "  ".join(parts).rstrip()
    return [line(header)] + [line(r) for r in rows]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def _count(value: float) -> float | int:
    """Mean counts print as integers when every step had the same count."""
    return int(value) if float(value).is_integer() else value


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _shorten(name: str) -> str:
    # Demangled CUDA names run to hundreds of characters; the JSON keeps them whole.
    name = name.removeprefix("void ")
    return name if len(name) <= _NAME_WIDTH else name[:_NAME_WIDTH - 3] + "..."
