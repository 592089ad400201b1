"""`k3compile report TRACE.json [--diff B.json] [--json OUT] [--html OUT]`: kernels per step by category,
launch gaps, top kernels, attribution to graph nodes, critical path, roofline, next fusions."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a valid regular expression: {text!r} ({e})")
    return text


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def register(subparsers) -> None:
    from k3compile.report.steps import DEFAULT_STEP_PATTERN

    p = subparsers.add_parser(
        "report", help="trace-guided report from a torch.profiler chrome trace",
        description="Read a torch.profiler chrome trace (.json or .json.gz) of decode steps and "
                    "report GPU kernels per step by category, launch gaps, GPU busy time and the "
                    "top kernels. Steps are user annotations matching --step-regex, else "
                    "ProfilerStep#N ranges, else the whole trace.")
    p.add_argument("trace", help="chrome trace written by prof.export_chrome_trace or "
                                 "tensorboard_trace_handler")
    p.add_argument("--json", metavar="OUT", help="also write the report's numbers as JSON here")
    p.add_argument("--html", metavar="OUT", help="also write a self-contained HTML page with plots here")
    p.add_argument("--hta", action="store_true",
                   help="also run HolisticTraceAnalysis's critical path on each eager step (needs k3compile[hta])")
    p.add_argument("--diff", metavar="B", help="compare with a second trace: what disappeared, appeared, and "
                                               "what the critical path gained from TRACE to B")
    p.add_argument("--step-regex", type=_regex, default=DEFAULT_STEP_PATTERN,
                   help=f"annotation names that mark one step (default: {DEFAULT_STEP_PATTERN!r})")
    p.add_argument("--top", type=_positive, default=15, help="how many top kernels to list")
    p.set_defaults(func=run)


def run(args) -> int:
    from k3compile.report import analyze, load_trace, render_text, segment, to_json

    trace = load_trace(args.trace)
    report = analyze(trace, step_pattern=args.step_regex, top=args.top)
    text = render_text(report)
    doc = to_json(report)
    if args.diff:
        from k3compile.report.diff import diff, render_diff

        other = analyze(load_trace(args.diff), step_pattern=args.step_regex, top=args.top)
        d = diff(report, other)
        text = render_diff(d)
        doc = {"schema": "k3compile.report-diff/1", "time_unit": "us", "diff": dataclasses.asdict(d),
               "a": doc, "b": to_json(other)}
    if args.hta:
        from k3compile.report.hta_check import hta_critical_paths, render_hta

        hta = hta_critical_paths(args.trace, report)
        text += "\n".join(render_hta(hta)) + "\n"
        doc["hta_critical_path"] = [dataclasses.asdict(h) for h in hta]
    print(text, end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    if args.html:
        from k3compile.report.html import render_html

        seg = segment(trace, args.step_regex)
        first = seg.steps[0].gpu if seg.steps else []
        with open(args.html, "w") as f:
            f.write(render_html(report, text, first))
        print(f"wrote {args.html}")
    return 0
