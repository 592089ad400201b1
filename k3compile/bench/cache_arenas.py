"""Issue 15, item 4 on the cache benchmark: the unified arena against split pools at SGLang's default state
share and against the best split in hindsight, with the cache policy running (bench cache-pressure rows).

    python -m k3compile.bench.cache_arenas traces/cache_pressure/s13_arena

The folder holds `bench cache-pressure` reports (cache_pressure.json) of one policy: `unified_<trace>/` (run with
`--unified`) and `split_<share>_<trace>/` (`--state-fraction <share>`; `split_default_<trace>/` at SGLang's share).
For every (trace, seed, budget) and metric the best split is the sweep's best for that metric alone (which favours
the split baseline, as runtime/memory/capacity_sim.py does). Metrics, each with the counts behind it: prompt tokens
hit (higher is better), prefill tokens computed, mean TTFT and makespan (simulated seconds; lower is better). Every
ratio is oriented so that > 1 favours unified. Writes arenas.md (and arenas.json) into the folder.
"""
from __future__ import annotations

import json
import os
import sys

from .results import read_json, report_exists

# metric -> True if higher is better
METRICS = {"hit_tokens": True, "prefill_tokens_computed": False, "ttft_mean_s": False, "sim_seconds": False}


def load_rows(folder: str) -> list[dict]:
    """Every row of every report under `folder`, tagged with its arena ("unified" or the split's state share)."""
    rows = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name, "cache_pressure.json")
        if not report_exists(path):
            continue
        doc = read_json(path)
        unified = bool(doc["args"].get("unified"))
        for r in doc["rows"]:
            share = r.get("state_fraction")
            if not unified and share is None:
                raise ValueError(f"{path}: a split row without its state share (run by an older bench)")
            rows.append(dict(r, arena="unified" if unified else share, default_share=doc["args"].get("state_fraction")
                             is None and not unified))
    return rows


def compare(rows: list[dict]) -> list[dict]:
    """Per (trace, seed, budget, policy) cell with a unified row and a default-share split row: each metric's value on
    the unified arena, the default split and the best split of the sweep (with its share), and the two ratios."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["seed"], r["budget_bytes"], r["policy"]), []).append(r)
    out = []
    for (trace, seed, budget, policy), group in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        unified = [r for r in group if r["arena"] == "unified"]
        default = [r for r in group if r["default_share"]]
        splits = [r for r in group if r["arena"] != "unified"]
        if len(unified) != 1 or len(default) != 1:
            continue
        u, d = unified[0], default[0]
        cell = {"trace": trace, "seed": seed, "budget_bytes": budget, "policy": policy, "requests": u["requests"],
                "prompts": u["prompts"], "prompt_tokens": u["prompt_tokens"], "kv_only_bound": u["kv_only_bound"],
                "shares": sorted(r["arena"] for r in splits), "metrics": {}}
        for metric, larger in METRICS.items():
            best = (max if larger else min)(splits, key=lambda r: r[metric])
            uv, dv, bv = u[metric], d[metric], best[metric]
            ratio = (lambda a, b: a / b if b else None) if larger else (lambda a, b: b / a if a else None)
            cell["metrics"][metric] = {"unified": uv, "default_split": dv, "best_split": bv,
                                       "best_share": best["arena"], "unified_vs_best": ratio(uv, bv),
                                       "unified_vs_default": ratio(uv, dv)}
        best_hits = max(splits, key=lambda r: r["hit_tokens"])
        # issue 15's hit goal is a share of each replay's own KV-only bound (the request order is the replay's)
        cell["of_bound"] = {"unified": u["fraction_of_bound"], "default_split": d["fraction_of_bound"],
                            "best_split": best_hits["fraction_of_bound"], "best_share": best_hits["arena"]}
        cell["repeats_stems"] = {name: f"{r['repeats_hit']}/{r['repeats']}, {r['stems_hit']}/{r['stems']}"
                                 for name, r in (("unified", u), ("default_split", d), ("best_split", best_hits))}
        out.append(cell)
    return out


def _fmt(metric: str, v) -> str:
    if metric == "ttft_mean_s":
        return f"{v:.3f} s"
    if metric == "sim_seconds":
        return f"{v:.1f} s"
    return f"{v:,.0f}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.3f}x"


def render(cells: list[dict]) -> str:
    lines = ["# Unified arena vs split pools, with the cache policy running (issue 15, item 4)", "",
             "k3compile.bench.cache_arenas over `bench cache-pressure` reports (stand-in forward, k3-tiny byte sizes, "
             "page 16, engine default chunk). Best split = the best state share of the sweep for that metric alone; "
             "ratios > 1 favour unified (for the lower-is-better metrics: split / unified).", "",
             "| trace | seed | budget | requests (prompts) | metric | unified | default split | best split (share) | "
             "unified / best | unified / default |", "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for c in cells:
        for metric, m in c["metrics"].items():
            lines.append(f"| {c['trace']} | {c['seed']} | {c['budget_bytes'] >> 10} KiB | {c['requests']} ({c['prompts']}) | "
                         f"{metric} | {_fmt(metric, m['unified'])} | {_fmt(metric, m['default_split'])} | "
                         f"{_fmt(metric, m['best_split'])} ({m['best_share']:.3g}) | {_x(m['unified_vs_best'])} | "
                         f"{_x(m['unified_vs_default'])} |")
    lines += ["", "Hit rate as a share of the row's own KV-only bound (issue 15's hit goal: >= 90%), with repeats and "
              "shared stems hit (best split: the share with the most hit tokens):", "",
              "| trace | seed | budget | unified | default split | best split (share) | repeats, stems: unified | "
              "default split | best split |", "|---|---|---|---:|---:|---:|---|---|---|"]
    for c in cells:
        b, rs = c["of_bound"], c["repeats_stems"]
        lines.append(f"| {c['trace']} | {c['seed']} | {c['budget_bytes'] >> 10} KiB | {b['unified']:.1%} | "
                     f"{b['default_split']:.1%} | {b['best_split']:.1%} ({b['best_share']:.3g}) | {rs['unified']} | "
                     f"{rs['default_split']} | {rs['best_split']} |")
    lines += ["", "Ranges over seeds (unified / best split, unified / default split):", "",
              "| trace | budget | metric | unified / best | unified / default |", "|---|---|---|---|---|"]
    for key in sorted({(c["trace"], c["budget_bytes"]) for c in cells}, key=lambda k: (k[0], -k[1])):
        mine = [c for c in cells if (c["trace"], c["budget_bytes"]) == key]
        for metric in METRICS:
            vb = [c["metrics"][metric]["unified_vs_best"] for c in mine if c["metrics"][metric]["unified_vs_best"]]
            vd = [c["metrics"][metric]["unified_vs_default"] for c in mine
                  if c["metrics"][metric]["unified_vs_default"]]
            if vb and vd:
                lines.append(f"| {key[0]} | {key[1] >> 10} KiB | {metric} | {min(vb):.3f}-{max(vb):.3f}x | "
                             f"{min(vd):.3f}-{max(vd):.3f}x |")
    return "\n".join(lines) + "\n"


def main(folder: str) -> str:
    cells = compare(load_rows(folder))
    md = render(cells)
    with open(os.path.join(folder, "arenas.json"), "w") as f:
        json.dump(cells, f, indent=1)
    with open(os.path.join(folder, "arenas.md"), "w") as f:
        f.write(md)
    return md


if __name__ == "__main__":
    print(main(sys.argv[1]))
