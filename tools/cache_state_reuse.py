"""Which checkpoints a cache policy stores on a trace, and when (if ever) a lookup restores from them.

    OMP_NUM_THREADS=1 .venv/bin/python tools/cache_state_reuse.py tot 65536 valued [--seed 0] [--out DIR]

A diagnosis of issue 15's bytes goal (session 9; run on seed 0, the tuning seed, only): replays one
(trace, budget, policy) like `bench cache-pressure` and records, per stored checkpoint, the lookup
count at its store and at every hit (the cache's checkpoint listener, nothing else changed).
Prints how many were stored / ever hit, the gap in lookups from store to first hit, and the bytes
an oracle would hold (the bench's `oracle_bytes_mean`, bench/cache_replay.py oracle_held: each hit
state kept exactly from its store to its last hit, every other state dropped at once, on the same
clock as the policy's mean held; session 9's version mixed lookups and steps). Writes the
per-checkpoint record as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from k3compile.bench import cache_pressure as cp  # noqa: E402
from k3compile.bench.cache import parse_policy  # noqa: E402
from k3compile.bench.cache_replay import StandInModel  # noqa: E402
from k3compile.bench.cache_traces import PRESETS, TraceSpec, make_trace  # noqa: E402
from k3compile.runtime.cache import radix  # noqa: E402


def replay_arguments(description: str, policy_example: str) -> argparse.ArgumentParser:
    """The arguments every replay diagnostic here takes: trace preset, budget in KiB, policy, seed."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("trace", choices=sorted(PRESETS))
    ap.add_argument("kib", type=int, help="memory budget in KiB")
    ap.add_argument("policy", help=f"a policy as bench cache takes it, e.g. {policy_example}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split-pools", dest="unified", action="store_false", default=None,
                    help="split pools at SGLang's share (default: the engine's, the unified arena)")
    return ap


def replay_listening(trace: str, kib: int, policy: str, seed: int, on_cache, on_match=None, unified=None):
    """Replay one (trace, budget, policy, seed) like `bench cache-pressure` (24 roots over 90 s, the
    engine's default memory unless `unified` says, the stand-in forward), calling `on_cache(cache)` when the
    engine builds its HybridRadixCache (to add checkpoint listeners from its birth) and `on_match(cache, tokens,
    result)` after every lookup. Returns (roots, bench row)."""
    init, match = radix.HybridRadixCache.__init__, radix.HybridRadixCache.match

    def init_rec(self, *a, **kw):
        init(self, *a, **kw)
        on_cache(self)

    def match_rec(self, token_ids, touch=True):
        r = match(self, token_ids, touch)
        if touch and on_match is not None:
            on_match(self, token_ids, r)
        return r

    radix.HybridRadixCache.__init__, radix.HybridRadixCache.match = init_rec, match_rec
    try:
        args = SimpleNamespace(model="k3-tiny", dtype="fp32", device="cpu", forward="cost", page_size=16,
                               chunk_size=None, track_interval=None, max_batch_tokens=2048, unified=unified,
                               step_ms=10.0, token_ms=0.05)
        roots = make_trace(TraceSpec(mix=PRESETS[trace], roots=24, duration=90, seed=seed))
        row = cp.run_one(args, StandInModel("k3-tiny", "tiny", 16), parse_policy(policy), roots, kib << 10)
    finally:
        radix.HybridRadixCache.__init__, radix.HybridRadixCache.match = init, match
    return roots, row


def record(trace: str, kib: int, policy: str, seed: int, unified=None) -> tuple[dict, dict]:
    """Per stored checkpoint (by its serial): the lookup count at its store and at every hit
    (HybridRadixCache.add_checkpoint_listener on the engine's cache), and the bench row."""
    rec = {}

    def listen(cache):
        def on(event, serial):
            if event == "store":
                nd = next(n for n in cache.nodes() if n.ckpt_serial == serial and n.checkpoint is not None)
                rec[serial] = dict(store=cache.stats().lookups, branch=bool(cache._is_branch(nd)), depth=nd.depth,
                                   hits=[])
            elif event == "hit":
                rec[serial]["hits"].append(cache.stats().lookups)

        cache.add_checkpoint_listener(on)

    _, row = replay_listening(trace, kib, policy, seed, listen, unified=unified)
    return rec, row


def main() -> int:
    ap = replay_arguments(__doc__.splitlines()[0], "valued or valued:ttl=0")
    ap.add_argument("--out", default="bench_out")
    a = ap.parse_args()
    rec, row = record(a.trace, a.kib, a.policy, a.seed, unified=a.unified)
    print({k: row[k] for k in ("hit_rate", "kv_only_bound", "checkpoint_bytes_mean", "checkpoints_stored",
                               "repeats_hit", "repeats", "stems_hit", "stems")})
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"state_reuse_{a.trace}_{a.kib}_{a.policy.replace(':', '_')}_seed{a.seed}.json")
    with open(path, "w") as f:
        json.dump(rec, f)
    hit = [v for v in rec.values() if v["hits"]]
    branch = [v for v in rec.values() if v["branch"]]
    print(f"stored {len(rec)}: {len(hit)} ever hit; branch points at the store {len(branch)} "
          f"({sum(1 for v in branch if v['hits'])} hit)")
    gaps = sorted(v["hits"][0] - v["store"] for v in hit if not v["branch"])
    if gaps:
        q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))]  # noqa: E731
        print(f"lookups from store to first hit (non-branch): p50 {q(.5)} p90 {q(.9)} p99 {q(.99)} max {gaps[-1]}")
    print(f"oracle (each hit state held from its store to its last hit, the rest never; engine steps, as the "
          f"bench's checkpoint_bytes_mean): {row['oracle_bytes_mean']:.0f} B mean; the policy held "
          f"{row['checkpoint_bytes_mean']:.0f} B")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
