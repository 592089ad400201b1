"""The human-readable build report (build_report.md): what was built, what each pass did, which kernels run."""
from __future__ import annotations

from collections import Counter

import torch.fx


def pass_rows(report) -> list[dict]:
    """The per-pass entries of a pass-manager report (a list, or a dict holding one under 'passes')."""
    if report is None:
        return []
    rows = report.get("passes", []) if isinstance(report, dict) else report
    return [r for r in rows if isinstance(r, dict)]


def op_census(gm: torch.fx.GraphModule) -> Counter:
    c = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            t = n.target
            c[str(t) if hasattr(t, "namespace") else str(getattr(t, "__name__", t))] += 1
    return c


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)


def build_report(manifest: dict, graphs: dict[str, torch.fx.GraphModule]) -> str:
    m = manifest
    lines = [f"# Engine build report: {m['model']['name']}", "",
             f"- source: `{m['model']['source']}`",
             f"- dtype: {m['dtype']}, topology: {m['topology']}, page size: {m['page_size']}",
             f"- decode batch buckets: {', '.join(map(str, m['decode_buckets']))}",
             f"- weights: {m['weights']['tensors']} tensors, {m['weights']['bytes'] / 1e6:.1f} MB",
             f"- built with k3compile {m['versions']['k3compile']}, torch {m['versions']['torch']} "
             f"on {m['build'].get('device')} in {m['build'].get('seconds', 0):.1f} s"
             + (" (every pass verified against the graph before it)" if m["build"].get("verify") else ""), ""]
    lines += ["## Passes", ""]
    any_pass = False
    for mode in sorted(graphs):
        rows = pass_rows(m["passes"].get(mode))
        if not rows:
            continue
        any_pass = True
        lines += [f"### {mode}", "", "| pass | matches | nodes before → after | launches before → after | seconds |",
                  "|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r.get('name')} | {_fmt(r.get('matches'))} | {_fmt(r.get('nodes_before'))} → "
                         f"{_fmt(r.get('nodes_after'))} | {_fmt(r.get('launches_before'))} → "
                         f"{_fmt(r.get('launches_after'))} | {_fmt(r.get('seconds'))} |")
        lines.append("")
    if not any_pass:
        lines += ["No passes were run: the graphs are the captured steps as they are.", ""]
    lines += ["## Graphs", "", "| graph | nodes | matmuls (aten.mm / bmm) | k3 ops |", "|---|---:|---:|---:|"]
    for mode, gm in sorted(graphs.items()):
        c = op_census(gm)
        mm = sum(v for k, v in c.items() if k in ("aten.mm.default", "aten.bmm.default"))
        k3 = sum(v for k, v in c.items() if k.startswith("k3."))
        lines.append(f"| {mode} | {len(gm.graph.nodes)} | {mm} | {k3} |")
    lines += ["", "## Kernel plugins (k3 ops)", "",
              "| op | uses per graph | CPU | CUDA (as registered at build time) |", "|---|---|---|---|"]
    for p in m["kernel_plugins"]:
        uses = ", ".join(f"{k}: {v}" for k, v in sorted(p["count"].items()))
        cuda = p["cuda"] + (f" — {p['cuda_backend']}" if "cuda_backend" in p else "")
        lines.append(f"| `{p['op']}` | {uses} | {p['cpu']} | {cuda} |")
    lines += ["", "Load it with `k3compile.Engine.load(DIR)`; run it with `k3compile generate --engine DIR` or "
              "`k3compile bench decode --engine DIR`.", ""]
    return "\n".join(lines)
