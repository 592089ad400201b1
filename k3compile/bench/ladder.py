"""k3compile bench ladder: the decode step after each pass of the pipeline, applied cumulatively.

    k3compile bench ladder --model kimi-linear-48b --dtype bf16 --batch 1,8,64 --out traces/ladder_48b

Rung 0 is the captured step with no passes; rung k is the step after the first k enabled passes of
the pipeline (the registry's default order unless the pass flags say otherwise), so a pass file
that lands in passes/ is a new rung without any change here. The last rung is the graph
`k3compile build` writes with the same flags (the engine `serve` runs). Every rung runs through
the runtime's Executor (CUDA graphs on a GPU), like `bench decode`'s engine arm.

Per rung and batch size: step time (CUDA events; docs/BENCHMARKS.md protocol, every arm interleaved
within each repetition), kernels per step (torch.profiler over CUDA-graph replays), % of the HBM
roofline (same-run copy bandwidth, bytes per step as k3compile/bench/roofline.py), kernels per decode
layer (kernels/step / layers) and where the step's GPU time goes (report categories). Anchors in the
same run: eager model_def, optionally torch.compile(mode="reduce-overhead") (`--compile`: it takes
a minute or more to compile a large step; `--compile-budget` bounds it, a compile that would overrun
is skipped with the reason, each batch size's compile time is in its row), engine-before (the rung
after P1-P4, the engine before issue 9), engine-after (the last rung), and with `--hf` Hugging Face
transformers' KimiLinearForCausalLM (+ fla when installed), timed in its own process
(k3compile/bench/hf_arm.py) before ours loads: two 98 GB copies of the 48B weights do not fit on one H200.

Accuracy gate (k3compile/bench/accuracy_gate.py), per batch size before the timed repetitions: every
rung's logits against the previous rung's over `--gate-steps` teacher-forced decode steps from the same
pool state, as normwise relative error (flagged over the tolerance) and greedy-token agreement; run with
routing pinned (the verdict: k3compile/bench/pinned_routing.py; the routers' biases are restored before
timing) and with free routing. Calibration probes (gate_probes.py; `--no-gate-probes` drops them): eager
with every GEMM's sum reordered sets the tolerance (2x its error, above the dtype's floor), eager with a
deliberate bug in one MoE layer shows what a bug gives at this shape.

Variants (`--variant NAME:PASS.OPT=VALUE[,PASS.OPT=VALUE...]`, repeatable): extra arms `v-NAME`, each the last
rung's pipeline with those pass options changed (e.g. `--variant p8alone:p08_small_m_gemm.timing=alone`), built
from the rung before the first pass whose options differ, timed interleaved with every other arm and gated
against the last rung (engine-after): an A/B of whole engines in one run, for choosing a default.

`--quick` is the GPU-budget protocol (40 steps x 5 reps, 20 warm-up steps, repetitions capped at
0.5 s, 3 gate steps); without it the protocol is docs/BENCHMARKS.md's (200 x 5, 20 warm-up).

Results: OUT/ladder_<model>_<dtype>.json, .md and .png (the plot needs matplotlib; without it the
JSON and table are still written). Profiler traces are kept for the last rung and engine-before
(`--keep-traces all` keeps every arm's).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

from .accuracy_gate import CALIBRATION_MARGIN, CALIBRATION_PROBE, DEFAULT_GATE_STEPS
from .decode import DecodeBench, add_step_bench_args, check_step_bench_args, markdown_header, reps_mark
from .hf_arm import HF_ARM

# the passes that made the engine before issue 9's kernels: the "engine-before" anchor
BEFORE_PREFIXES = ("p01_", "p02_", "p03_", "p04_")


def register(sub) -> None:
    from k3compile.commands.build import add_pipeline_args

    p = sub.add_parser("ladder", help="decode step after each pass, applied cumulatively (table + plot)")
    p.add_argument("--model", required=True, help="preset or checkpoint (full-size presets: random weights, CUDA)")
    add_step_bench_args(p)
    p.add_argument("--compile", action="store_true",
                   help="add the torch.compile(mode='reduce-overhead') anchor (compiles for a minute or more)")
    p.add_argument("--hf", action="store_true",
                   help="add Hugging Face transformers' KimiLinearForCausalLM (+ fla when installed) as an anchor, "
                        "timed in a separate process before this one loads its model (Kimi-Linear configs only)")
    p.add_argument("--hf-steps", type=int, default=20, help="timed steps per repetition of the transformers arm "
                                                            "(it is ~20x slower than the engine; --reps repetitions)")
    p.add_argument("--hf-budget", type=float, default=None,
                   help="seconds for the transformers process (killed after 1.5x; batch sizes that would start "
                        "after the budget are skipped). Default: none")
    p.add_argument("--gate-steps", type=int, default=None,
                   help="teacher-forced decode steps of the per-rung accuracy gate (0: no gate; default "
                        f"{DEFAULT_GATE_STEPS}, 3 with --quick)")
    p.add_argument("--gate-probes", action=argparse.BooleanOptionalAction, default=True,
                   help="calibrate the gate in the same run: eager with every GEMM's sum reordered (rounding only) "
                        "and eager with a deliberate bug in one MoE layer, each against eager (default: on)")
    p.add_argument("--quick", action="store_true",
                   help="GPU-budget protocol: the timing flags left at their defaults become 40 steps, 20 warm-up, "
                        "5 reps, --max-rep-seconds 0.5, 3 gate steps (the markdown says it is below docs/BENCHMARKS.md)")
    p.add_argument("--keep-traces", choices=["final", "all"], default="final",
                   help="profiler traces to keep: the last rung's and engine-before's (default) or every arm's")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:PASS.OPT=VALUE[,...]",
                   help="an extra arm v-NAME: the last rung's pipeline with these pass options (repeatable)")
    p.add_argument("--out", default="traces/ladder", help="output folder for JSON, markdown, plot and traces")
    add_pipeline_args(p)
    p.set_defaults(func=run, engine=None, compile_static=False, bounded_autotune=False)
    return p


# --quick: the timing flags it changes when they are left at their defaults (explicit values win)
QUICK = {"steps": (200, 40), "warmup": (20, 20), "reps": (5, 5), "max_rep_seconds": (None, 0.5)}


def apply_quick(args) -> None:
    if args.gate_steps is None:
        args.gate_steps = 3 if args.quick else DEFAULT_GATE_STEPS
    if args.gate_steps < 0:
        from k3compile.model_def.config import ConfigError
        raise ConfigError("--gate-steps must be >= 0")
    if args.quick:
        for name, (default, quick) in QUICK.items():
            if getattr(args, name) == default:
                setattr(args, name, quick)


def run(args) -> int:
    import torch

    apply_quick(args)
    batches, device = check_step_bench_args(args)
    bench = LadderBench(args, batches, device)
    with torch.no_grad():
        bench.run()
    return 0


def rung_name(index: int, pass_name: str | None) -> str:
    return f"r{index:02d}-" + (pass_name or "captured")


def parse_variants(specs, base) -> list[dict]:
    """[{"name": "v-NAME", "options": [...], "pipeline": PipelineConfig}] from `--variant` values; the base pipeline
    with each variant's options set (unknown passes / options / values are refused here, before any GPU work)."""
    from k3compile.passes.pipeline import PassConfigError, set_pass_option

    out, seen = [], set()
    for spec in specs or ():
        label, sep, opts = spec.partition(":")
        label = label.strip()
        if not sep or not label or not re.fullmatch(r"[A-Za-z0-9_.+-]+", label) or not opts.strip():
            raise PassConfigError(f"--variant {spec!r}: expected NAME:PASS.OPT=VALUE[,PASS.OPT=VALUE...]")
        if label in seen:
            raise PassConfigError(f"--variant {spec!r}: the name {label!r} is used twice")
        seen.add(label)
        cfg, options = base.copy(), []
        for opt in (o.strip() for o in opts.split(",") if o.strip()):
            set_pass_option(cfg, opt, source=f"--variant {label}")
            options.append(opt)
        cfg.validate()
        out.append({"name": f"v-{label}", "options": options, "pipeline": cfg})
    return out


def first_difference(base, variant) -> int:
    """How many of the base pipeline's enabled passes the variant shares, in order, with equal options: the
    variant's graph is the base rung after that many passes, then the variant's remaining passes."""
    a, b = base.enabled_passes(), variant.enabled_passes()
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n] and base.config(a[n]) == variant.config(b[n]):
        n += 1
    return n


class LadderBench(DecodeBench):
    def __init__(self, args, batches, device):
        from k3compile.commands.build import pipeline_from_args

        from .decode_arms import Arm

        self.pipeline = pipeline_from_args(args)
        passes = self.pipeline.enabled_passes()
        self.rungs = [{"rung": 0, "name": rung_name(0, None), "passes": []}]
        self.rungs += [{"rung": i, "name": rung_name(i, p), "passes": passes[:i]} for i, p in enumerate(passes, 1)]
        self.variants = parse_variants(getattr(args, "variant", None), self.pipeline)
        # the pipeline as given: passes record what they measured in their configs (P6's crossover), so the base
        # compared with a variant is this copy, not self.pipeline after the rungs ran
        self.variant_base = self.pipeline.copy()
        arms = (["eager"] + (["compile-reduce-overhead"] if args.compile else []) + [r["name"] for r in self.rungs]
                + [v["name"] for v in self.variants])
        super().__init__(args, batches, arms, device)
        self.bench_name = "ladder"
        self.anchors = {"eager": "eager", "engine-after": self.rungs[-1]["name"]}
        if args.compile:
            self.anchors["torch.compile(reduce-overhead)"] = "compile-reduce-overhead"
        self.hf = None  # the transformers process's results document (--hf)
        if getattr(args, "hf", False):
            self.anchors["transformers+fla"] = HF_ARM
        self.gate: dict[str, dict] = {}  # batch size -> the accuracy gate's per-runner results
        before = [p for p in passes if p.startswith(BEFORE_PREFIXES)]
        if before and passes[:len(before)] == before:
            self.anchors["engine-before"] = self.rungs[len(before)]["name"]
        self.rung_graphs: dict[str, object] = {}
        self.rung_reports: dict[str, list] = {}
        for r in self.rungs:
            self.arm_table[r["name"]] = Arm(r["name"], "captured step, no passes" if not r["passes"] else
                                            f"passes {', '.join(r['passes'])}", None,
                                            lambda ctx, b, name=r["name"]: self._rung_arm(ctx, b, name))
        for v in self.variants:
            self.arm_table[v["name"]] = Arm(v["name"], "engine-after with " + ", ".join(v["options"]), None,
                                            lambda ctx, b, name=v["name"]: self._rung_arm(ctx, b, name))

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

        from .pinned_routing import bias_reads

        self.log("capturing the decode step")
        gm = capture_step(self.model, "decode")
        self.rung_graphs[self.rungs[0]["name"]] = snapshot(gm)
        self.rungs[0]["graph_copies"] = dict(copy_nodes(gm))
        self.rungs[0]["router_biases_read"] = bias_reads(gm, self.model)
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
            r["router_biases_read"] = bias_reads(gm, self.model)  # the pinned gate reaches this rung's routers
            self.rung_reports[r["name"]] = self.rung_reports[good] + [rep.to_dict()]
            good = r["name"]
        self._build_variants(failed)

    def _build_variants(self, failed: list[str]) -> None:
        """Each variant from the rung before its first differing pass (a snapshot), through its own remaining
        passes (less any that failed in the rungs). A variant that fails gets the error in its arm's row."""
        from k3compile.passes.manager import PassError, PassManager, snapshot
        from k3compile.passes.pipeline import PipelineConfig

        for v in self.variants:
            shared = first_difference(self.variant_base, v["pipeline"])
            start = self.rungs[shared]["name"]
            rest = [p for p in v["pipeline"].enabled_passes()[shared:] if p not in failed]
            v["from_rung"], v["passes_run"] = start, rest
            if start not in self.rung_graphs:
                v["error"] = f"its starting rung {start} has no graph"
                continue
            gm = snapshot(self.rung_graphs[start])
            try:
                rep = PassManager(PipelineConfig(order=rest, configs={p: v["pipeline"].config(p) for p in rest})).run(
                    gm, graph_name="decode")
            except PassError as e:
                v["error"] = str(e)
                self.log(f"  {v['name']}: FAILED: {e}")
                continue
            self.rung_graphs[v["name"]] = gm
            v["pass_reports"] = [rep.to_dict()]
            self.log(f"  {v['name']}: from {start}, {len(rest)} passes ({', '.join(v['options'])})")

    def _rung_arm(self, ctx, batch, name: str):
        from .decode_arms import _executor

        if not self.rung_graphs:
            self._build_rungs()
        rung = next(r for r in [*self.rungs, *self.variants] if r["name"] == name)
        if "error" in rung:  # the arm's row reports the pass's error
            raise RuntimeError(rung["error"])
        return _executor(ctx, batch, {"decode": self.rung_graphs[name]})

    def final_graph(self):
        """The last good rung's decode graph (what `k3compile build` emits with the same pass flags, less
        any pass that failed here)."""
        if not self.rung_graphs:
            self._build_rungs()
        return next(self.rung_graphs[r["name"]] for r in reversed(self.rungs) if r["name"] in self.rung_graphs)

    # ---- the transformers anchor (its own process, before our model loads) ----
    def run(self) -> None:
        if getattr(self.args, "hf", False):
            self._run_hf()
            self.start_clock()  # --time-budget is ours; the transformers process had --hf-budget
        super().run()

    def _run_hf(self) -> None:
        import json
        import subprocess

        from k3compile.model_def.config import META_ONLY_PRESETS, ConfigError

        from .hf_arm import command, hf_config

        a = self.args
        try:  # refuse here what the process would refuse after its imports (or fill the host's memory with)
            if a.model in META_ONLY_PRESETS and self.device.type != "cuda":
                raise ConfigError(f"preset '{a.model}' is full size: its transformers copy is built on CUDA only")
            if getattr(a, "layers", None) is not None:
                raise ConfigError("--layers: the transformers anchor runs the whole model only")
            hf_config(a.model)
        except ConfigError as e:
            self.hf = {"results": [], "error": str(e)}
            self.log(f"  transformers anchor not run: {e}")
            return
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"hf_{os.path.basename(a.model.rstrip('/'))}_{a.dtype}.json")
        if os.path.exists(path):
            os.remove(path)  # never merge an earlier run's numbers
        cmd = command(a.model, a.dtype, self.batches, a.context, self.device.type, a.hf_steps,
                      min(a.warmup, 3) if a.warmup else 0, a.reps, a.seed, a.hf_budget, path)
        self.log(f"transformers anchor in its own process: {' '.join(cmd)}")
        t0 = time.perf_counter()
        error = None
        try:
            proc = subprocess.run(cmd, timeout=1.5 * a.hf_budget if a.hf_budget else None)
            if proc.returncode != 0:
                error = f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            error = f"killed after {1.5 * a.hf_budget:.0f} s (1.5 x --hf-budget)"
        try:
            with open(path) as f:
                self.hf = json.load(f)
        except (OSError, ValueError):
            self.hf = {"results": []}
        if error or self.hf.get("error"):
            self.hf["error"] = self.hf.get("error") or error
            self.log(f"  transformers anchor: {self.hf['error']}")
        self.hf["wall_s"] = round(time.perf_counter() - t0, 1)
        self.hf["json"] = path

    def _hf_row(self, b: int) -> dict:
        from .hf_arm import DESCRIPTION
        from .roofline import roofline_pct

        row = next((dict(r) for r in self.hf.get("results", []) if r.get("batch") == b), None)
        if row is None:
            row = {"status": "failed" if self.hf.get("error") else "skipped",
                   "reason": self.hf.get("error") or "no result for this batch size"}
        row.update(arm=HF_ARM, description=DESCRIPTION, batch=b)
        if row.get("status") == "ok" and "median_ms" in row:
            row["tok_s"] = b / (row["median_ms"] / 1e3)
            # our bytes/step (its random weights route to about as many distinct experts as ours)
            row["roofline_pct"] = roofline_pct(self.bytes[b]["total"], self.bandwidth["bytes_per_s"], row["median_ms"])
        return row

    # ---- accuracy gate ----
    def after_setup(self, ctx, b: int, batch, fns: dict, rows: dict, restore) -> None:
        """The gate twice: routing pinned (the verdict: rounding cannot flip an expert there) and free (what
        serving does; on random weights a rounding change flips experts and the error amplifies)."""
        from contextlib import nullcontext

        from k3compile.capture import step_args

        from .accuracy_gate import GATE_MODES, GATE_TOLERANCE, run_gate
        from .gate_probes import probe_runners
        from .pinned_routing import pinned_routing

        steps = self.args.gate_steps
        if not steps:
            return
        runners = {"eager": lambda fb: ctx.model.step_tensors("decode", *step_args(fb, ctx.cache))}
        order = []
        for r in [*self.rungs, *self.variants]:
            fn = fns.get(r["name"])
            if fn is not None and hasattr(fn, "executor"):
                runners[r["name"]] = fn.executor.run
                order.append(r["name"])
        last = self.rungs[-1]["name"]
        parents = {v["name"]: last for v in self.variants}  # a variant is judged against engine-after
        probes = probe_runners(self.model, runners["eager"]) if self.args.gate_probes else None
        start = max(0, self.args.context - steps)  # positions start .. context-1: inside the allocated pages
        tol = GATE_TOLERANCE[self.dtype]  # the floor; pinned + probes calibrate it, free uses pinned's
        self.gate[str(b)] = {}
        for mode in GATE_MODES:
            self.log(f"bs={b}: accuracy gate, routing {mode}, {len(order)} rungs + {len(probes or {})} probes x "
                     f"{steps} teacher-forced steps")
            t0 = time.perf_counter()
            pinned = mode == "pinned"
            with pinned_routing(self.model) if pinned else nullcontext() as pins:
                gate = run_gate(runners, order, "eager", self.first_tokens[:b], start, min(steps, self.args.context),
                                self.batch_at, restore, tol, probes, calibrate=pinned and probes is not None,
                                parents=parents)
            if pinned:
                gate["eager"]["pinned_experts"] = pins
                tol = gate["eager"]["tolerance"]
                self.log(f"  tolerance {tol:.3g} (floor {GATE_TOLERANCE[self.dtype]:g}"
                         + (f", {CALIBRATION_MARGIN:g} x rounding probe {gate[CALIBRATION_PROBE]['rel_err']:.2e})"
                            if probes else ")"))
            self.gate[str(b)][mode] = gate
            for name in order:
                g = gate[name]
                rows[name].setdefault("gate", {})[mode] = dict(g)
                if "error" not in g and not g["ok"]:
                    self.log(f"  {name}: rel err {g['rel_err']:.2e} vs {g['vs']} over the tolerance {tol:.3g} "
                             f"(routing {mode})")
            for name in probes or {}:
                self.log(f"  {name}: rel err {gate[name]['rel_err']:.2e} vs eager (routing {mode})")
            self.log(f"  gate ({mode}) done in {time.perf_counter() - t0:.1f} s")

    # ---- traces ----
    def _bench_batch(self, ctx, b: int) -> None:
        start = len(self.results)
        super()._bench_batch(ctx, b)
        if self.hf is not None:
            self.results.append(self._hf_row(b))
            eager = next((r.get("median_ms") for r in self.results[start:] if r["arm"] == "eager"), None)
            if eager and self.results[-1].get("median_ms"):
                self.results[-1]["speedup_vs_eager"] = eager / self.results[-1]["median_ms"]
        layers = self.model.config.num_hidden_layers
        for row in self.results[start:]:
            if row.get("kernels_per_step") is not None:
                row["kernels_per_layer"] = row["kernels_per_step"] / layers
            elif row.get("cpu_ops_per_step") is not None:
                row["cpu_ops_per_layer"] = row["cpu_ops_per_step"] / layers
        if self.args.keep_traces == "all":
            return
        keep = {self.rungs[-1]["name"], self.anchors.get("engine-before")}
        for row in self.results[start:]:
            path = row.get("trace")
            if path and row["arm"] not in keep and os.path.exists(path):
                os.remove(path)  # its counts are in the row; a 48B trace is megabytes
                row["trace"] = None

    # ---- output ----
    def _gate_tolerance(self) -> float:
        from .accuracy_gate import GATE_TOLERANCE
        return GATE_TOLERANCE[self.dtype]

    def _write(self, ctx) -> None:
        from .accuracy_gate import GATE_MODES
        from .pinned_routing import routers
        from .results import write_json

        a = self.args
        doc = {"bench": "ladder",
               "config": {"model": self.model_name, "dtype": a.dtype, "batches": self.batches, "context": a.context,
                          "executor_context": self.executor_context(),
                          "arms": self.arms + ([HF_ARM] if self.hf is not None else []), "seed": a.seed,
                          "layers": self.model.config.num_hidden_layers, "pipeline": self.pipeline.to_dict(),
                          "compile": ctx.notes, "compile_budget": a.compile_budget,
                          "compile_s_total": round(self.compile_spent, 1), "quick": a.quick,
                          "command": " ".join(sys.argv)},
               **self._measured(),
               "rungs": [dict(r, pass_reports=self.rung_reports.get(r["name"], [])[-1:]) for r in self.rungs],
               "variants": [{k: v for k, v in var.items() if k != "pipeline"} for var in self.variants],
               "anchors": self.anchors,
               "accuracy_gate": {"steps": a.gate_steps, "tolerance": self._gate_tolerance(),
                                 "modes": list(GATE_MODES), "verdict_mode": GATE_MODES[0],
                                 "routers": len(routers(self.model)), "probes": a.gate_probes,
                                 "per_batch": self.gate},
               "hf": {k: v for k, v in (self.hf or {}).items() if k != "results"} or None,
               "results": self.results,
               "elapsed_s": round(time.perf_counter() - self.t0, 1)}
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
    cuda = dev.get("type") == "cuda"
    lines = markdown_header(doc, "decode ladder")
    lines += ["Rung k = the captured decode step after the first k passes of the pipeline, run by the runtime's "
              "Executor" + (" from CUDA graphs." if cuda else " (eager graph on CPU)."), ""]
    names: dict[str, list] = {}
    for anchor, arm in doc["anchors"].items():
        names.setdefault(arm, []).append(anchor)
    count = "kernels" if cuda else "CPU ops"
    head = "| arm | anchor | " + " | ".join(f"bs{b} ms | bs{b} {count}/step | bs{b} {count}/layer | bs{b} % roofline"
                                            for b in cfg["batches"])
    lines += [head + " |", "|---|---|" + "---:|---:|---:|---:|" * len(cfg["batches"])]
    for arm in cfg["arms"]:
        cells = []
        for b in cfg["batches"]:
            r = _row(doc["results"], arm, b)
            if r is None:
                cells += ["", "", "", ""]
            elif r.get("status") != "ok" or "median_ms" not in r:
                cells += [f"{r.get('status')}: {r.get('reason', '')}", "", "", ""]
            else:
                n = r.get("kernels_per_step") if cuda else r.get("cpu_ops_per_step")
                per_layer = r.get("kernels_per_layer") if cuda else r.get("cpu_ops_per_layer")
                cells += [f"{r['median_ms']:.3f} ({r['p10_ms']:.3f}–{r['p90_ms']:.3f})"
                          f"{reps_mark(r, doc['protocol']['reps'])}",
                          "–" if n is None else f"{n:g}", "–" if per_layer is None else f"{per_layer:.1f}",
                          f"{r['roofline_pct']:.1f}"]
        lines.append(f"| {arm} | {', '.join(names.get(arm, []))} | " + " | ".join(cells) + " |")
    lines += ["", f"Each cell: median ms (p10–p90) over the repetitions; {count}/layer = {count}/step ÷ "
              f"{cfg.get('layers')} layers.", ""]
    for b in cfg["batches"]:
        after = (_row(doc["results"], doc["anchors"]["engine-after"], b) or {}).get("median_ms")
        ratios = [f"{name} / engine-after = {base / after:.2f}x" for name, arm in doc["anchors"].items()
                  if name != "engine-after" and after and (base := (_row(doc["results"], arm, b) or {}).get("median_ms"))]
        if ratios:
            lines.append(f"- batch {b}: " + ", ".join(ratios))
    lines += _variant_notes(doc)
    lines += _anchor_notes(doc)
    lines += _gate_table(doc)
    lines += _time_table(doc)
    lines += ["", f"% HBM roofline: {doc['roofline_formula']}.", "", "Passes per rung (matches, graph nodes):", ""]
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


def _variant_notes(doc: dict) -> list[str]:
    """Each variant's options, where it was built from, and its step time against engine-after's."""
    variants = doc.get("variants") or []
    if not variants:
        return []
    out = ["", "Variants (the last rung's pipeline with other pass options; gated against engine-after):", ""]
    after = doc["anchors"]["engine-after"]
    for v in variants:
        what = ", ".join(v["options"])
        if v.get("error"):
            out.append(f"- {v['name']} ({what}): FAILED: {v['error']}")
            continue
        cells = []
        for b in doc["config"]["batches"]:
            mine, base = (_row(doc["results"], v["name"], b) or {}), (_row(doc["results"], after, b) or {})
            if mine.get("median_ms") and base.get("median_ms"):
                cells.append(f"bs{b} {mine['median_ms']:.3f} ms = {mine['median_ms'] / base['median_ms']:.3f}x "
                             "engine-after")
        out.append(f"- {v['name']} ({what}; from {v.get('from_rung')}): " + ("; ".join(cells) or "no timing"))
    return out


def _anchor_notes(doc: dict) -> list[str]:
    """How the torch.compile and transformers anchors were made (compile times, kernels, context)."""
    cfg, out = doc["config"], []
    compiled = [r for r in doc["results"] if r["arm"] == "compile-reduce-overhead"]
    if compiled:
        times = ", ".join(f"bs{r['batch']} " + (f"{r['compile_s']:.0f} s" if "compile_s" in r else
                                                 f"{r.get('status')} ({r.get('reason', '')})") for r in compiled)
        out += ["", f"torch.compile(mode=\"reduce-overhead\"): compile (first call) per batch size: {times}; "
                    f"{cfg.get('compile_s_total', 0):.0f} s in all"
                + (f" of a {cfg['compile_budget']:.0f} s budget" if cfg.get("compile_budget") else "") + "."]
    hf = doc.get("hf")
    if hf:
        k = hf.get("kernels", {})
        rows = [r for r in doc["results"] if r["arm"] == HF_ARM and r.get("status") == "ok"]
        ctx = ", ".join(f"bs{r['batch']} {r['context_first']}→{r['context_last']}" for r in rows if "context_last" in r)
        fla = k.get("fla") or "not installed (PyTorch fallback)"
        conv = k.get("causal_conv1d") or "not installed"
        out += ["", f"{HF_ARM}: transformers {k.get('transformers')}, fla {fla}, causal_conv1d {conv}, experts "
                f"implementation {hf.get('experts_implementation') or 'default'}; its own process ({hf.get('wall_s')} s, "
                f"before this one loaded its model), random weights, no CUDA graphs; the cache grows while timing "
                f"(context {ctx})." + (f" Error: {hf['error']}." if hf.get("error") else "")]
    return out


def _gate_table(doc: dict) -> list[str]:
    """Per rung and batch size: the pinned-routing gate (the verdict) and the free-routing one, then the
    probes that calibrate both (a rounding-only change, injected bugs)."""
    gate = doc.get("accuracy_gate") or {}
    per_batch = gate.get("per_batch") or {}
    if not per_batch:
        return []
    floor, modes = gate["tolerance"], gate["modes"]
    used = []
    for b, by_mode in per_batch.items():
        ref = by_mode.get(modes[0], {}).get("eager", {})
        if "tolerance" in ref:
            probe = by_mode[modes[0]].get(CALIBRATION_PROBE)
            used.append(f"bs{b} {ref['tolerance']:.3g}" + (f" (probe {probe['rel_err']:.2e})" if ref.get("calibrated")
                                                          and probe else ""))
    how = (f"tolerance = max({floor:g}, {CALIBRATION_MARGIN:g} x the rounding probe's error, pinned, same batch)"
           if any("probe" in u for u in used) else f"tolerance {floor:g}")
    out = ["", f"Accuracy gate: each rung's logits vs the previous rung's (same inputs, same pool state), "
               f"{gate['steps']} teacher-forced decode steps on eager's greedy tokens; rel err = max over steps of "
               f"‖a−b‖/‖b‖, {how} ({doc['config']['dtype']}; why: k3compile/bench/accuracy_gate.py); "
               "agreement = same argmax. Routing **pinned** (the verdict): every MoE layer's top-k fixed to a "
               "seeded set of experts through its selection-only correction bias, so rounding cannot flip an "
               "expert (k3compile/bench/pinned_routing.py); **free**: the model's own routing, where on random "
               "weights a rounding change flips experts and the error amplifies (same tolerance, not gated). "
               "Router biases read: how many of the model's routers the rung's graph reads in place (all: the pin "
               "reaches every router).", "",
           "| rung | vs | router biases read | " + " | ".join(
               f"bs{b} {m} rel err | bs{b} {m} agree" for b in per_batch for m in modes)
           + f" | rel err vs eager ({modes[0]}; bs {', '.join(per_batch)}) |",
           "|---|---|---:|" + "---:|---:|" * len(per_batch) * len(modes) + "---:|"]
    reads = {r["name"]: r.get("router_biases_read") for r in doc["rungs"]}
    for name in [r["name"] for r in [*doc["rungs"], *doc.get("variants", [])]]:
        cells, vs, vs_eager = [], "", []
        for b, by_mode in per_batch.items():
            for m in modes:
                e = by_mode.get(m, {}).get(name)
                if e is None:
                    cells += ["", ""]
                elif "error" in e:
                    cells += [f"error: {e['error']}", ""]
                else:
                    vs = e["vs"]
                    flag = "" if e["ok"] else " **over**"
                    cells += [f"{e['rel_err']:.2e}{flag}", f"{100 * e['token_agreement']:.1f}%"]
                    if m == modes[0]:
                        vs_eager.append(f"{e['rel_err_vs_eager']:.2e}")
        if any(cells):
            read = "" if reads.get(name) is None else f"{reads[name]}/{gate.get('routers')}"
            out.append(f"| {name} | {vs} | {read} | " + " | ".join(cells) + f" | {', '.join(vs_eager)} |")
    out.append(f"- tolerance used: {', '.join(used)}")
    for m in modes:
        over = sorted({n for g in per_batch.values() for n, e in g.get(m, {}).items()
                       if not n.startswith("probe:") and isinstance(e, dict) and e.get("ok") is False})
        verdict = " (the verdict)" if m == modes[0] else " (not gated)"
        out.append(f"- routing {m}{verdict}: " + (f"over tolerance: {', '.join(over)}." if over else
                                                 "every rung within tolerance."))
    probes = [(b, m, n, e) for b, g in per_batch.items() for m in modes for n, e in g.get(m, {}).items()
              if n.startswith("probe:")]
    if probes:
        out += ["", "Gate calibration (eager with a change, vs eager; k3compile/bench/gate_probes.py): "
                    "reordered-gemms = every GEMM a split-K sum (rounding only: should pass); bug-* = one MoE "
                    "layer made wrong (should be over; within = a bug that size is invisible at this shape and dtype):", ""]
        for b, by_mode in per_batch.items():
            for m in modes:
                cells = [f"{n[len('probe:'):]} {e['rel_err']:.2e} ({'within' if e['ok'] else 'over'}, agree "
                         f"{100 * e['token_agreement']:.0f}%)" for n, e in by_mode.get(m, {}).items()
                         if n.startswith("probe:")]
                if cells:
                    out.append(f"- bs{b}, routing {m}: " + "; ".join(cells))
    return out


def _time_table(doc: dict) -> list[str]:
    """Where each arm's step goes, by `k3compile report` category (medians of the profiled steps)."""
    cuda = doc["environment"]["device"].get("type") == "cuda"
    key = "gpu_us_by_category" if cuda else "cpu_ops_by_category"
    out = []
    for b in doc["config"]["batches"]:
        rows = [(arm, _row(doc["results"], arm, b)) for arm in doc["config"]["arms"]]  # rungs and anchors
        rows = [(n, r) for n, r in rows if r and r.get(key)]
        if not rows:
            continue
        cats = [c for c in rows[0][1][key] if any(r[key].get(c) for _, r in rows)]
        if cuda:
            out += ["", f"Where the time goes, batch {b} (GPU µs per step by category, kernels in brackets; busy = "
                        "union of kernel time, gaps = idle time between kernels on a stream):", "",
                    "| arm | " + " | ".join(cats) + " | busy µs | span µs | gaps µs |",
                    "|---|" + "---:|" * (len(cats) + 3)]
            for n, r in rows:
                out.append(f"| {n} | " + " | ".join(f"{r[key][c]:.0f} ({r['kernels_by_category'][c]:g})" for c in cats)
                           + f" | {r['gpu_busy_us']:.0f} | {r['gpu_span_us']:.0f} | {r['launch_gap_us']:.0f} |")
        else:
            out += ["", f"Where the ops go, batch {b} (top-level CPU ops per step by category; CPU run):", "",
                    "| arm | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
            for n, r in rows:
                out.append(f"| {n} | " + " | ".join(f"{r[key][c]:g}" for c in cats) + " |")
    return out


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
            for anchor, style in (("eager", "--"), ("compile-reduce-overhead", ":"), (HF_ARM, "-.")):
                y = (_row(doc["results"], anchor, b) or {}).get(key)
                if y is not None:
                    ax.axhline(y, color=line.get_color(), ls=style, lw=0.8)
        ax.set_xticks(range(len(rungs)))
        ax.set_xticklabels(rungs, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == "median_ms":
            ax.set_yscale("log")
    axes[0].legend(title="dashed: eager, dotted: torch.compile, dash-dot: transformers", fontsize=8)
    fig.suptitle(f"decode ladder: {cfg['model']} {cfg['dtype']}, context {cfg['context']} "
                 f"({doc['environment']['device'].get('name')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
