"""k3compile bench decode: decode-step latency, tok/s, launches and % of HBM roofline, per arm and batch.

    k3compile bench decode --model k3-mini-6b --dtype bf16 --batch 1,8,64 --context 512 --out traces/

Protocol (docs/BENCHMARKS.md): every arm is built and warmed up first (>= 20 steps);
then, for each repetition, every arm times >= 200 consecutive steps with CUDA events, arms
interleaved within the repetition; >= 5 repetitions give the median and spread. Each arm's first
output is compared with eager's from the same pool state (max |diff| is reported). Kernel counts
come from a torch.profiler trace of 3 annotated steps (kept under OUT/traces/, readable with
`k3compile report`). The copy bandwidth for the roofline is measured in the same process.

Every request in a batch has the same context length; all steps decode at the same position
(the KV row and state are rewritten each step), so every step does the same work. Pools are
filled with random values so attention and routing see non-degenerate data.

Results: OUT/decode_<model>_<dtype>.json (config, environment, raw samples, summary) and .md,
rewritten after every batch size, so a run stopped by a time limit keeps what it measured.

Time: on a GPU the default --time-budget (560 s) skips arms and repetitions that would start after
it, so one command fits a 10-minute limit. The torch.compile arms compile once each (dynamic=True;
--compile-static compiles per batch size); --bounded-autotune drops max-autotune's per-kernel
coordinate-descent tuning, the part of its compile time that grows with the size of the step.
"""
from __future__ import annotations

import os
import sys
import time

from .deadline import OverBudget, within

DEFAULT_TIME_BUDGET_CUDA = 560.0  # seconds: one GPU command must finish within 10 minutes
MIN_STEPS_PER_REP = 10  # --max-rep-seconds never cuts an arm below this


def register(sub) -> None:
    from k3compile.commands.build import add_pipeline_args

    from .decode_arms import ARMS, DEFAULT_ARMS

    p = sub.add_parser("decode", help="decode step latency / tok/s / launches / roofline across arms")
    p.add_argument("--model", help="preset or checkpoint (default: the engine's source model)")
    p.add_argument("--engine", help="engine directory for the 'engine' arm (default: build one in memory)")
    add_step_bench_args(p)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    p.add_argument("--out", default="traces", help="output folder for JSON, markdown and traces")
    p.add_argument("--compile-static", action="store_true",
                   help="torch.compile arms: specialize per batch size (one compile each) instead of dynamic=True")
    p.add_argument("--bounded-autotune", action="store_true",
                   help="max-autotune arm without coordinate-descent tuning (bounds its compile time)")
    add_pipeline_args(p)
    p.set_defaults(func=run)
    return p


def add_step_bench_args(p) -> None:
    """The flags every decode-step bench shares (bench decode, bench ladder)."""
    p.add_argument("--batch", default="1,8,64", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=512, help="context length of every request")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--steps", type=int, default=200, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps per arm and batch size")
    p.add_argument("--reps", type=int, default=5, help="repetitions (arms interleaved within each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copy-gib", type=float, default=None, help="size of the bandwidth copy (default 4 GiB on "
                                                                 "CUDA, 0.25 on CPU)")
    p.add_argument("--time-budget", type=float, default=None,
                   help=f"seconds; arms not started in time are skipped (default {DEFAULT_TIME_BUDGET_CUDA:.0f} on "
                        f"CUDA, none on CPU)")
    p.add_argument("--max-rep-seconds", type=float, default=None,
                   help="cap one arm's repetition at about this many seconds: a slow arm (eager at 48B: ~60 ms/step) "
                        f"times fewer steps (never fewer than {MIN_STEPS_PER_REP}), estimated from its warm-up; "
                        "each row records the steps it timed (default: no cap, every arm times --steps)")
    p.add_argument("--executor-context", default="bench", choices=["bench", "served"],
                   help="page-table capacity of the executor arms' CUDA graphs: bench = --context (default); served "
                        "= the context `serve` gives the engine by default (the model's, capped at 32768). The MLA "
                        "decode kernel's split count follows it, so 'served' times the launches `serve` replays")
    p.add_argument("--layers", type=int, default=None,
                   help="build only the first N decoder layers of a preset (random weights): a full-size shape's own "
                        "kernels on a card too small for the whole model (the 48B shape on an 80 GB H100); timings, "
                        "kernel counts and the roofline are those of the shorter step, named <preset>-<N>l")
    p.add_argument("--compile-budget", type=float, default=None,
                   help="seconds of torch.compile time (all compile arms and batch sizes together); a compile "
                        "that would start after it is spent, or that the previous one says would overrun it, "
                        "is skipped with the reason, and one still running when it is spent is stopped and its "
                        "arm skipped (default: no separate budget; --time-budget bounds a compile the same way)")


def check_step_bench_args(args):
    """(batch sizes, device) from the shared flags; ConfigError names a bad one."""
    import torch

    from k3compile.model_def.config import ConfigError

    batches = _parse_ints(args.batch, "--batch")
    for name in ("steps", "reps", "context"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1")
    if args.warmup < 0:
        raise ConfigError("--warmup must be >= 0")
    for name in ("max_rep_seconds", "compile_budget"):
        if getattr(args, name, None) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if getattr(args, "layers", None) is not None:
        if getattr(args, "engine", None):
            raise ConfigError("--layers builds a shorter model from a preset; an --engine is built already")
        truncated_preset(args.model, args.layers)  # the ConfigError names what is wrong
    return batches, device


def truncated_preset(name: str, layers: int):
    """The preset's config with only its first `layers` decoder layers (same layer kinds in the same order), named
    <preset>-<layers>l; ConfigError for a checkpoint (its weights name every layer) or a count out of range."""
    import dataclasses

    from k3compile.model_def.config import PRESETS, ConfigError, get_preset, validate

    if name not in PRESETS:
        raise ConfigError(f"--layers takes a preset ({', '.join(PRESETS)}), got '{name}'")
    cfg = get_preset(name)
    if not 1 <= layers <= cfg.num_hidden_layers:
        raise ConfigError(f"--layers must be in 1..{cfg.num_hidden_layers} for '{name}', got {layers}")
    if layers == cfg.num_hidden_layers:
        return cfg
    missing = sorted(set(cfg.layer_types) - set(cfg.layer_types[:layers]))
    if missing:  # a step without one kind of layer is another model (and a pool without pages or slots)
        first = min(cfg.layer_types.index(kind) for kind in missing) + 1
        raise ConfigError(f"--layers {layers} keeps no {'/'.join(k.upper() for k in missing)} layer of '{name}' "
                          f"(the first is layer {first}): use --layers >= {first}")
    cfg = dataclasses.replace(cfg, name=f"{cfg.name}-{layers}l", num_hidden_layers=layers,
                              layer_types=cfg.layer_types[:layers])
    validate(cfg)
    return cfg


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return vals


def run(args) -> int:
    import torch

    from k3compile.model_def.config import ConfigError

    from .decode_arms import ARMS

    batches, device = check_step_bench_args(args)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ConfigError(f"--arms: unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    if "eager" not in arms:
        arms.insert(0, "eager")  # the reference every other arm's output is checked against
    if args.model is None and args.engine is None:
        raise ConfigError("bench decode needs --model or --engine")
    bench = DecodeBench(args, batches, arms, device)
    with torch.no_grad():  # inference: no autograd graph behind any arm
        bench.run()
    return 0


class DecodeBench:
    def __init__(self, args, batches, arms, device):
        import torch

        self.args, self.batches, self.arms, self.device = args, batches, arms, device
        self.start_clock()
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
        self.results: list[dict] = []
        from .decode_arms import ARMS
        self.arm_table = dict(ARMS)  # name -> Arm; a subclass (bench ladder) adds its own arms
        self.bench_name = "decode"  # file stem prefix of the JSON, markdown and traces
        self.compile_spent = 0.0  # seconds spent compiling (torch.compile arms), against --compile-budget
        self.last_compile_s: dict[str, float] = {}  # compile arm -> its last compile time (the next one's estimate)

    def start_clock(self) -> None:
        """--time-budget counts from here (bench ladder restarts it after its transformers process)."""
        self.t0 = time.perf_counter()
        a = self.args
        budget = a.time_budget if a.time_budget is not None else (
            DEFAULT_TIME_BUDGET_CUDA if self.device.type == "cuda" else None)
        self.deadline = None if not budget else self.t0 + budget

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def compile_skip_reason(self, arm: str) -> str | None:
        """Why a torch.compile arm is not compiled at the next batch size, or None. Its last compile time
        estimates the next one (a recompile for a new batch size costs about as much)."""
        budget = getattr(self.args, "compile_budget", None)
        expected = self.last_compile_s.get(arm, 0.0)
        if budget is not None and self.compile_spent + expected > budget:
            return (f"compile budget ({budget:.0f} s) spent: {self.compile_spent:.0f} s compiled so far"
                    + (f", the last compile of this arm took {expected:.0f} s" if expected else ""))
        if self.deadline is not None and expected and time.perf_counter() + expected > self.deadline:
            return f"time budget: the last compile of this arm took {expected:.0f} s, more than is left"
        return None

    def compile_time_left(self) -> float | None:
        """Seconds one compile may still run: what is left of --compile-budget and of --time-budget (None: no
        limit). A compile still running then is stopped (bench/deadline.py) and its arm skipped."""
        left = []
        budget = getattr(self.args, "compile_budget", None)
        if budget is not None:
            left.append(budget - self.compile_spent)
        if self.deadline is not None:
            left.append(self.deadline - time.perf_counter())
        return min(left) if left else None

    # ---- setup ----
    def _load(self):
        import torch

        from k3compile.engine import open_engine
        from k3compile.model_def.config import ConfigError

        a = self.args
        self.engine = None
        if a.engine:
            self.log(f"loading engine {a.engine}")
            opened = open_engine(a.engine, device=self.device)
            self.engine = opened.engine
            if opened.dtype != a.dtype:
                raise ConfigError(f"--dtype {a.dtype}: engine {a.engine} is {opened.dtype}")
        source = a.model or self.engine.manifest["model"]["source"]
        # a preset engine's weights came from its build seed: the model arms use the same weights
        seed = self.engine.manifest.get("build", {}).get("seed", a.seed) if self.engine is not None else a.seed
        self.log(f"loading {source} ({a.dtype}) on {self.device}")
        self.model = load_bench_model(source, self.dtype, self.device, seed, getattr(a, "layers", None))
        self.model_name = self.model.config.name
        torch.manual_seed(a.seed)

    def _allocate(self):
        """One set of pools for the largest batch; smaller batches use its first slots and pages."""
        import torch

        from k3compile.model_def.batch import ForwardBatch
        from k3compile.model_def.cache import CacheTensors

        a = self.args
        page = self.engine.page_size if self.engine is not None else 16
        self.pages_per_req = -(-a.context // page)
        self.spec = self.model.cache_spec()
        bmax = max(self.batches)
        self.cache = CacheTensors.allocate(self.spec, bmax + 1, bmax * self.pages_per_req + 1, page, self.device)
        gen = torch.Generator(device=self.device).manual_seed(a.seed)
        self.cache.kv.normal_(generator=gen)
        self.cache.ssm.normal_(0.0, 0.05, generator=gen)
        self.cache.conv.normal_(0.0, 0.5, generator=gen)
        self.cache_unaliased = None
        if any(arm.startswith("compile") or arm == "engine-inductor" for arm in self.arms):
            self.cache_unaliased = CacheTensors(ssm=self.cache.ssm.clone(), conv=self.cache.conv.clone(),
                                                kv=self.cache.kv.clone(), page_size=page)
        tokens = torch.randint(0, min(self.model.config.vocab_size, 256), (bmax,), generator=gen,
                               device=self.device).tolist()
        self.first_tokens = tokens
        # request r: state slot r + 1, pages 1 + r * pages_per_req ... (slot and page 0 are the padding sinks)
        self.batch_at = lambda ids, pos: ForwardBatch.build(
            "decode", [[t] for t in ids], [pos] * len(ids),
            [list(range(1 + r * self.pages_per_req, 1 + (r + 1) * self.pages_per_req)) for r in range(len(ids))],
            list(range(1, len(ids) + 1)), page, device=self.device)
        self.make_batch = lambda b: self.batch_at(tokens[:b], a.context - 1)

    def _context(self):
        from k3compile.capture import capture_step
        from k3compile.commands.build import pipeline_from_args
        from k3compile.engine.build import compile_graphs

        from .decode_arms import BenchContext

        memo = {}

        def get_engine():
            if "engine" not in memo:
                if self.engine is not None:
                    memo["engine"] = self.engine
                else:
                    self.log("building the engine's decode graph in memory (capture + passes)")
                    graphs, reports = compile_graphs(self.model, pipeline_from_args(self.args), ("decode",),
                                                     log=self.log)
                    memo["engine"], self.pass_reports = graphs, reports
            return memo["engine"]

        def get_unpassed():
            if "unpassed" not in memo:
                self.log("capturing the unpassed decode graph")
                memo["unpassed"] = {"decode": capture_step(self.model, "decode")}
            return memo["unpassed"]

        self.pass_reports = None
        return BenchContext(self.model, self.cache, self.cache_unaliased, self.device, self.args.context, get_engine,
                            get_unpassed, compile_dynamic=not self.args.compile_static,
                            bounded_autotune=self.args.bounded_autotune,
                            executor_context=self.executor_context())

    def executor_context(self) -> int:
        """max_context of the executor arms (--executor-context)."""
        from .decode_arms import served_context

        if getattr(self.args, "executor_context", "bench") == "served":
            return served_context(self.model.config)
        return self.args.context

    # ---- the run ----
    def run(self) -> None:
        from .results import environment
        from .timing import copy_bandwidth, init_profiler_for_cuda_graphs

        a = self.args
        os.makedirs(os.path.join(a.out, "traces"), exist_ok=True)
        if self.device.type == "cuda":
            init_profiler_for_cuda_graphs()
        self._load()
        self._allocate()
        ctx = self._context()
        gib = a.copy_gib if a.copy_gib is not None else (4.0 if self.device.type == "cuda" else 0.25)
        self.log(f"measuring copy bandwidth ({gib:g} GiB)")
        self.bandwidth = copy_bandwidth(int(gib * 2**30), self.device)
        self.log(f"  {self.bandwidth['bytes_per_s'] / 1e9:.0f} GB/s")
        self.env = environment(self.device)
        self.bytes = {}
        stem = self.stem = f"{self.bench_name}_{self.model_name}_{a.dtype}"
        self.json_path, self.md_path = os.path.join(a.out, stem + ".json"), os.path.join(a.out, stem + ".md")
        for b in self.batches:
            self._bench_batch(ctx, b)
            self._write(ctx)
        self.log(f"wrote {self.json_path} and {self.md_path}")
        print(open(self.md_path).read())

    def _bench_batch(self, ctx, b: int) -> None:
        import torch

        from .roofline import roofline_pct, routed_experts, step_bytes
        from .timing import profile_steps, summarize, sync, time_steps

        a = self.args
        batch = self.make_batch(b)
        pools = (self.cache.ssm, self.cache.conv, self.cache.kv)
        snapshot = [t.clone() for t in pools]
        copies = [pools]
        if self.cache_unaliased is not None:
            copies.append((self.cache_unaliased.ssm, self.cache_unaliased.conv, self.cache_unaliased.kv))

        def restore():  # every arm's first step starts from the same pool contents
            for group in copies:
                for t, s in zip(group, snapshot):
                    t.copy_(s)

        # bytes per step, from one eager step's routing
        experts = routed_experts(self.model, lambda: self.model.step(batch, self.cache))
        restore()
        self.bytes[b] = step_bytes(self.model, self.spec, b, a.context, len(set(batch.input_ids.tolist())), experts)
        fns, rows = {}, {}
        reference = None
        for name in self.arms:
            arm = self.arm_table[name]
            row = rows[name] = {"arm": name, "description": arm.description, "batch": b}
            if arm.needs_cuda and self.device.type != "cuda":
                row.update(status="skipped", reason=arm.needs_cuda)
                continue
            if self.out_of_time():
                row.update(status="skipped", reason="time budget exhausted before this arm was set up")
                continue
            compiles = name.startswith("compile")
            if compiles and (why := self.compile_skip_reason(name)):
                row.update(status="skipped", reason=why)
                self.log(f"  {name} skipped: {why}")
                continue
            self.log(f"bs={b}: setting up {name}")
            t_setup = time.perf_counter()
            try:
                with within(self.compile_time_left() if compiles else None, f"{name}'s compile"):
                    fn = arm.make(ctx, batch)
                    restore()
                    out = fn().float().clone()  # first call: compiles / warms up; checked against eager
                    sync(self.device)
                first_s = time.perf_counter() - t_setup
                restore()
                if reference is None:
                    reference = out
                row["max_abs_diff_vs_eager"] = float((out - reference).abs().max())
                if a.warmup:  # the warm-up's mean step time sizes the repetitions (--max-rep-seconds)
                    row["warmup_ms"] = time_steps(fn, a.warmup, self.device)
                sync(self.device)
            except (Exception, OverBudget) as e:  # one broken arm must not lose the others' numbers
                over = isinstance(e, OverBudget)
                row.update(status="skipped" if over else "failed",
                           reason=str(e) if over else f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                self.log(f"  {name} {row['status']}: {row['reason']}")
                if compiles:
                    self.compile_spent += time.perf_counter() - t_setup
                    if over:
                        self.last_compile_s[name] = float("inf")  # no second try at a later batch size
                        _reset_dynamo()
                continue
            row["setup_s"] = round(time.perf_counter() - t_setup, 2)
            if compiles:  # the first call at this batch size compiles (or recompiles) and records its graphs
                row["compile_s"] = round(first_s, 2)
                self.compile_spent += first_s
                self.last_compile_s[name] = first_s
                self.log(f"  {name}: compiled in {first_s:.1f} s ({self.compile_spent:.0f} s of compiling so far)")
            row["steps_per_rep"] = self.steps_per_rep(row.get("warmup_ms"))
            row["status"], row["samples_ms"] = "ok", []
            fns[name] = fn
        self.after_setup(ctx, b, batch, fns, rows, restore)
        for rep in range(a.reps):
            # the first repetition always runs: set-up that spends the budget (cold Triton caches: session 19's
            # H100 call set up 20 arms in 149 of its 150 s) must not leave every arm untimed
            if self.out_of_time():
                if rep > 0:
                    self.log(f"bs={b}: time budget exhausted after {rep} repetitions")
                    break
                self.log(f"bs={b}: time budget spent during set-up: one repetition of the arms set up")
            order = list(fns) if rep % 2 == 0 else list(reversed(fns))  # alternate who goes first
            for name in order:
                rows[name]["samples_ms"].append(time_steps(fns[name], rows[name]["steps_per_rep"], self.device))
            self.log(f"bs={b} rep {rep + 1}/{a.reps}: " + ", ".join(
                f"{n} {rows[n]['samples_ms'][-1]:.3f} ms" for n in fns))
        for row in rows.values():
            if row.get("status") != "ok":
                continue
            if not row["samples_ms"]:
                row.update(status="skipped", reason="time budget exhausted before timing")
                continue
            s = summarize(row["samples_ms"])
            row.update(s)
            row["tok_s"] = b / (s["median_ms"] / 1e3)
            row["roofline_pct"] = roofline_pct(self.bytes[b]["total"], self.bandwidth["bytes_per_s"], s["median_ms"])
        eager = rows.get("eager", {}).get("median_ms")
        for row in rows.values():
            if eager and row.get("median_ms"):
                row["speedup_vs_eager"] = eager / row["median_ms"]
        self.results.extend(rows.values())
        # The timings are on disk before the profiles (kernel counts) are taken: profiling every arm takes tens of
        # seconds after the time budget, and a run stopped then (session 14, call 2) kept no table at all.
        self._write(ctx)
        for name, fn in fns.items():
            trace = os.path.join(a.out, "traces", f"{self.stem}_{name}_bs{b}.json.gz")
            try:
                rows[name].update(profile_steps(fn, 3, self.device, trace))
            except Exception as e:
                rows[name]["profile_error"] = f"{type(e).__name__}: {e}"
        del fns
        restore()
        del snapshot
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def steps_per_rep(self, warmup_ms: float | None) -> int:
        """--steps, or fewer for a slow arm when --max-rep-seconds caps a repetition (never < MIN_STEPS_PER_REP)."""
        cap = getattr(self.args, "max_rep_seconds", None)
        if cap is None or not warmup_ms:
            return self.args.steps
        return max(min(self.args.steps, MIN_STEPS_PER_REP), min(self.args.steps, int(cap * 1e3 / warmup_ms)))

    def after_setup(self, ctx, b: int, batch, fns: dict, rows: dict, restore) -> None:
        """Called once per batch size when every arm is built and warm, before the timed repetitions
        (bench ladder runs its accuracy gate here). `restore()` resets the pools."""

    # ---- output ----
    def _protocol(self) -> dict:
        a = self.args
        steps = [r["steps_per_rep"] for r in self.results if r.get("steps_per_rep")]
        fewest = min(steps, default=a.steps)
        timed = [len(r["samples_ms"]) for r in self.results if r.get("samples_ms")]
        fewest_reps = min(timed, default=a.reps)  # fewer than --reps where the time budget ran out
        ok = fewest >= 200 and a.warmup >= 20 and min(a.reps, fewest_reps) >= 5
        return {"steps": a.steps, "fewest_steps_per_rep": fewest, "max_rep_seconds": getattr(a, "max_rep_seconds", None),
                "warmup": a.warmup, "reps": a.reps, "fewest_reps_timed": fewest_reps, "timer": "cuda events" if
                self.device.type == "cuda" else "perf_counter", "meets_benchmarks_md": ok,
                "interleaving": "arms alternate within each repetition (order reversed every other one)"}

    def _measured(self) -> dict:
        """The parts of a results file every decode-step bench writes the same way."""
        from .roofline import FORMULA

        return {"protocol": self._protocol(), "environment": self.env, "copy_bandwidth": self.bandwidth,
                "roofline_formula": FORMULA, "bytes_per_step": {str(k): v for k, v in self.bytes.items()}}

    def _write(self, ctx) -> None:
        from .results import write_json

        a = self.args
        doc = {"bench": "decode",
               "config": {"model": self.model_name, "engine": a.engine, "dtype": a.dtype, "batches": self.batches,
                          "context": a.context, "executor_context": self.executor_context(), "arms": self.arms,
                          "seed": a.seed, "passes": a.passes,
                          "disable_pass": a.disable_pass, "enable_pass": a.enable_pass, "pass_opt": a.pass_opt,
                          "pass_config": a.pass_config,
                          "compile": ctx.notes, "command": " ".join(sys.argv)},
               **self._measured(),
               "engine_passes": self.pass_reports if self.engine is None else self.engine.manifest.get("passes"),
               "results": self.results,
               "elapsed_s": round(time.perf_counter() - self.t0, 1)}
        write_json(self.json_path, doc)
        with open(self.md_path, "w") as f:
            f.write(render_markdown(doc))


def load_bench_model(source: str, dtype, device, seed: int, layers: int | None = None):
    """The model a bench times: `load_model`, except that a full-size preset (kimi-linear-48b, k3), which
    `load_model` only builds on the meta device, gets random weights on a CUDA device: benches measure
    shapes, and random bf16 weights at the real shape move the same bytes as a checkpoint. `layers`: only the
    preset's first layers (`truncated_preset`), random weights."""
    from k3compile.model_def.config import META_ONLY_PRESETS, ConfigError, get_preset
    from k3compile.model_def.init import init_random
    from k3compile.model_def.loader import build_model, load_model

    if source not in META_ONLY_PRESETS and layers is None:
        return load_model(source, dtype=dtype, device=device, seed=seed, progress=False)
    if source in META_ONLY_PRESETS and device.type != "cuda":
        raise ConfigError(f"preset '{source}' is full size: benches build it with random weights on a CUDA "
                          f"device only (got --device {device.type})")
    model = build_model(get_preset(source) if layers is None else truncated_preset(source, layers), dtype, device)
    init_random(model, seed)
    return model


def markdown_header(doc: dict, title: str) -> list[str]:
    """Title, device, protocol, bandwidth and the CPU caveat: the head of every decode-step bench table."""
    env, cfg, proto = doc["environment"], doc["config"], doc["protocol"]
    dev = env["device"]
    lines = [f"# {title}: {cfg['model']} {cfg['dtype']}, context {cfg['context']}", "",
             f"Device: {dev.get('name')} ({dev.get('type')}); torch {env['torch']}, triton {env.get('triton')}; "
             f"commit {env.get('git_commit')}.",
             f"Protocol: {proto['warmup']} warm-up steps, {proto['reps']} reps x {proto['steps']} steps "
             f"({proto['timer']}), arms interleaved"
             + (f"; a repetition capped at ~{proto['max_rep_seconds']:g} s (slow arms time fewer steps, at least "
                f"{proto.get('fewest_steps_per_rep')} here; see steps_per_rep in the JSON)"
                if proto.get("max_rep_seconds") else "")
             + ("" if proto["meets_benchmarks_md"] else " — **below the docs/BENCHMARKS.md minimums (smoke run)**") + ".",
             f"Copy bandwidth (same process): {doc['copy_bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s "
             f"({doc['copy_bandwidth']['formula']}).", ""]
    if dev.get("type") != "cuda":
        lines += ["CPU run: times are for relative comparisons only (docs/BENCHMARKS.md rule 7); kernel counts are "
                  "replaced by top-level CPU ops per step.", ""]
    return lines


def reps_mark(row: dict, reps: int) -> str:
    """' [n of N reps]' after a timing cell whose row the time budget cut short, else ''."""
    n = len(row.get("samples_ms") or [])
    return f" [{n} of {reps} reps]" if 0 < n < reps else ""


def render_markdown(doc: dict) -> str:
    cfg = doc["config"]
    lines = markdown_header(doc, "decode")
    lines += ["| arm | batch | median ms | p10–p90 ms | tok/s | kernels/step | CPU ops/step | % HBM roofline | "
              "vs eager | max abs diff vs eager |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["results"]:
        if r.get("status") != "ok" or "median_ms" not in r:
            lines.append(f"| {r['arm']} | {r['batch']} | {r.get('status')}: {r.get('reason', '')} | | | | | | | |")
            continue
        lines.append(
            f"| {r['arm']} | {r['batch']} | {r['median_ms']:.3f}{reps_mark(r, doc['protocol']['reps'])} | "
            f"{r['p10_ms']:.3f}–{r['p90_ms']:.3f} | "
            f"{r['tok_s']:.1f} | {_n(r.get('kernels_per_step'))} | {_n(r.get('cpu_ops_per_step'))} | "
            f"{r['roofline_pct']:.1f} | {r.get('speedup_vs_eager', 0):.2f}x | "
            f"{r.get('max_abs_diff_vs_eager', 0):.2e} |")
    lines += ["", f"% HBM roofline: {doc['roofline_formula']}.", "", "Bytes per step:", ""]
    for b, d in doc["bytes_per_step"].items():
        lines.append(f"- batch {b}: {d['total'] / 1e6:.1f} MB = dense weights {d['dense_weights'] / 1e6:.1f} + routed "
                     f"experts {d['routed_expert_weights'] / 1e6:.1f} + embedding rows {d['embedding_rows'] / 1e6:.3f}"
                     f" + KV read {d['kv_read'] / 1e6:.1f} + KV write {d['kv_write'] / 1e6:.3f} + state "
                     f"{d['state_read_write'] / 1e6:.1f}")
    lines += ["", f"Command: `{cfg['command']}`", ""]
    return "\n".join(lines)


def _n(v) -> str:
    return "–" if v is None else f"{v:g}"


def _reset_dynamo() -> None:
    """After a compile stopped half-way: drop what Dynamo cached, so later arms do not reuse a partial state."""
    try:
        import torch._dynamo
        torch._dynamo.reset()
    except Exception:  # (a failed reset costs only the caches)
        pass
