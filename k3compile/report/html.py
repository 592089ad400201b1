"""`--html`: the report as one self-contained page (inline SVG plots, no scripts, no network).

Plots: a timeline strip of the first step's GPU events coloured by category, stacked category
bars per step, a per-node roofline scatter (floor vs measured time, log-log, with the roofline
diagonal), and per-layer bars. The terminal text follows the plots in a <pre> block, so every
number of the text report is on the page too.
"""
from __future__ import annotations

import html
import math

from k3compile.report.analysis import Report
from k3compile.report.categories import CATEGORIES, classify

COLORS = {"GEMM": "#4e79a7", "KDA": "#f28e2b", "attention": "#e15759", "MoE": "#76b7b2",
          "norm/elementwise": "#59a14f", "copy": "#edc948", "communication": "#b07aa1", "other": "#9c755f"}
W = 960


def _svg(h: int, body: list[str], title: str) -> str:
    return (f'<figure><figcaption>{html.escape(title)}</figcaption>'
            f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" '
            f'viewBox="0 0 {W} {h}">' + "".join(body) + "</svg></figure>")


def _legend(y: int) -> list[str]:
    out, x = [], 10
    for c in CATEGORIES:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{COLORS[c]}"/>'
                   f'<text x="{x + 16}" y="{y + 11}" font-size="12">{html.escape(c)}</text>')
        x += 28 + 8 * len(c)
    return out


def timeline(events: list[tuple[float, float, str]], span_us: float) -> str:
    """events: (start us from the step's first GPU event, duration us, category)."""
    body = _legend(4)
    scale = (W - 20) / span_us if span_us > 0 else 0
    for start, dur, cat in events:
        body.append(f'<rect x="{10 + start * scale:.2f}" y="24" width="{max(dur * scale, 0.5):.2f}" '
                    f'height="40" fill="{COLORS.get(cat, "#999")}"/>')
    body.append(f'<text x="10" y="82" font-size="12">0 us</text>'
                f'<text x="{W - 10}" y="82" font-size="12" text-anchor="end">{span_us:.1f} us</text>')
    return _svg(90, body, "Timeline of the first step's GPU events, by category")


def stacked_bars(rows: list[tuple[str, dict[str, float]]], title: str) -> str:
    """rows: (label, {category: us}); one horizontal stacked bar each."""
    total = max((sum(v.values()) for _, v in rows), default=0) or 1
    body = _legend(4)
    y = 26
    for label, parts in rows:
        x = 160.0
        body.append(f'<text x="10" y="{y + 14}" font-size="12">{html.escape(label[:22])}</text>')
        for c in CATEGORIES:
            w = parts.get(c, 0.0) / total * (W - 250)
            if w > 0:
                body.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="18" fill="{COLORS[c]}">'
                            f'<title>{html.escape(c)}: {parts[c]:.1f} us</title></rect>')
                x += w
        body.append(f'<text x="{x + 6:.2f}" y="{y + 14}" font-size="12">{sum(parts.values()):.1f} us</text>')
        y += 24
    return _svg(y + 6, body, title)


def scatter(points: list[tuple[float, float, str]]) -> str:
    """points: (floor us, measured us, category), log-log, with the y = x roofline."""
    h, pad = 420, 50
    pts = [(f, t, c) for f, t, c in points if f > 0 and t > 0]
    body = []
    if pts:
        lo = math.log10(min(min(f, t) for f, t, _ in pts)) - 0.1
        hi = math.log10(max(max(f, t) for f, t, _ in pts)) + 0.1

        def px(v):
            return pad + (math.log10(v) - lo) / (hi - lo) * (W - 2 * pad)

        def py(v):
            return h - pad - (math.log10(v) - lo) / (hi - lo) * (h - 2 * pad)
        body.append(f'<line x1="{pad}" y1="{h - pad}" x2="{W - pad}" y2="{pad}" stroke="#333" '
                    f'stroke-dasharray="4 3"/><text x="{W - pad}" y="{pad - 6}" font-size="12" '
                    f'text-anchor="end">roofline (measured = floor)</text>')
        for f, t, c in pts:
            body.append(f'<circle cx="{px(f):.2f}" cy="{py(t):.2f}" r="4" fill="{COLORS.get(c, "#999")}" '
                        f'fill-opacity="0.8"/>')
        for d in range(math.ceil(lo), math.floor(hi) + 1):
            body.append(f'<text x="{px(10 ** d):.1f}" y="{h - pad + 16}" font-size="11" '
                        f'text-anchor="middle">{10 ** d:g}</text>'
                        f'<text x="{pad - 6}" y="{py(10 ** d) + 4:.1f}" font-size="11" '
                        f'text-anchor="end">{10 ** d:g}</text>')
    else:
        body.append(f'<text x="{pad}" y="{h / 2}" font-size="14">no attributed kernels with a roofline floor '
                    f'(the trace has no node table)</text>')
    body.append(f'<line x1="{pad}" y1="{h - pad}" x2="{W - pad}" y2="{h - pad}" stroke="#000"/>'
                f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#000"/>'
                f'<text x="{W / 2}" y="{h - 10}" font-size="12" text-anchor="middle">floor us '
                f'(bytes / peak bandwidth, FLOPs / peak FLOP/s)</text>'
                f'<text x="14" y="{h / 2}" font-size="12" transform="rotate(-90 14 {h / 2})" '
                f'text-anchor="middle">measured us per step</text>')
    return _svg(h, body, "Roofline per node: measured time against its floor (log-log)")


def layer_bars(rows: list[tuple[str, float, float]]) -> str:
    """rows: (layer, measured us, floor us)."""
    top = max((t for _, t, _ in rows), default=0) or 1
    body, y = [], 8
    for label, t, floor in rows:
        w = t / top * (W - 260)
        fw = min(floor, t) / top * (W - 260)
        body.append(f'<text x="10" y="{y + 12}" font-size="12">{html.escape(label)}</text>'
                    f'<rect x="150" y="{y}" width="{w:.2f}" height="14" fill="#4e79a7"/>'
                    f'<rect x="150" y="{y}" width="{fw:.2f}" height="14" fill="#59a14f"/>'
                    f'<text x="{156 + w:.2f}" y="{y + 12}" font-size="12">{t:.1f} us</text>')
        y += 18
    return _svg(y + 6, body, "GPU time per layer per step (green: roofline floor, blue: measured)")


def render_html(report: Report, text: str, first_step_events: list) -> str:
    """`first_step_events`: the first step's GPU events (for the timeline strip)."""
    plots = []
    if first_step_events:
        t0 = min(e.ts for e in first_step_events)
        span = (max(e.end for e in first_step_events) - t0) / 1000
        plots.append(timeline([((e.ts - t0) / 1000, e.dur / 1000, classify(e.name)) for e in first_step_events],
                              span))
    labels = [f"{s.index} {s.name}" for s in report.steps]
    plots.append(stacked_bars([(lab, {c: s.by_category[c].time_us for c in CATEGORIES})
                               for lab, s in zip(labels, report.steps)], "GPU time per step by category (us)"))
    rl = report.roofline
    if rl is not None:
        plots.append(scatter([(r.floor_us or 0, r.time_us, classify(r.op)) for r in rl.rows]))
        plots.append(layer_bars([(r.layer, r.time_us, r.floor_us) for r in rl.layers]))
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>k3compile report</title>"
            "<style>body{font-family:sans-serif;margin:16px}figure{margin:12px 0}"
            "figcaption{font-weight:bold;margin-bottom:4px}pre{font-size:12px;background:#f7f7f7;padding:8px;"
            "overflow-x:auto}</style></head><body>"
            f"<h1>k3compile report</h1><p>{html.escape(report.path)}</p>" + "".join(plots)
            + f"<h2>Text report</h2><pre>{html.escape(text)}</pre></body></html>\n")
