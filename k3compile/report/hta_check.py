"""`report --hta`: HolisticTraceAnalysis's own critical path of each step, next to ours, where it applies.

HTA (`pip install k3compile[hta]`: holistictraceanalysis 0.5 needs pandas < 3 and psutil, which it
does not declare) builds a graph of CPU ops, launches and kernels and takes its longest path
(hta.analyzers.critical_path_analysis). It fits eager steps. It does not fit CUDA-graph replays:
it links one kernel to each launch, so a replay's thousands of kernels collapse into one
"kernel-kernel delay"; those steps are skipped here with that reason, and report/critical_path.py
is the analysis for them. HTA rounds times to whole microseconds.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
from dataclasses import dataclass, field

from k3compile.report.analysis import Report

SKIP_GRAPH = "CUDA-graph replay (HTA links one kernel per launch)"


@dataclass
class HtaStep:
    step: str
    total_us: float | None = None
    by_bound: dict[str, float] = field(default_factory=dict)  # HTA's bound_by classes -> us
    skipped: str | None = None


def available() -> str | None:
    """None when HTA can run here, else why not."""
    try:
        import pandas
        import hta.trace_analysis  # noqa: F401
    except ImportError as e:
        return f"HolisticTraceAnalysis is not installed ({e}); pip install 'k3compile[hta]'"
    if int(pandas.__version__.split(".")[0]) >= 3:
        return f"HolisticTraceAnalysis 0.5 does not run on pandas {pandas.__version__} (needs pandas < 3)"
    return None


def hta_critical_paths(trace_path: str, report: Report) -> list[HtaStep]:
    """One HtaStep per step of `report` (steps must be annotations: HTA selects them by name)."""
    why = available()
    if why is not None:
        return [HtaStep(s.name, skipped=why) for s in report.steps]
    from hta.trace_analysis import TraceAnalysis

    out = []
    with tempfile.TemporaryDirectory() as d:
        os.symlink(os.path.abspath(trace_path), os.path.join(d, os.path.basename(trace_path)))
        quiet = io.StringIO()
        logging.getLogger("hta").setLevel(logging.ERROR)
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            analysis = TraceAnalysis(trace_dir=d)
        seen: dict[str, int] = {}
        for s in report.steps:
            instance = seen.get(s.name, 0)
            seen[s.name] = instance + 1
            if s.graph_replayed:
                out.append(HtaStep(s.name, skipped=SKIP_GRAPH))
                continue
            try:
                with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                    graph, ok = analysis.critical_path_analysis(rank=0, annotation=s.name, instance_id=instance)
                    df = graph.get_critical_path_breakdown() if ok else None
            except Exception as e:  # HTA's own limits: name them, keep the rest of the report
                out.append(HtaStep(s.name, skipped=f"HTA failed: {type(e).__name__}: {e}"))
                continue
            if df is None:
                out.append(HtaStep(s.name, skipped="HTA found no critical path"))
                continue
            by = df.groupby("bound_by")["duration"].sum()
            out.append(HtaStep(s.name, round(float(df["duration"].sum()), 3),
                               {str(k): round(float(v), 3) for k, v in by.items() if k}))
    return out


def render_hta(steps: list[HtaStep]) -> list[str]:
    from k3compile.report.render import _table

    out = ["", "HolisticTraceAnalysis critical path (cross-check; whole microseconds; eager steps only)"]
    classes = sorted({k for s in steps for k in s.by_bound})
    rows = [[s.step, s.total_us] + [s.by_bound.get(c, 0.0) for c in classes] + [s.skipped or ""]
            for s in steps]
    return out + _table(["step", "total"] + classes + ["skipped"], rows, left=("skipped",))
