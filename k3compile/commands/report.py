"""`k3compile report TRACE.json`: kernels per decode step by category, launch gaps, top kernels."""
from __future__ import annotations

import argparse
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
    p.add_argument("--step-regex", type=_regex, default=DEFAULT_STEP_PATTERN,
                   help=f"annotation names that mark one step (default: {DEFAULT_STEP_PATTERN!r})")
    p.add_argument("--top", type=_positive, default=15, help="how many top kernels to list")
    p.set_defaults(func=run)


def run(args) -> int:
    from k3compile.report import analyze, load_trace, render_text, to_json

    report = analyze(load_trace(args.trace), step_pattern=args.step_regex, top=args.top)
    print(render_text(report), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(report), f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0
