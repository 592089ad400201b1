"""The issue-14 table from `bench serve` results: one row per run of each JSON, as Markdown.

    python -m k3compile.bench.serve_table OUT/serve_thread.json OUT/serve_process.json [--steps-from FILE]

Per run: served ITL p50 and its ratio to the engine's own decode step at that batch size, chunks per
output token (1.00: a chunk per step), TTFT p50 / p99 and p99 over one prompt's prefill and over the
engine's own prefill of the same wave, output tokens/s. A result without an engine step (a bench run
without --engine-step) takes it from --steps-from. The first request's TTFT after /health is given
against the warm c1 TTFT p50.
"""
from __future__ import annotations

import json
import sys


def _num(v, digits: int = 2) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and v == v else "n/a"   # nan: no such figure


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and a == a and b else "n/a"


def table(paths: list[str], steps_from: str | None = None) -> str:
    fallback = json.load(open(steps_from)).get("engine_step", {}).get("batches", {}) if steps_from else {}
    lines = ["| result | streams | ITL p50 ms | engine step ms | ITL / step | chunks / token | TTFT p50 ms | "
             "TTFT p99 ms | p99 / one prefill | p99 / engine's prefill of the wave | tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for path in paths:
        doc = json.load(open(path))
        label = path.rsplit("/", 1)[-1].removeprefix("serve_").removesuffix(".json")
        batches = doc.get("engine_step", {}).get("batches") or fallback
        single = batches.get("1", {}).get("prefill_ms")
        for r in doc["runs"]:
            b = batches.get(str(min(r["max_concurrency"], r["num_prompts"])), {})
            step, pre = b.get("device_step_ms"), b.get("prefill_ms")
            lines.append(f"| {label} | {r['max_concurrency']} | {_num(r['median_itl_ms'])} | {_num(step)} | "
                         f"{_ratio(r['median_itl_ms'], step)} | {_num(r.get('chunks_per_output_token'))} | "
                         f"{_num(r['median_ttft_ms'], 0)} | {_num(r['p99_ttft_ms'], 0)} | "
                         f"{_ratio(r['p99_ttft_ms'], single)} | {_ratio(r['p99_ttft_ms'], pre)} | "
                         f"{_num(r['output_throughput'], 0)} |")
        warm = (doc.get("warmup") or [{}])[0].get("ttft_ms")
        c1 = next((r for r in doc["runs"] if r["max_concurrency"] == 1), None)
        if warm and c1:
            notes.append(f"{label}: first request after /health TTFT {warm:.0f} ms = "
                         f"{_ratio(warm, c1['median_ttft_ms'])} a warm one (c1 p50)")
    return "\n".join(lines + [""] + notes)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m k3compile.bench.serve_table")
    p.add_argument("results", nargs="+", help="bench serve JSON files")
    p.add_argument("--steps-from", default=None, help="a JSON whose engine step to use where a result has none")
    args = p.parse_args(argv)
    print(table(args.results, args.steps_from))
    return 0


if __name__ == "__main__":
    sys.exit(main())
