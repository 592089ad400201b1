"""Trace-guided reports: read a torch.profiler chrome trace, cut it into steps, and say where the
GPU time goes (`k3compile report TRACE.json`).

    trace.py       the trace as data (events, streams, launches, exclusive times) and its loader
    categories.py  kernel/op name → model part (GEMM, KDA, attention, MoE, …)
    steps.py       step ranges and which events belong to each step
    analysis.py    the numbers: per-category counts, launch gaps, busy time, top kernels (and the below)
    attribution.py which graph node / layer / pass launched each kernel (CUDA-graph replays included)
    critical_path.py  the chain of waits behind each step's end, split by kind
    roofline.py    per-node roofline against same-run peaks, per-layer table, next fusions
    by_op.py       time over the floor per op, by exclusive time (what a PDL-overlapped step spends per op)
    diff.py        `--diff`: two reports compared
    render.py      text and JSON output;  html.py: `--html` (inline SVG plots)
    hta_check.py   `--hta`: HolisticTraceAnalysis's critical path on eager steps, as a cross-check
"""
from k3compile.report.analysis import Report, analyze
from k3compile.report.categories import CATEGORIES, classify
from k3compile.report.render import render_text, to_json
from k3compile.report.steps import DEFAULT_STEP_PATTERN, segment
from k3compile.report.trace import Trace, TraceError, load_trace

__all__ = ["CATEGORIES", "DEFAULT_STEP_PATTERN", "Report", "Trace", "TraceError", "analyze",
           "classify", "load_trace", "render_text", "segment", "to_json"]
