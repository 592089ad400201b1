"""k3compile bench memory: unified arena vs two split pools at one memory budget (issue 5).

Two parts, both comparing `unified`, the split at the default ratio (SGLang's
--mamba-full-memory-ratio 0.9, i.e. 47.4% of the budget to state) and the best split chosen in
hindsight per workload (a sweep of the state fraction):

* engine: the real scheduler and allocator (k3-tiny on CPU by default; prefix cache off so every
  running request holds exactly its own slot and pages) replay three workloads -- many short chats,
  a few very long contexts, and a mix that shifts from the first to the second. Reported: max
  concurrent requests, tokens served (prefill + decode) before the first retraction, retractions,
  steps to drain the workload. Time is counted in scheduler steps, not seconds.
* allocator: the allocator alone with K3's real byte sizes at TP 8 (runtime/memory/capacity_sim.py,
  bookkeeping on the meta device), the same three workload shapes at full scale.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

from k3compile.bench.results import environment, fresh_out_dir, write_json
from k3compile.runtime.memory.pools import DEFAULT_STATE_FRACTION  # SGLang's ratio 0.9 -> 0.9 / 1.9
from k3compile.runtime.scheduler import DEFAULT_RESERVE_RATIO
MINI_BUDGET = 96 << 30  # KV + state of k3-mini-6b on one 141 GB H200 after weights and activations
SWEEP = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def register(sub) -> None:
    p = sub.add_parser("memory", help="unified memory vs split pools: capacity per workload")
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--budget-kib", type=int, default=1024, help="KV + state budget of the engine runs")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--scale", type=float, default=1.0, help="workload size multiplier for the engine runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", default=",".join(map(str, SWEEP)), help="state fractions tried for hindsight")
    p.add_argument("--reserve-ratio", type=float, default=None,
                   help="share of remaining output admission reserves pages for (default: the scheduler's 0.7)")
    p.add_argument("--skip-allocator", action="store_true", help="skip the K3-sized allocator-only part")
    p.add_argument("--out", default=None, help="output folder (default: a fresh bench_out/memory-<UTC time>)")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Job:
    arrival_step: int
    prompt_len: int
    output_len: int


def workloads(seed: int = 0, scale: float = 1.0) -> dict[str, list[Job]]:
    """k3-tiny-sized versions of the three shapes. A k3-tiny state slot weighs as much as ~110 tokens
    of KV, so 'short' prompts (16-64) are state-heavy and 'long' ones (600-1500) KV-heavy."""
    rng = random.Random(seed)

    def jobs(n, per_step, draw):
        out, t = [], 0.0
        for i in range(max(1, int(n * scale))):
            t += rng.expovariate(per_step)
            p, o = draw(i, max(1, int(n * scale)))
            out.append(Job(int(t), p, o))
        return out

    short = lambda i, n: (rng.randint(16, 64), rng.randint(8, 32))  # noqa: E731
    long = lambda i, n: (rng.randint(600, 1500), rng.randint(16, 48))  # noqa: E731
    return {
        "short_chats": jobs(160, 8.0, short),
        "long_contexts": jobs(10, 0.5, long),
        "shifting_mix": jobs(120, 4.0, lambda i, n: long(i, n) if rng.random() < 0.25 * i / n else short(i, n)),
    }


def run_engine(model, jobs: list[Job], budget: int, page_size: int, unified: bool, state_fraction: float | None,
               max_steps: int = 20000, reserve_ratio: float | None = None) -> dict:
    """Replay `jobs` through a fresh LLMEngine; returns capacity figures or None if the split cannot be built."""
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    from k3compile.runtime.sampling import SamplingParams

    args = EngineArgs(model=None, page_size=page_size, chunk_size=256, max_batch_tokens=4096, max_running=512,
                      memory_bytes=budget, state_fraction=state_fraction, enable_unified_memory=unified,
                      enable_prefix_cache=False,  # max_context: what the KV side of this memory can hold
                      decode_reserve_ratio=reserve_ratio)
    try:
        eng = LLMEngine(args, model=model, eos_token_id=-1)
    except ValueError as e:  # a split with fewer than 2 slots or pages
        return {"error": str(e)}
    rng = random.Random(1)
    pending = sorted(jobs, key=lambda j: j.arrival_step)
    max_running, tokens_before_retraction, first_retraction_step, step = 0, None, None, 0
    rejected = 0
    try:
        while (pending or eng.has_unfinished()) and step < max_steps:
            while pending and pending[0].arrival_step <= step:
                j = pending.pop(0)
                prompt = [rng.randrange(256) for _ in range(j.prompt_len)]
                try:
                    eng.add_request(f"r{len(jobs) - len(pending)}", prompt,
                                    SamplingParams(max_new_tokens=j.output_len, ignore_eos=True))
                except ValueError:
                    rejected += 1  # does not fit even into empty memory
            eng.step()
            m = eng.metrics()
            max_running = max(max_running, m["running"])
            if m["retractions"] and tokens_before_retraction is None:
                tokens_before_retraction = m["prefill_tokens"] + m["generated_tokens"]
                first_retraction_step = step
            step += 1
        m = eng.metrics()
    finally:
        eng.close()
    served = m["prefill_tokens"] + m["generated_tokens"]
    return {"max_concurrent": max_running, "tokens_before_first_retraction": tokens_before_retraction or served,
            "first_retraction_step": first_retraction_step, "retractions": m["retractions"], "steps": step,
            "tokens_served": served, "rejected": rejected, "drained": step < max_steps}


def compare(model, jobs, budget, page_size, sweep, reserve_ratio: float | None = None, on_run=None) -> dict:
    def run(unified, f):
        result = run_engine(model, jobs, budget, page_size, unified, f, reserve_ratio=reserve_ratio)
        if on_run is not None:
            on_run()
        return result
    unified = run(True, None)
    default = run(False, DEFAULT_STATE_FRACTION)
    splits = {f: run(False, f) for f in sweep}
    # a split whose KV pool cannot hold some request at all is not a way to serve the workload
    ok = {f: r for f, r in splits.items() if "error" not in r and r["rejected"] == 0 and r["drained"]}

    def best(metric, larger=True):
        if not ok:
            return None
        f = (max if larger else min)(ok, key=lambda k: ok[k][metric])
        return {"state_fraction": f, metric: ok[f][metric]}
    return {"unified": unified, "default_split": default | {"state_fraction": DEFAULT_STATE_FRACTION},
            "splits": {str(f): r for f, r in splits.items()},
            "best_split": {"max_concurrent": best("max_concurrent"),
                           "tokens_before_first_retraction": best("tokens_before_first_retraction"),
                           "steps": best("steps", larger=False)}}


def run(args) -> int:
    from k3compile.model_def.loader import load_model

    torch.set_num_threads(1)  # tiny model: intra-op threads only cost
    model = load_model(args.model, progress=False)
    sweep = tuple(float(x) for x in args.sweep.split(","))
    budget = args.budget_kib * 1024
    doc = {"bench": "memory", "config": {k: v for k, v in vars(args).items() if k != "func"},
           "environment": environment(torch.device("cpu")), "engine": {}, "allocator": None}
    spec = model.cache_spec()
    doc["engine_sizes"] = {"slot_bytes": spec.slot_bytes, "page_bytes": spec.page_bytes(args.page_size)}
    base = os.path.join(fresh_out_dir("memory", args.out), f"memory_{args.model}")
    loads = workloads(args.seed, args.scale)
    from tqdm import tqdm
    with tqdm(total=len(loads) * (2 + len(sweep)), desc="bench memory: engine runs", unit="run") as bar:
        for name, jobs in loads.items():
            bar.set_postfix_str(f"{name}, {len(jobs)} requests")
            doc["engine"][name] = compare(model, jobs, budget, args.page_size, sweep, args.reserve_ratio, bar.update)
            _write(base, doc)   # results as they come: a long run stopped early keeps what it measured
    if not args.skip_allocator:
        from k3compile.runtime.memory.capacity_sim import k3_spec, run_capacity_benchmark
        print("[memory] allocator-only runs at K3 sizes (TP 8)", flush=True)
        doc["allocator"] = run_capacity_benchmark(seed=args.seed)
        print("[memory] allocator-only runs at k3-mini-6b sizes (one GPU)", flush=True)
        doc["allocator_mini"] = run_capacity_benchmark(spec=k3_spec(1, "k3-mini-6b"), budget_bytes=MINI_BUDGET,
                                                       seed=args.seed)
        doc["allocator_mini"]["model"] = "k3-mini-6b at TP 1"
    print(_write(base, doc))
    print(f"wrote {base}.json and {base}.md")
    return 0


def _write(base: str, doc: dict) -> str:
    write_json(base + ".json", doc)
    md = render(doc)
    with open(base + ".md", "w") as f:
        f.write(md)
    return md


def _cell(r: dict | None, key: str) -> str:
    if r is None:
        return "–"
    if "error" in r:
        return "n/a"
    return str(r.get(key))


def render(doc: dict) -> str:
    c = doc["config"]
    lines = [f"# bench memory: unified arena vs split pools ({c['model']}, budget {c['budget_kib']} KiB, "
             f"page {c['page_size']})", "",
             f"Engine runs (real scheduler + allocator, CPU, prefix cache off; slot {doc['engine_sizes']['slot_bytes']} B, "
             f"page {doc['engine_sizes']['page_bytes']} B). Default split = state fraction "
             f"{DEFAULT_STATE_FRACTION:.3f} (SGLang's ratio 0.9); best split = best of the sweep per metric, in "
             f"hindsight among splits that serve every request (a KV pool too small for a long prompt rejects it). "
             f"Admission reserves pages for {c.get('reserve_ratio') or DEFAULT_RESERVE_RATIO} of each request's remaining output. "
             f"Counts and steps are exact; no times.", "",
             "| workload | metric | unified | default split | best split (fraction) | unified / best | unified / default |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, r in doc["engine"].items():
        for metric, larger in (("max_concurrent", True), ("tokens_before_first_retraction", True),
                               ("steps", False)):
            u, d, b = r["unified"], r["default_split"], r["best_split"][metric]
            uv, dv = u.get(metric), d.get(metric)
            bv = b[metric] if b else None

            def ratio(x, y):
                if not x or not y:
                    return "–"
                return f"{(x / y if larger else y / x):.2f}x"
            lines.append(f"| {name} | {metric} | {uv} | {_cell(d, metric)} | "
                         f"{bv} ({b['state_fraction'] if b else '–'}) | {ratio(uv, bv)} | {ratio(uv, dv)} |")
    lines += ["", "(For `steps`, lower is better and the ratios are inverted so that > 1 favours unified.)", ""]
    if doc.get("allocator"):
        lines += render_allocator(doc["allocator"])
    if doc.get("allocator_mini"):
        lines += [""] + render_allocator(doc["allocator_mini"])
    return "\n".join(lines) + "\n"


def render_allocator(a: dict) -> list[str]:
    gib = a["budget_bytes"] / 2**30
    lines = [f"## Allocator alone, {a.get('model', 'K3 at TP 8')} byte sizes", "",
             f"Budget {gib:.0f} GiB, page {a['page_size']} tokens (slot {a['slot_bytes'] / 1e6:.1f} MB, page "
             f"{a['page_bytes'] / 1e6:.2f} MB), decode-growth reservation {a['reserve_ratio']}; "
             "runtime/memory/capacity_sim.py (bookkeeping on the meta device).", "",
             "| workload | metric | unified | default split | best split (fraction) | unified / best | unified / default |",
             "|---|---|---:|---:|---:|---:|---:|"]
    fmt = lambda v: "–" if v is None else (f"{v:.2f}x" if isinstance(v, float) else str(v))  # noqa: E731
    for name, w in a["workloads"].items():
        for metric, best in w["split_best"].items():
            lines.append(f"| {name} | {metric} | {w['unified'][metric]} | {w['split_default'][metric]} | "
                         f"{best['value']} ({best['state_fraction']}) | {fmt(w['unified_vs_best'][metric])} | "
                         f"{fmt(w['unified_vs_default'][metric])} |")
    return lines
