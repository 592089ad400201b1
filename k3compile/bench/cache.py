"""k3compile bench cache: prefix-cache policies replayed through the real engine on one session trace.

    k3compile bench cache --model k3-tiny          # results in a fresh bench_out/cache-<time>/

Replays a generated workload (bench/cache_workload.py: multi-turn sessions over shared system
prompts, tree-of-thought forks) through LLMEngine once per cache policy, same model, same engine
settings, and reports per policy: token hit rate (prompt tokens served from the cache at first
admission / prompt tokens), prefill tokens saved against no cache, and the bytes of KDA state
checkpoints the tree holds (peak, and mean over engine steps), next to the hit rate a KV-only radix
cache could reach on the same trace (the upper bound, see cache_workload.kv_only_bound).

Policies are names from runtime/cache_policy.py, optionally with overrides, e.g.
`sparse:per_path=2,handover=0` (keys: chunks, decode, handover, finish, branch, tail, per_path,
total, weight (the `valued` eviction's value_weight, a float); 0 turns a flag off / removes a cap). Every policy must produce the same greedy tokens
(checked: `outputs_match`).

Memory is sized so that nothing is evicted for lack of room (reported: checkpoints evicted by
the caps vs. by pressure are both in the JSON), so the bytes are what each policy chooses to keep.
CPU numbers: counts and bytes are exact; times are for relative comparison only (docs/BENCHMARKS.md
rule 7). Results: OUT/cache_<model>.json and .md.
"""
from __future__ import annotations

import heapq
import os
import time
from dataclasses import asdict, replace

DEFAULT_POLICIES = "none,end,every_chunk,sparse,valued"
AIM_FRACTION_OF_BOUND = 0.9
AIM_MEMORY_VS_EVERY_CHUNK = 0.25
_KEYS = {"chunks": "donate_chunks", "decode": "donate_decode", "handover": "donate_handover",
         "finish": "donate_finish", "branch": "branch_points", "tail": "split_prompt_tail",
         "per_path": "max_checkpoints_per_path", "total": "max_checkpoints", "weight": "value_weight"}


def register(sub) -> None:
    p = sub.add_parser("cache", help="prefix-cache policies on a small multi-turn / fork trace without memory "
                                     "pressure (bench cache-pressure is the one that tells policies apart)")
    p.add_argument("--model", default="k3-tiny", help="preset or checkpoint directory")
    p.add_argument("--engine", help="engine directory (instead of --model)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="policies separated by ';' (or ','), each name[:key=val,...] (see the module doc)")
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--systems", type=int, default=3, help="distinct shared system prompts")
    p.add_argument("--system-len", type=int, default=400)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", default="16,64", help="lo,hi tokens of a user message")
    p.add_argument("--answer-len", default="16,48", help="lo,hi generated tokens per turn")
    p.add_argument("--fork-prob", type=float, default=0.35)
    p.add_argument("--branches", type=int, default=3)
    p.add_argument("--stagger", type=int, default=12, help="engine steps between session starts")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=16,
                   help="prefill chunk; also every_chunk's checkpoint spacing (default: the page, the densest grid)")
    p.add_argument("--track-interval", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--memory-bytes", type=int, default=256 << 20)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="workload seed (weights use seed 0)")
    p.add_argument("--out", default=None, help="output folder (default: a fresh bench_out/cache-<UTC time>)")
    p.set_defaults(func=run)
    return p


def _pair(text: str, what: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{what}: expected lo,hi (two integers), got {text!r}") from None
    return lo, hi


def parse_policy(text: str):
    """'sparse:per_path=2,handover=0' -> a CachePolicy (named after the text)."""
    from k3compile.runtime.cache_policy import get_policy

    name, _, rest = text.partition(":")
    policy = get_policy(name.strip())
    changes = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq or key not in _KEYS:
            raise ValueError(f"policy {text!r}: expected key=value with keys {', '.join(_KEYS)}, got {item!r}")
        field = _KEYS[key]
        try:
            v = float(val) if field == "value_weight" else int(val)
        except ValueError:
            raise ValueError(f"policy {text!r}: {key} takes a number, got {val!r}") from None
        if field == "value_weight":
            changes[field] = v
            continue
        changes[field] = (v or None) if field.startswith("max_") else bool(v)
    return replace(policy, name=text.strip(), **changes)


def split_policies(text: str) -> list[str]:
    """Policies are separated by ';', or by ',' where the next item is a policy name (not key=value)."""
    out: list[str] = []
    for part in (p.strip() for p in text.replace(";", ",").split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part
        else:
            out.append(part)
    if not out:
        raise ValueError("--policies: no policy given")
    return out


def replay(engine, sessions) -> dict:
    """Drive the engine through the workload; returns events, outputs and per-step samples."""
    from k3compile.runtime.sampling import SamplingParams

    pending, order = [], 0
    for s in sessions:
        heapq.heappush(pending, (s.start_step, order, s.first, s.system))
        order += 1
    live, outputs, events, ckpt_bytes, slots_used = {}, {}, [], [], []
    cached, step = {}, 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        if not engine.has_unfinished() and pending[0][0] > step:
            step = pending[0][0]  # idle: jump to the next arrival
        while pending and pending[0][0] <= step:
            _, _, turn, ctx = heapq.heappop(pending)
            prompt = ctx + turn.user
            engine.add_request(turn.tid, prompt, SamplingParams(max_new_tokens=turn.max_new_tokens, ignore_eos=True))
            live[turn.tid] = (turn, prompt, [])
            events.append(("submit", turn.tid, prompt))
        for o in engine.step():
            turn, prompt, out = live[o.rid]
            out.extend(o.new_token_ids)
            if o.finished:
                del live[o.rid]
                outputs[o.rid], cached[o.rid] = out, o.cached_tokens
                events.append(("finish", o.rid, prompt + out))
                for child in turn.children:
                    heapq.heappush(pending, (step + 1 + child.think, order, child, prompt + out))
                    order += 1
        step += 1
        m = engine.metrics()
        ckpt_bytes.append(m["checkpoint_bytes"])
        slots_used.append(m["slots_used"])
    return {"events": events, "outputs": outputs, "cached": cached, "checkpoint_bytes": ckpt_bytes,
            "slots_used": slots_used, "steps": step, "seconds": time.perf_counter() - t0}


def run_policy(args, policy, model, sessions) -> dict:
    from k3compile.runtime.engine import EngineArgs, LLMEngine

    eargs = EngineArgs(model=args.model if args.engine is None else None, engine_dir=args.engine, dtype=args.dtype,
                       device=args.device, page_size=args.page_size, chunk_size=args.chunk_size,
                       track_interval=args.track_interval, max_batch_tokens=args.max_batch_tokens,
                       memory_bytes=args.memory_bytes, overlap=args.overlap, cache_policy=policy)
    engine = LLMEngine(eargs, model=model)
    r = replay(engine, sessions)
    m, st = engine.metrics(), engine.cache.stats()
    engine.close()
    steps = max(1, len(r["checkpoint_bytes"]))
    return {
        "policy": policy.name, "policy_fields": asdict(policy), "requests": len(r["outputs"]),
        "prompt_tokens": m["prompt_tokens"], "hit_tokens": m["cache_hit_tokens"], "hit_rate": m["cache_hit_rate"],
        "prefill_tokens_computed": m["prefill_tokens"], "retractions": m["retractions"],
        "checkpoint_bytes_peak": st.peak_checkpoint_bytes, "checkpoint_bytes_mean": sum(r["checkpoint_bytes"]) / steps,
        "checkpoint_bytes_end": st.checkpoint_bytes, "checkpoints_stored": st.checkpoints_stored,
        "checkpoints_evicted": st.checkpoints_evicted, "checkpoints_rejected": st.checkpoints_rejected,
        "state_slots_peak": max(r["slots_used"], default=0), "slot_bytes": engine.memory.spec.slot_bytes,
        "engine_steps": r["steps"], "seconds": r["seconds"],
        "samples": {"checkpoint_bytes_per_step": r["checkpoint_bytes"]},
        "_outputs": r["outputs"], "_events": r["events"],
    }


def run(args) -> int:
    import torch

    from k3compile.model_def.loader import load_model

    from .cache_workload import WorkloadSpec, count_requests, kv_only_bound, make_workload
    from .results import environment, fresh_out_dir, write_json

    spec = WorkloadSpec(sessions=args.sessions, systems=args.systems, system_len=args.system_len, turns=args.turns,
                        user_len=_pair(args.user_len, "--user-len"), answer_len=_pair(args.answer_len, "--answer-len"),
                        fork_prob=args.fork_prob, branches=args.branches, stagger=args.stagger, seed=args.seed)
    sessions = make_workload(spec)
    policies = [parse_policy(p) for p in split_policies(args.policies)]
    if args.engine is not None:
        from k3compile.engine import open_engine
        model = open_engine(args.engine, device=args.device).engine
    else:
        from k3compile.info import DTYPES
        model = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device, progress=False)
    print(f"bench cache: {count_requests(sessions)} requests in {len(sessions)} sessions, policies "
          f"{', '.join(p.name for p in policies)}", flush=True)

    results = []
    for policy in policies:
        res = run_policy(args, policy, model, sessions)
        print(f"  {policy.name}: hit rate {res['hit_rate']:.3f}, checkpoint bytes peak "
              f"{res['checkpoint_bytes_peak']}, {res['seconds']:.1f} s", flush=True)
        results.append(res)
    bound = kv_only_bound(results[0]["_events"], args.page_size)
    doc = summarize(results, bound, args)
    doc.update(workload=asdict(spec), environment=environment(torch.device(args.device)),
               engine={k: getattr(args, k) for k in ("model", "engine", "dtype", "device", "page_size", "chunk_size",
                                                    "track_interval", "max_batch_tokens", "memory_bytes", "overlap")})
    args.out = fresh_out_dir("cache", args.out)
    name = os.path.basename(os.path.normpath(args.engine or args.model))
    json_path, md_path = os.path.join(args.out, f"cache_{name}.json"), os.path.join(args.out, f"cache_{name}.md")
    write_json(json_path, doc)
    with open(md_path, "w") as f:
        f.write(render_markdown(doc))
    print(f"wrote {json_path} and {md_path}\n")
    print(render_markdown(doc))
    return 0


def summarize(results: list[dict], bound: dict, args) -> dict:
    base_out = results[0]["_outputs"]
    none = next((r for r in results if not r["policy_fields"]["enabled"]), None)
    dense = next((r for r in results if r["policy_fields"]["name"] == "every_chunk"), None)
    rows = []
    for r in results:
        row = {k: v for k, v in r.items() if not k.startswith("_")}
        row["outputs_match"] = r["_outputs"] == base_out
        row["fraction_of_bound"] = r["hit_rate"] / bound["hit_rate"] if bound["hit_rate"] else 0.0
        row["prefill_tokens_saved"] = (none["prefill_tokens_computed"] - r["prefill_tokens_computed"]) if none else None
        if dense is not None and dense["checkpoint_bytes_peak"]:
            row["peak_vs_every_chunk"] = r["checkpoint_bytes_peak"] / dense["checkpoint_bytes_peak"]
            row["mean_vs_every_chunk"] = r["checkpoint_bytes_mean"] / dense["checkpoint_bytes_mean"]
        rows.append(row)
    aims = {}
    for row in rows:
        if row["policy_fields"]["name"].startswith(("sparse", "valued")) and "peak_vs_every_chunk" in row:
            aims[row["policy"]] = {
                "hit_rate_vs_bound": row["fraction_of_bound"],
                "meets_hit_aim": row["fraction_of_bound"] >= AIM_FRACTION_OF_BOUND,
                "peak_bytes_vs_every_chunk": row["peak_vs_every_chunk"],
                "mean_bytes_vs_every_chunk": row["mean_vs_every_chunk"],
                "meets_memory_aim": max(row["peak_vs_every_chunk"], row["mean_vs_every_chunk"])
                <= AIM_MEMORY_VS_EVERY_CHUNK}
    return {"bench": "cache", "kv_only_bound": bound, "policies": rows, "aims": aims,
            "aim_definition": f"hit rate >= {AIM_FRACTION_OF_BOUND:.0%} of the KV-only bound with peak and mean "
                              f"checkpoint bytes <= {AIM_MEMORY_VS_EVERY_CHUNK:.0%} of every_chunk's"}


def render_markdown(doc: dict) -> str:
    w, b, e = doc.get("workload", {}), doc["kv_only_bound"], doc.get("engine", {})
    lines = ["# bench cache", "",
             f"Workload: {w.get('sessions')} sessions over {w.get('systems')} system prompts (~{w.get('system_len')} "
             f"tokens), {w.get('turns')} turns, forks p={w.get('fork_prob')} x{w.get('branches')}; engine: "
             f"{e.get('model') or e.get('engine')} on {e.get('device')}, page {e.get('page_size')}, chunk "
             f"{e.get('chunk_size')}, track interval {e.get('track_interval')}.",
             f"KV-only bound (pure-attention radix cache, page granularity, instant prefill): hit rate "
             f"**{b['hit_rate']:.3f}** ({b['hit_tokens']} of {b['prompt_tokens']} prompt tokens).", "",
             "| policy | hit rate | of bound | prefill tokens saved | ckpt bytes peak | ckpt bytes mean | peak vs every_chunk "
             "| mean vs every_chunk | ckpts stored | outputs match |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["policies"]:
        lines.append(f"| {r['policy']} | {r['hit_rate']:.3f} | {r['fraction_of_bound']:.1%} | "
                     f"{r['prefill_tokens_saved'] if r['prefill_tokens_saved'] is not None else '-'} | "
                     f"{_bytes(r['checkpoint_bytes_peak'])} | {_bytes(r['checkpoint_bytes_mean'])} | "
                     f"{_ratio(r.get('peak_vs_every_chunk'))} | {_ratio(r.get('mean_vs_every_chunk'))} | "
                     f"{r['checkpoints_stored']} | {'yes' if r['outputs_match'] else '**NO**'} |")
    lines.append("")
    for name, a in doc.get("aims", {}).items():
        ok = a["meets_hit_aim"] and a["meets_memory_aim"]
        lines.append(f"Aim ({doc['aim_definition']}): `{name}` reaches {a['hit_rate_vs_bound']:.1%} of the bound with "
                     f"{a['peak_bytes_vs_every_chunk']:.1%} (peak) / {a['mean_bytes_vs_every_chunk']:.1%} (mean) of "
                     f"every_chunk's checkpoint bytes: **{'met' if ok else 'not met'}**.")
    lines += ["", "CPU run: token counts and bytes are exact; times are for relative comparison only "
                  "(docs/BENCHMARKS.md rule 7).", ""]
    return "\n".join(lines)


def _bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.1%}"
