"""k3compile bench cache-pressure: cache policies on traces that tell them apart (issue 15).

    k3compile bench cache-pressure --traces agent,tot --seeds 1,2 --budgets-kib 65536,6144,3072 --out traces/cache_pressure

Replays parameterized traces (bench/cache_traces.py: chat sessions with minutes of think time,
agent tool loops over a long shared prefix, tree-of-thought forks, one-off traffic with repeats,
all interleaved in simulated time) through the real engine (LLMEngine) at the engine's default
chunk size and track interval, once per (trace, seed, memory budget, policy). Same engine, same
model, same budget for every policy: checkpoints compete with running requests for the memory,
so at tight budgets eviction decides the result.

Simulated time: every engine step costs `step_ms + token_ms * tokens computed in it` (a relative
cost model, not a measurement: the CPU's own timings are not used); an idle engine jumps to the
next arrival. TTFT = first token's time - arrival time, in simulated seconds and in engine steps.

Per row: token hit rate (prompt tokens served from the cache at first admission / prompt tokens),
the KV-only bound on the same request order (a pure-attention radix cache with unlimited memory,
cache_workload.kv_only_bound) and the fraction of it reached, prefill tokens saved against no
cache at the same budget, checkpoint bytes (mean over steps and peak), mean / p90 TTFT, how many
exact repeats and shared-stem roots hit, retractions, and whether greedy outputs equal the
no-cache run's. Results: OUT/cache_pressure.json and .md; the goals of issue 15 are evaluated on
the tightest budget of the agent and tot traces.
"""
from __future__ import annotations

import heapq
import os
import statistics
import time
from dataclasses import asdict, replace

DEFAULT_POLICIES = "none,end,every_chunk,sparse,valued"
GOAL_OF_BOUND, GOAL_ABOVE_END, GOAL_BYTES_VS_DENSE = 0.90, 0.10, 0.25


def register(sub) -> None:
    p = sub.add_parser("cache-pressure", help="cache policies on realistic traces under memory pressure "
                                              "(hit rate vs KV-only bound, bytes, TTFT at equal memory)")
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--traces", default="agent,tot", help="presets from cache_traces.PRESETS")
    p.add_argument("--seeds", default="1,2", help="trace seeds to report (tune on another: 0)")
    p.add_argument("--budgets-kib", default="65536,6144,3072", help="KV + state memory budgets, generous to tight")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="names or name:key=val (see bench cache)")
    p.add_argument("--roots", type=int, default=24, help="root requests per trace")
    p.add_argument("--duration", type=float, default=300.0, help="seconds over which roots arrive")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=None, help="default: the engine's")
    p.add_argument("--track-interval", type=int, default=None, help="default: the engine's")
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--step-ms", type=float, default=10.0, help="simulated cost of a step")
    p.add_argument("--token-ms", type=float, default=0.05, help="simulated cost per token computed")
    p.add_argument("--out", default=None,
                   help="output folder (default: a fresh bench_out/cache-pressure-<UTC time>, so that committed "
                        "results under traces/ are not overwritten by accident)")
    p.set_defaults(func=run)
    return p


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None


def replay(engine, roots, step_ms: float, token_ms: float) -> dict:
    """Drive the engine through the trace in simulated time."""
    from k3compile.runtime.sampling import SamplingParams

    pending, order = [], 0
    for r in roots:
        heapq.heappush(pending, (r.arrival, order, r.req, []))
        order += 1
    live, events, outputs, cached, tags = {}, [], {}, {}, {}
    arrival, arrival_step, first_time, first_step = {}, {}, {}, {}
    ckpt_bytes, now, step = [], 0.0, 0
    done = engine.metrics()["prefill_tokens"] + engine.metrics()["generated_tokens"]
    while pending or engine.has_unfinished():
        if not engine.has_unfinished() and pending[0][0] > now:
            now = pending[0][0]  # idle: jump to the next arrival
        while pending and pending[0][0] <= now:
            t, _, req, ctx = heapq.heappop(pending)
            prompt = ctx + req.user
            engine.add_request(req.tid, prompt, SamplingParams(max_new_tokens=req.max_new_tokens, ignore_eos=True))
            live[req.tid] = (req, prompt, [])
            arrival[req.tid], arrival_step[req.tid], tags[req.tid] = t, step, req.tags
            events.append(("submit", req.tid, prompt))
        outs = engine.step()
        m = engine.metrics()
        work = m["prefill_tokens"] + m["generated_tokens"]
        now += (step_ms + token_ms * (work - done)) / 1000.0
        done = work
        step += 1
        ckpt_bytes.append(m["checkpoint_bytes"])
        for o in outs:
            req, prompt, out = live[o.rid]
            if o.new_token_ids and o.rid not in first_time:
                first_time[o.rid], first_step[o.rid] = now, step - arrival_step[o.rid]  # steps it waited
            out.extend(o.new_token_ids)
            if o.finished:
                del live[o.rid]
                outputs[o.rid], cached[o.rid] = out, o.cached_tokens
                events.append(("finish", o.rid, prompt + out))
                for child in req.children:
                    heapq.heappush(pending, (now + child.think, order, child, prompt + out))
                    order += 1
    ttft = [first_time[r] - arrival[r] for r in first_time]
    return {"events": events, "outputs": outputs, "cached": cached, "tags": tags, "ttft": ttft,
            "ttft_steps": list(first_step.values()), "checkpoint_bytes": ckpt_bytes, "steps": step, "sim_seconds": now}


def run_one(args, model, policy, roots, budget: int) -> dict:
    from k3compile.runtime.engine import EngineArgs, LLMEngine

    from .cache_workload import kv_only_bound

    defaults = EngineArgs()
    eargs = EngineArgs(model=args.model, dtype=args.dtype, device=args.device, page_size=args.page_size,
                       chunk_size=args.chunk_size or defaults.chunk_size,
                       track_interval=args.track_interval or defaults.track_interval,
                       max_batch_tokens=args.max_batch_tokens, memory_bytes=budget, cache_policy=policy)
    engine = LLMEngine(eargs, model=model)
    t0 = time.perf_counter()
    r = replay(engine, roots, args.step_ms, args.token_ms)
    wall = time.perf_counter() - t0
    m, st = engine.metrics(), engine.cache.stats()
    engine.close()
    bound = kv_only_bound(r["events"], args.page_size)
    tagged = lambda tag: [rid for rid, t in r["tags"].items() if tag in t]  # noqa: E731
    hits = lambda rids: sum(1 for rid in rids if r["cached"].get(rid, 0) > 0)  # noqa: E731
    steps_ttft = sorted(r["ttft"])
    return {
        "policy": policy.name, "budget_bytes": budget, "requests": len(r["outputs"]),
        "slots_total": m["slots_total"], "pages_total": m["pages_total"], "max_running": m["max_running"],
        "prompt_tokens": m["prompt_tokens"], "hit_tokens": m["cache_hit_tokens"], "hit_rate": m["cache_hit_rate"],
        "kv_only_bound": bound["hit_rate"],
        "fraction_of_bound": m["cache_hit_rate"] / bound["hit_rate"] if bound["hit_rate"] else 0.0,
        "prefill_tokens_computed": m["prefill_tokens"], "retractions": m["retractions"],
        "checkpoint_bytes_mean": sum(r["checkpoint_bytes"]) / max(1, len(r["checkpoint_bytes"])),
        "checkpoint_bytes_peak": st.peak_checkpoint_bytes, "checkpoints_stored": st.checkpoints_stored,
        "checkpoints_evicted": st.checkpoints_evicted, "pages_evicted": st.pages_evicted,
        "ttft_mean_s": statistics.fmean(steps_ttft) if steps_ttft else 0.0,
        "ttft_p90_s": steps_ttft[int(0.9 * (len(steps_ttft) - 1))] if steps_ttft else 0.0,
        "ttft_mean_steps": statistics.fmean(r["ttft_steps"]) if r["ttft_steps"] else 0.0,
        "repeats": len(tagged("repeat")), "repeats_hit": hits(tagged("repeat")),
        "stems": len(tagged("stem")), "stems_hit": hits(tagged("stem")),
        "engine_steps": r["steps"], "sim_seconds": r["sim_seconds"], "wall_seconds": wall,
        "_outputs": r["outputs"],
    }


def run(args) -> int:
    import torch

    from k3compile.info import DTYPES
    from k3compile.model_def.loader import load_model

    from .cache import parse_policy, split_policies
    from .cache_traces import PRESETS, TraceSpec, count, make_trace
    from .results import environment, fresh_out_dir, write_json

    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    for t in traces:
        if t not in PRESETS:
            raise ValueError(f"unknown trace {t!r}; known: {', '.join(PRESETS)}")
    seeds, budgets = _ints(args.seeds, "--seeds"), [b << 10 for b in _ints(args.budgets_kib, "--budgets-kib")]
    policies = [parse_policy(p) for p in split_policies(args.policies)]
    model = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device, progress=False)
    args.out = fresh_out_dir("cache-pressure", args.out)
    env = environment(torch.device(args.device))
    save = lambda rs: _save(args, rs, env, write_json)  # noqa: E731
    rows, md = [], ""
    for trace in traces:
        for seed in seeds:
            spec = TraceSpec(mix=PRESETS[trace], roots=args.roots, duration=args.duration, seed=seed)
            roots = make_trace(spec)
            print(f"{trace} seed {seed}: {count(roots)} requests", flush=True)
            for budget in budgets:
                group = []
                for policy in policies:
                    res = run_one(args, model, policy, roots, budget)
                    res.update(trace=trace, seed=seed)
                    group.append(res)
                    print(f"  {budget >> 10} KiB {policy.name}: hit {res['hit_rate']:.3f} (bound "
                          f"{res['kv_only_bound']:.3f}), ckpt mean {res['checkpoint_bytes_mean']:.0f} B, "
                          f"TTFT {res['ttft_mean_s']:.3f} s, {res['wall_seconds']:.0f} s wall", flush=True)
                    md = save(rows + _relate(group))  # after every run: a long sweep keeps what it has
                rows.extend(_relate(group))
    print(md)
    return 0


def _save(args, rows, environment, write_json) -> str:
    from .cache_traces import TraceSpec

    doc = {"bench": "cache-pressure", "rows": rows, "goals": goals(rows),
           "args": {k: v for k, v in vars(args).items() if k != "func"},
           "trace_spec": asdict(replace(TraceSpec(), roots=args.roots, duration=args.duration))}
    doc["environment"] = environment
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "cache_pressure.json"), doc)
    md = render_markdown(doc)
    with open(os.path.join(args.out, "cache_pressure.md"), "w") as f:
        f.write(md)
    return md


def _relate(group: list[dict]) -> list[dict]:
    """Fill in what each row is compared with: no cache (tokens saved, outputs) and every_chunk (bytes)."""
    none = next((r for r in group if r["policy"] == "none"), None)
    dense = next((r for r in group if r["policy"] == "every_chunk"), None)
    out = []
    for r in group:
        row = {k: v for k, v in r.items() if not k.startswith("_")}
        row["prefill_tokens_saved"] = none["prefill_tokens_computed"] - r["prefill_tokens_computed"] if none else None
        row["outputs_match"] = r["_outputs"] == none["_outputs"] if none else None
        row["bytes_vs_every_chunk"] = (r["checkpoint_bytes_mean"] / dense["checkpoint_bytes_mean"]
                                       if dense and dense["checkpoint_bytes_mean"] else None)
        out.append(row)
    return out


def goals(rows: list[dict], policy: str = "valued") -> list[dict]:
    """Issue 15's goals on the tightest budget of the agent and tot traces, per seed."""
    out = []
    for trace in ("agent", "tot"):
        mine = [r for r in rows if r["trace"] == trace]
        if not mine:
            continue
        tight = min(r["budget_bytes"] for r in mine)
        for seed in sorted({r["seed"] for r in mine}):
            at = {r["policy"]: r for r in mine if r["seed"] == seed and r["budget_bytes"] == tight}
            new, end = at.get(policy), at.get("end")
            if new is None:
                continue
            g = {"trace": trace, "seed": seed, "budget_bytes": tight, "fraction_of_bound": new["fraction_of_bound"],
                 "points_above_end": (new["hit_rate"] - end["hit_rate"]) / new["kv_only_bound"] if end else None,
                 "bytes_vs_every_chunk": new["bytes_vs_every_chunk"],
                 "repeats_hit": f"{new['repeats_hit']}/{new['repeats']}", "stems_hit": f"{new['stems_hit']}/{new['stems']}"}
            g["met"] = bool(g["fraction_of_bound"] >= GOAL_OF_BOUND and g["points_above_end"] is not None
                            and g["points_above_end"] >= GOAL_ABOVE_END and g["bytes_vs_every_chunk"] is not None
                            and g["bytes_vs_every_chunk"] <= GOAL_BYTES_VS_DENSE
                            and new["repeats_hit"] == new["repeats"] and new["stems_hit"] == new["stems"])
            out.append(g)
    return out


def render_markdown(doc: dict) -> str:
    a = doc["args"]
    lines = ["# bench cache-pressure", "",
             f"Model {a['model']} on {a['device']}, page {a['page_size']}, chunk {a['chunk_size'] or 'engine default'}, "
             f"track interval {a['track_interval'] or 'engine default'}; {a['roots']} roots over {a['duration']:.0f} s "
             f"simulated; step cost {a['step_ms']} ms + {a['token_ms']} ms/token (simulated, relative only).",
             "Hit rate = prompt tokens served from the cache / prompt tokens; bound = KV-only radix cache with "
             "unlimited memory on the same request order; bytes = mean checkpoint bytes over steps.", "",
             "| trace | seed | budget | policy | hit rate | bound | of bound | prefill saved | ckpt bytes mean | "
             "peak | vs every_chunk | TTFT mean s | TTFT p90 s | TTFT steps | repeats hit | stems hit | retractions "
             "| outputs match |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(
            f"| {r['trace']} | {r['seed']} | {r['budget_bytes'] >> 10} KiB | {r['policy']} | {r['hit_rate']:.3f} | "
            f"{r['kv_only_bound']:.3f} | {r['fraction_of_bound']:.1%} | {r['prefill_tokens_saved']} | "
            f"{r['checkpoint_bytes_mean'] / 1024:.0f} KiB | {r['checkpoint_bytes_peak'] / 1024:.0f} KiB | "
            f"{'-' if r['bytes_vs_every_chunk'] is None else format(r['bytes_vs_every_chunk'], '.1%')} | "
            f"{r['ttft_mean_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['ttft_mean_steps']:.1f} | "
            f"{r['repeats_hit']}/{r['repeats']} | {r['stems_hit']}/{r['stems']} | {r['retractions']} | "
            f"{'yes' if r['outputs_match'] else ('-' if r['outputs_match'] is None else '**NO**')} |")
    lines += ["", f"Goals (tightest budget; `valued` >= {GOAL_OF_BOUND:.0%} of the bound, >= "
                  f"{GOAL_ABOVE_END * 100:.0f} points of the bound above `end`, <= {GOAL_BYTES_VS_DENSE:.0%} of "
                  f"every_chunk's mean checkpoint bytes, every repeat and shared stem hits):", "",
              "| trace | seed | of bound | points above end | bytes vs every_chunk | repeats hit | stems hit | met |",
              "|---|---|---|---|---|---|---|---|"]
    for g in doc["goals"]:
        lines.append(f"| {g['trace']} | {g['seed']} | {g['fraction_of_bound']:.1%} | "
                     f"{'-' if g['points_above_end'] is None else format(g['points_above_end'] * 100, '.1f')} | "
                     f"{'-' if g['bytes_vs_every_chunk'] is None else format(g['bytes_vs_every_chunk'], '.1%')} | "
                     f"{g['repeats_hit']} | {g['stems_hit']} | {'**yes**' if g['met'] else 'no'} |")
    lines += ["", "CPU run: token counts and bytes are exact; times are simulated by the step cost model above.", ""]
    return "\n".join(lines)
