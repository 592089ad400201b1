"""k3compile bench spec: decode throughput and accept length vs batch size, for no speculation,
verify-all and trim (issue 13, item 8); plus the draft-window memory table (item 4).

    k3compile bench spec --model k3-tiny --batch 1,4 --proposer ngram
    k3compile bench spec --engine engines/mini --batch 1,8,64,256 --proposer controlled --accept-p 0.7 \
        --profile profiles/<device>__k3-mini-6b.json

For each batch size B: B requests with random prompts run to `--max-new-tokens` (greedy, eos ignored)
through a fresh LLMEngine per arm; decode throughput = tokens generated after every request had its
first token / wall time from then to the end (prefill excluded). Arms: `none` (plain decode),
`all` (every draft verified), `trim` (the planner on `--profile`; skipped without one). Accept length =
mean tokens a speculating request commits per step. Every arm's outputs are compared with `none`'s
(greedy: equal up to near-ties of the logits; the count of differing requests is reported).

`--proposer controlled` is the CONTROLLED-ACCEPTANCE ORACLE (runtime/spec/controlled.py), not a
drafter: it drafts the target's own greedy token (recorded by the `none` arm) with probability p, so
acceptance is set by hand on a random-weight target. With `--acceptance forced` the coin flips decide
acceptance outright (a random-weight bf16 target's verify step picks other argmaxes than its decode step
on most tokens, so recorded tokens stop matching): the cost of verify, fold and planner is a drafter's of
that acceptance, the outputs are not compared. `ngram` is prompt lookup; `dspark` needs --draft.

Memory: per-request draft-window bytes of both kinds (ReplaySSM and snapshot) for this model and for
full K3 at TP 8 (gamma from --gamma), and the max concurrent requests each allows when KDA state slot
+ window + KV of `--mem-context` tokens share `--mem-budget-gib`.
"""
from __future__ import annotations

import gc
import os
import random
import time

import torch

from k3compile.bench.results import environment, fresh_out_dir, write_json

ARMS = ("none", "all", "trim")


def register(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding: throughput and accept length vs batch size")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", help="engine directory built with --verify-graphs")
    src.add_argument("--model", help="preset or checkpoint directory (eager model)")
    p.add_argument("--batch", default="1,2,4,8", help="batch sizes")
    p.add_argument("--gamma", type=int, default=4, help="drafts per request per step")
    p.add_argument("--proposer", default="controlled", choices=["controlled", "ngram", "dspark"])
    p.add_argument("--accept-p", type=float, default=0.7, help="controlled oracle: P(each draft is the target's)")
    p.add_argument("--acceptance", default="oracle", choices=["oracle", "forced"],
                   help="--proposer controlled: 'oracle' drafts the target's recorded greedy tokens (lossless, "
                        "compared with `none`); 'forced' lets the coin flips decide (for random-weight targets "
                        "whose verify and decode kernels pick different argmaxes; outputs not the target's)")
    p.add_argument("--draft", default=None, help="--proposer dspark: the drafter's checkpoint directory")
    p.add_argument("--profile", default=None, help="cost profile JSON for the trim arm (k3compile profile verify)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prompts", default="random", choices=["random", "stdlib"],
                   help="random token ids, or held-out slices of the Python stdlib source (the byte-level corpus "
                        "`k3compile train` uses: what the trained spec-tiny pair drafts well on)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--window", default="replay", choices=["replay", "snapshot"])
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="--model only (default fp32)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-gib", type=float, default=None, help="KV + state memory of each engine (default: sized)")
    p.add_argument("--mem-budget-gib", type=float, default=64.0, help="memory table: budget per GPU")
    p.add_argument("--mem-context", type=int, default=4096, help="memory table: context tokens per request")
    p.add_argument("--out", default=None, help="output folder (default: a fresh bench_out/spec-<UTC time>)")
    p.set_defaults(func=run)


def memory_table(cfg, gamma: int, budget_bytes: int, context: int, dtype=torch.bfloat16, tp_size: int = 1) -> list:
    from k3compile.model_def.cache import CacheSpec
    from k3compile.model_def.draft_window import DraftWindowSpec

    cs = CacheSpec.from_config(cfg, dtype, tp_size)
    rows = []
    for kind in ("replay", "snapshot"):
        w = DraftWindowSpec(cs, gamma + 1, kind)
        per = w.bytes_per_position_per_head()
        req = w.bytes_per_request()
        need = cs.slot_bytes + req + cs.kv_bytes_per_token * context
        rows.append({"model": cfg.name, "tp": tp_size, "kind": kind, "window_positions": gamma + 1,
                     "bytes_per_position_per_head": per["state"], "conv_bytes_per_position_per_head": per["conv"],
                     "window_bytes_per_layer_head": (per["state"] + per["conv"]) * (gamma + 1),
                     "window_bytes_per_request": req, "state_slot_bytes": cs.slot_bytes,
                     "kv_bytes_per_request": cs.kv_bytes_per_token * context,
                     "max_concurrent_requests": budget_bytes // need})
    return rows


def _prompts(b: int, n: int, vocab: int, seed: int, source: str = "random") -> list[list[int]]:
    if source == "stdlib":
        from k3compile.train.corpus import Corpus
        return Corpus().batch("val", b, n, torch.Generator().manual_seed(seed)).tolist()
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for _ in range(b)]


def run_arm(provider, args, prompts, params, arm: str, proposer, memory_bytes):
    from k3compile.runtime.engine import EngineArgs, LLMEngine

    from k3compile.runtime.executor import DECODE_BUCKETS, next_bucket

    b = max(len(prompts), 1)
    # one graph bucket (the batch's): every step of the run pads to it, so capture stays short
    kw = dict(model=None, memory_bytes=memory_bytes, max_running=b, enable_prefix_cache=False, chunk_size=256,
              max_batch_tokens=max(2048, args.prompt_len * b), cuda_graph_buckets=(next_bucket(b, DECODE_BUCKETS) or b,))
    if arm != "none":
        kw.update(num_speculative_tokens=args.gamma, spec_window=args.window, spec_plan=arm,
                  spec_profile=args.profile if arm == "trim" else None)
    engine = LLMEngine(EngineArgs(**kw), model=provider, proposer=proposer if arm != "none" else None)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    t_first = None
    while engine.has_unfinished():
        for o in engine.step():
            out[o.rid].extend(o.new_token_ids)
        if t_first is None and all(out.values()):
            if provider_device(provider).type == "cuda":
                torch.cuda.synchronize()
            t_first, n_first = time.perf_counter(), sum(len(v) for v in out.values())
    if provider_device(provider).type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t_first
    tokens = sum(len(v) for v in out.values()) - n_first
    res = {"arm": arm, "batch": len(prompts), "decode_tokens": tokens, "decode_seconds": wall,
           "tok_per_s": tokens / wall if wall > 0 else None}
    if engine.spec is not None:
        s = engine.spec.stats
        res.update(accept_length=s.accept_length, steps=s.steps, drafted=s.drafted, verified=s.verified,
                   accepted=s.accepted, decode_steps=s.decode_steps, window_bytes=engine.spec.window_bytes)
    else:
        res["steps"] = None
    engine.close()
    del engine
    release_device_memory()  # each arm sizes its own pools: the last arm's must be gone first
    return res, [out[f"r{i}"] for i in range(len(prompts))]


def release_device_memory() -> None:
    """Collect engines caught in reference cycles now (the automatic collector may not run for a while:
    few Python objects, many GPU bytes) and hand their cached blocks back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def provider_device(provider) -> torch.device:
    from k3compile.runtime.executor import provider_device as pd
    return pd(provider)


def run(args) -> int:
    from k3compile.model_def.config import ConfigError, get_preset
    from k3compile.model_def.dtypes import DTYPES
    from k3compile.runtime.sampling import SamplingParams
    from k3compile.runtime.spec.controlled import FORCED_LABEL, LABEL, ControlledAcceptanceProposer
    from k3compile.runtime.spec.setup import make_proposer

    batches = sorted({int(x) for x in args.batch.split(",") if x.strip()})
    arms = [a for a in args.arms.split(",") if a]
    if any(a not in ARMS for a in arms) or "none" not in arms:
        raise ConfigError(f"--arms must include 'none' and be among {ARMS}, got {args.arms!r}")
    if "trim" in arms and args.profile is None:
        print("bench spec: no --profile, skipping the trim arm")
        arms.remove("trim")
    if args.engine is not None:
        from k3compile.engine import open_engine
        provider = open_engine(args.engine, device=args.device).engine
    else:
        from k3compile.model_def.loader import load_model
        provider = load_model(args.model, dtype=DTYPES[args.dtype or "fp32"], device=args.device, seed=args.seed,
                              progress=False)
    out_dir = fresh_out_dir("spec", args.out)
    cfg = provider.config
    dev = provider_device(provider)
    budget = int(args.mem_budget_gib * (1 << 30))
    forced = args.proposer == "controlled" and args.acceptance == "forced"
    doc = {"config": vars(args) | {"func": None}, "environment": environment(dev),
           "proposer_label": (FORCED_LABEL if forced else LABEL) if args.proposer == "controlled" else args.proposer,
           "memory": memory_table(cfg, args.gamma, budget, args.mem_context, provider.cache_spec().dtype)
           + memory_table(get_preset("k3"), args.gamma, budget, args.mem_context, torch.bfloat16, tp_size=8),
           "runs": []}
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    mem = int(args.memory_gib * (1 << 30)) if args.memory_gib else None
    for b in batches:
        prompts = _prompts(b, args.prompt_len, cfg.vocab_size, args.seed + b, args.prompts)
        base, ref = run_arm(provider, args, prompts, params, "none", None, mem)
        doc["runs"].append(base)
        print(f"batch {b} none: {base['tok_per_s']:.1f} tok/s", flush=True)
        for arm in arms:
            if arm == "none":
                continue
            if args.proposer == "controlled":
                proposer = ControlledAcceptanceProposer({tuple(p): r for p, r in zip(prompts, ref)}, args.accept_p,
                                                        cfg.vocab_size, args.gamma, seed=args.seed,
                                                        forced=forced)
            else:
                proposer = make_proposer(args.proposer, args.draft, args.gamma, provider, str(dev))
            res, outs = run_arm(provider, args, prompts, params, arm, proposer, mem)
            res["differing_requests"] = None if forced else sum(o != r for o, r in zip(outs, ref))
            res["speedup_vs_none"] = res["tok_per_s"] / base["tok_per_s"] if base["tok_per_s"] else None
            doc["runs"].append(res)
            print(f"batch {b} {arm}: {res['tok_per_s']:.1f} tok/s (x{res['speedup_vs_none']:.2f}), accept length "
                  f"{res['accept_length']:.2f}, " + ("outputs not compared (forced)" if forced else
                                                     f"{res['differing_requests']} request(s) differ"), flush=True)
        stem = os.path.join(out_dir, f"spec_{cfg.name}")
        write_json(stem + ".json", doc)
        with open(stem + ".md", "w") as f:
            f.write(markdown(doc))
    print(markdown(doc))
    return 0


def markdown(doc: dict) -> str:
    c = doc["config"]
    lines = [f"# bench spec: {c.get('engine') or c.get('model')}, proposer: {doc['proposer_label']}"
             + (f" (p = {c['accept_p']})" if c["proposer"] == "controlled" else ""),
             "", f"gamma {c['gamma']}, window {c['window']}, prompt {c['prompt_len']}, {c['max_new_tokens']} new tokens;"
             " decode tok/s after every request's first token", "",
             "| batch | arm | tok/s | vs none | accept length | verified / drafted | differing requests |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in doc["runs"]:
        acc = f"{r['accept_length']:.2f}" if r.get("accept_length") is not None else "-"
        ver = f"{r['verified']} / {r['drafted']}" if r.get("drafted") is not None else "-"
        sp = f"x{r['speedup_vs_none']:.2f}" if r.get("speedup_vs_none") else "-"
        lines.append(f"| {r['batch']} | {r['arm']} | {r['tok_per_s']:.1f} | {sp} | {acc} | {ver} | "
                     f"{r.get('differing_requests', '-')} |")
    lines += ["", "## draft-window memory (per request) and max concurrency", "",
              "| model | TP | kind | bytes/position/head (state + conv) | window / layer-head | window / request | "
              "slot | KV @ context | max concurrent |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for m in doc["memory"]:
        lines.append(f"| {m['model']} | {m['tp']} | {m['kind']} | {m['bytes_per_position_per_head']} + "
                     f"{m['conv_bytes_per_position_per_head']} | {m['window_bytes_per_layer_head'] / 1024:.1f} KiB | "
                     f"{m['window_bytes_per_request'] / 2**20:.2f} MiB | {m['state_slot_bytes'] / 2**20:.2f} MiB | "
                     f"{m['kv_bytes_per_request'] / 2**20:.2f} MiB | {m['max_concurrent_requests']} |")
    return "\n".join(lines) + "\n"
