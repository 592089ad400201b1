"""k3compile bench ladder: the decode step after each pass of the pipeline, applied cumulatively.

    k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 1,8,64 --out traces/ladder_48b

Rung 0 is the captured step with no passes; rung k is the step after the first k enabled passes of
the pipeline (the registry's default order unless the pass flags say otherwise), so a pass file
that lands in passes/ is a new rung without any change here. The last rung is the graph
`k3compile build` writes with the same flags (the engine `serve` runs). Every rung runs through
the runtime's Executor (CUDA graphs on a GPU), like `bench decode`'s engine arm.

Per rung and batch size: step time (CUDA events; docs/BENCHMARKS.md protocol, every arm interleaved
within each repetition), kernels per step (torch.profiler over CUDA-graph replays), % of the HBM
roofline (same-run copy bandwidth, bytes per step as k3compile/bench/roofline.py). Anchors in the
same run: eager model_def, optionally torch.compile(mode="reduce-overhead") (`--compile`: it takes
a minute or more to compile a large step), engine-before (the rung after P1-P4, the engine before
issue 9) and engine-after (the last rung).

Results: OUT/ladder_<model>_<dtype>.json, .md and .png (the plot needs matplotlib; without it the
JSON and table are still written). Profiler traces are kept for the last rung and engine-before
(`--keep-traces all` keeps every arm's). Not here: Hugging Face transformers + fla at the 48B shape
(a second 98 GB copy of the weights does not fit next to ours on one H200).
"""
from __future__ import annotations

import os
import sys

from .decode import DecodeBench, add_step_bench_args, check_step_bench_args, markdown_header

# the passes that made the engine before issue 9's kernels: the "engine-before" anchor
BEFORE_PREFIXES = ("p01_", "p02_", "p03_", "p04_")


def register(sub) -> None:
    from k3compile.commands.build import add_pipeline_args

    p = sub.add_parser("ladder", help="decode step after each pass, applied cumulatively (table + plot)")
    p.add_argument("--model", required=True, help="preset or checkpoint (full-size presets: random weights, CUDA)")
    add_step_bench_args(p)
    p.add_argument("--compile", action="store_true",
                   help="add the torch.compile(mode='reduce-overhead') anchor (compiles for a minute or more)")
    p.add_argument("--keep-traces", choices=["final", "all"], default="final",
                   help="profiler traces to keep: the last rung's and engine-before's (default) or every arm's")
    p.add_argument("--out", default="traces/ladder", help="output folder for JSON, markdown, plot and traces")
    add_pipeline_args(p)
    p.set_defaults(func=run, engine=None, compile_static=False, bounded_autotune=False)
    return p


def run(args) -> int:
    import torch

    batches, device = check_step_bench_args(args)
    bench = LadderBench(args, batches, device)
    with torch.no_grad():
        bench.run()
    return 0


def rung_name(index: int, pass_name: str | None) -> str:
    return f"r{index:02d}-" + (pass_name or "captured")


class LadderBench(DecodeBench):
    def __init__(self, args, batches, device):
        from k3compile.commands.build import pipeline_from_args

        from .decode_arms import Arm

        self.pipeline = pipeline_from_args(args)
        passes = self.pipeline.enabled_passes()
        self.rungs = [{"rung": 0, "name": rung_name(0, None), "passes": []}]
        self.rungs += [{"rung": i, "name": rung_name(i, p), "passes": passes[:i]} for i, p in enumerate(passes, 1)]
        arms = ["eager"] + (["compile-reduce-overhead"] if args.compile else []) + [r["name"] for r in self.rungs]
        super().__init__(args, batches, arms, device)
        self.bench_name = "ladder"
        self.anchors = {"eager": "eager", "engine-after": self.rungs[-1]["name"]}
        if args.compile:
            self.anchors["torch.compile(reduce-overhead)"] = "compile-reduce-overhead"
        before = [p for p in passes if p.startswith(BEFORE_PREFIXES)]
        if before and passes[:len(before)] == before:
            self.anchors["engine-before"] = self.rungs[len(before)]["name"]
        self.rung_graphs: dict[str, object] = {}
        self.rung_reports: dict[str, list] = {}
        for r in self.rungs:
            self.arm_table[r["name"]] = Arm(r["name"], "captured step, no passes" if not r["passes"] else
                                            f"passes {', '.join(r['passes'])}", None,
                                            lambda ctx, b, name=r["name"]: self._rung_arm(ctx, b, name))

    # ---- the rungs ----
    def _build_rungs(self) -> None:
        """Capture once, then run the passes one at a time, keeping a snapshot of the graph after each
        (snapshots share weights: a rung costs only the weights its pass adds). A pass that fails gives
        its rung the error (its arm reports it) and the later rungs go on from the last good graph
        without it: their "passes" list what they applied, "failed_passes" what was left out."""
        from k3compile.capture import capture_step
        from k3compile.passes.manager import PassError, PassManager, snapshot
        from k3compile.passes.p11_copy_elision import copy_nodes
        from k3compile.passes.pipeline import PipelineConfig

        self.log("capturing the decode step")
        gm = capture_step(self.model, "decode")
        self.rung_graphs[self.rungs[0]["name"]] = snapshot(gm)
        self.rungs[0]["graph_copies"] = dict(copy_nodes(gm))
        self.rung_reports[self.rungs[0]["name"]] = []
        good, failed = self.rungs[0]["name"], []  # the last rung with a graph, the passes left out so far
        for r in self.rungs[1:]:
            name = r["passes"][-1]
            one = PipelineConfig(order=[name], configs={name: self.pipeline.config(name)})
            try:
                rep = PassManager(one).run(gm, graph_name="decode")
            except PassError as e:
                r["error"] = str(e)
                failed.append(name)
                self.log(f"  {r['name']}: FAILED: {e}; the next rungs go on from {good} without {name}")
                gm = snapshot(self.rung_graphs[good])  # the failed pass may have left gm half rewritten
                continue
            rec = rep.passes[0]
            self.log(f"  {r['name']}: {rec.matches} matches, nodes {rec.nodes_before} -> {rec.nodes_after}, "
                     f"{rec.seconds:.2f}s")
            if failed:
                r["passes"], r["failed_passes"] = [p for p in r["passes"] if p not in failed], list(failed)
            self.rung_graphs[r["name"]] = snapshot(gm)
            r["graph_copies"] = dict(copy_nodes(gm))
            self.rung_reports[r["name"]] = self.rung_reports[good] + [rep.to_dict()]
            good = r["name"]

    def _rung_arm(self, ctx, batch, name: str):
        from .decode_arms import _executor

        if not self.rung_graphs:
            self._build_rungs()
        rung = next(r for r in self.rungs if r["name"] == name)
        if "error" in rung:  # the arm's row reports the pass's error
            raise RuntimeError(rung["error"])
        return _executor(ctx, batch, {"decode": self.rung_graphs[name]})

    def final_graph(self):
        """The last good rung's decode graph (what `k3compile build` emits with the same pass flags, less
        any pass that failed here)."""
        if not self.rung_graphs:
            self._build_rungs()
        return next(self.rung_graphs[r["name"]] for r in reversed(self.rungs) if r["name"] in self.rung_graphs)

    # ---- traces ----
    def _bench_batch(self, ctx, b: int) -> None:
        start = len(self.results)
        super()._bench_batch(ctx, b)
        if self.args.keep_traces == "all":
            return
        keep = {self.rungs[-1]["name"], self.anchors.get("engine-before")}
        for row in self.results[start:]:
            path = row.get("trace")
            if path and row["arm"] not in keep and os.path.exists(path):
                os.remove(path)  # its counts are in the row; a 48B trace is megabytes
                row["trace"] = None

    # ---- output ----
    def _write(self, ctx) -> None:
        from .results import write_json

        a = self.args
        doc = {"bench": "ladder",
               "config": {"model": self.model_name, "dtype": a.dtype, "batches": self.batches, "context": a.context,
                          "arms": self.arms, "seed": a.seed, "pipeline": self.pipeline.to_dict(),
                          "compile": ctx.notes, "command": " ".join(sys.argv)},
               **self._measured(),
               "rungs": [dict(r, pass_reports=self.rung_reports.get(r["name"], [])[-1:]) for r in self.rungs],
               "anchors": self.anchors,
               "results": self.results}
        write_json(self.json_path, doc)
        with open(self.md_path, "w") as f:
            f.write(render_ladder_markdown(doc))
        self.png_path = os.path.splitext(self.json_path)[0] + ".png"
        doc["plot"] = plot_ladder(doc, self.png_path)
        write_json(self.json_path, doc)


def _row(results, arm, b):
    return next((r for r in results if r["arm"] == arm and r["batch"] == b), None)


def render_ladder_markdown(doc: dict) -> str:
    cfg, dev = doc["config"], doc["environment"]["device"]
    lines = markdown_header(doc, "decode ladder")
    lines += ["Rung k = the captured decode step after the first k passes of the pipeline, run by the runtime's "
              "Executor" + (" from CUDA graphs." if dev.get("type") == "cuda" else " (eager graph on CPU)."), ""]
    names: dict[str, list] = {}
    for anchor, arm in doc["anchors"].items():
        names.setdefault(arm, []).append(anchor)
    count = "kernels/step" if dev.get("type") == "cuda" else "CPU ops/step"
    head = "| arm | anchor | " + " | ".join(f"bs{b} ms | bs{b} {count} | bs{b} % roofline" for b in cfg["batches"])
    lines += [head + " |", "|---|---|" + "---:|---:|---:|" * len(cfg["batches"])]
    for arm in cfg["arms"]:
        cells = []
        for b in cfg["batches"]:
            r = _row(doc["results"], arm, b)
            if r is None:
                cells += ["", "", ""]
            elif r.get("status") != "ok" or "median_ms" not in r:
                cells += [f"{r.get('status')}: {r.get('reason', '')}", "", ""]
            else:
                n = r.get("kernels_per_step") if dev.get("type") == "cuda" else r.get("cpu_ops_per_step")
                cells += [f"{r['median_ms']:.3f} ({r['p10_ms']:.3f}–{r['p90_ms']:.3f})",
                          "–" if n is None else f"{n:g}", f"{r['roofline_pct']:.1f}"]
        lines.append(f"| {arm} | {', '.join(names.get(arm, []))} | " + " | ".join(cells) + " |")
    lines += ["", "Each cell: median ms (p10–p90) over the repetitions.", ""]
    for b in cfg["batches"]:
        after = (_row(doc["results"], doc["anchors"]["engine-after"], b) or {}).get("median_ms")
        ratios = [f"{name} / engine-after = {base / after:.2f}x" for name, arm in doc["anchors"].items()
                  if name != "engine-after" and after and (base := (_row(doc["results"], arm, b) or {}).get("median_ms"))]
        if ratios:
            lines.append(f"- batch {b}: " + ", ".join(ratios))
    lines += ["",
              f"% HBM roofline: {doc['roofline_formula']}.", "", "Passes per rung (matches, graph nodes):", ""]
    for r in doc["rungs"]:
        rep = r.get("pass_reports") or []
        recs = rep[-1]["passes"] if rep else []
        what = "; ".join(f"{p['name']}: {p['matches']} matches, nodes {p['nodes_before']} -> {p['nodes_after']}"
                         for p in recs) or "as captured"
        if r.get("error"):
            what = f"FAILED ({r['error']}); later rungs go on without it"
        elif r.get("failed_passes"):
            what += f" (without failed {', '.join(r['failed_passes'])})"
        copies = ", ".join(f"{k} {v}" for k, v in sorted(r.get("graph_copies", {}).items()))
        lines.append(f"- {r['name']}: {what}" + (f" (copy-kind graph nodes: {copies})" if copies else ""))
    lines += ["", "Bytes per step:", ""]
    for b, d in doc["bytes_per_step"].items():
        lines.append(f"- batch {b}: {d['total'] / 1e6:.1f} MB (dense weights {d['dense_weights'] / 1e6:.1f}, routed "
                     f"experts {d['routed_expert_weights'] / 1e6:.1f}, KV read {d['kv_read'] / 1e6:.1f}, state "
                     f"{d['state_read_write'] / 1e6:.1f})")
    lines += ["", f"Command: `{cfg['command']}`", ""]
    return "\n".join(lines)


def plot_ladder(doc: dict, path: str) -> str | None:
    """Step time, kernels/step and % roofline per rung, one line per batch size (anchors dashed).
    Returns the path, or None when matplotlib is missing (CPU test machines)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cfg = doc["config"]
    cuda = doc["environment"]["device"].get("type") == "cuda"
    rungs = [r["name"] for r in doc["rungs"]]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    panels = (("median_ms", "step time (ms, log)"),
              ("kernels_per_step" if cuda else "cpu_ops_per_step", "kernels/step" if cuda else "CPU ops/step"),
              ("roofline_pct", "% of HBM roofline"))
    for ax, (key, label) in zip(axes, panels):
        for b in cfg["batches"]:
            ys = [(_row(doc["results"], n, b) or {}).get(key) for n in rungs]
            xs = [i for i, y in enumerate(ys) if y is not None]
            line, = ax.plot(xs, [ys[i] for i in xs], marker="o", label=f"batch {b}")
            for anchor in ("eager", "compile-reduce-overhead"):
                y = (_row(doc["results"], anchor, b) or {}).get(key)
                if y is not None:
                    ax.axhline(y, color=line.get_color(), ls="--" if anchor == "eager" else ":", lw=0.8)
        ax.set_xticks(range(len(rungs)))
        ax.set_xticklabels(rungs, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == "median_ms":
            ax.set_yscale("log")
    axes[0].legend(title="dashed: eager, dotted: torch.compile", fontsize=8)
    fig.suptitle(f"decode ladder: {cfg['model']} {cfg['dtype']}, context {cfg['context']} "
                 f"({doc['environment']['device'].get('name')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
