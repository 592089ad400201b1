"""Where a policy's hits fall short of the KV-only bound: KV that was gone, or KV there but no state at its depth.

    OMP_NUM_THREADS=1 .venv/bin/python tools/cache_shortfall.py agent 16384 valued --seed 0

A diagnosis for issue 15's open hit-goal cells (session 12). Replays one (trace, budget, policy, seed) like
`bench cache-pressure` (tools/cache_state_reuse.replay_listening) and, per prompt, compares the tokens it hit with
what the KV-only bound gives it (bench/cache_replay.kv_only_bound's rule: the longest page-aligned prefix of the
prompt less its last token that an earlier prompt or finished sequence had). The lookup that admitted it (the last
one returning its hit) says how deep its KV matched; the shortfall then splits into
  - `kv`: bound - KV matched (the KV was evicted, or an earlier request that holds it had not inserted it yet:
    the bound's instant prefill), which only KV eviction order, or more memory, changes;
  - `state`: KV matched - hit (the KV was there, no checkpoint at or near its depth), which the checkpoint policy
    decides.
Totals per request kind (the trace's tags: step, root, repeat, stem, one-off ...) and the largest single losses.
"""
from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cache_state_reuse import replay_arguments, replay_listening  # noqa: E402  (tools/, next to this script)

from k3compile.bench import cache_replay  # noqa: E402
from k3compile.bench.cache_replay import PageTrie  # noqa: E402
from k3compile.runtime.cache import radix  # noqa: E402


def shortfall(trace: str, kib: int, policy: str, seed: int, page_size: int = 16, unified=None):
    """(bench row, per-prompt records: tid, tags, prompt length, bound, KV matched, hit)."""
    lookups: dict[tuple, list] = {}
    captured = {}
    real_replay = cache_replay.replay

    def replay_capture(*a, **kw):
        captured["r"] = real_replay(*a, **kw)
        return captured["r"]

    def on_match(cache, token_ids, r):
        lookups.setdefault(radix.as_token_tuple(token_ids), []).append((r.cached_len, r.kv_match_len))

    cache_replay.replay = replay_capture
    try:
        _, row = replay_listening(trace, kib, policy, seed, lambda cache: None, on_match, unified=unified)
    finally:
        cache_replay.replay = real_replay
    r, trie, out = captured["r"], PageTrie(page_size), []
    for kind, tid, seq in r["events"]:
        if kind != "submit":
            trie.insert(seq[:-1])
            continue
        bound, hit = trie.match(seq[:-1]), r["cached"][tid]
        trie.insert(seq)
        seen = [kv for cached, kv in lookups.get(tuple(seq[:-1]), []) if cached == hit]
        kv = seen[-1] if seen else hit
        out.append({"tid": tid, "tags": tuple(r["tags"].get(tid, ())), "prompt": len(seq), "bound": bound,
                    "kv": min(kv, bound), "hit": hit})
    return row, out


def main() -> int:
    ap = replay_arguments(__doc__.splitlines()[0], "valued or sparse")
    ap.add_argument("--top", type=int, default=12, help="largest single losses to list")
    a = ap.parse_args()
    row, recs = shortfall(a.trace, a.kib, a.policy, a.seed, unified=a.unified)
    bound = sum(x["bound"] for x in recs)
    hit = sum(x["hit"] for x in recs)
    kv_lost = sum(x["bound"] - x["kv"] for x in recs)
    state_lost = sum(max(0, x["kv"] - x["hit"]) for x in recs)
    print(f"{a.trace} {a.kib} KiB {a.policy} seed {a.seed}: hit {row['hit_rate']:.4f} = {row['fraction_of_bound']:.1%} "
          f"of the bound; {len(recs)} prompts, bound {bound} tokens, hit {hit}, short {bound - hit}: "
          f"KV gone {kv_lost} ({kv_lost / max(1, bound):.1%} of the bound), no state at the KV's depth {state_lost} "
          f"({state_lost / max(1, bound):.1%}); LRU-KV at equal pages {row['kv_only_lru_equal_pages']:.4f}")
    by = collections.defaultdict(lambda: [0, 0, 0, 0, 0])
    for x in recs:
        k = "/".join(x["tags"]) or "-"
        b = by[k]
        b[0] += 1
        b[1] += x["bound"]
        b[2] += x["hit"]
        b[3] += x["bound"] - x["kv"]
        b[4] += max(0, x["kv"] - x["hit"])
    print("| kind | prompts | bound tokens | hit | KV gone | no state |\n|---|---|---|---|---|---|")
    for k, b in sorted(by.items(), key=lambda kv: -(kv[1][3] + kv[1][4])):
        print(f"| {k} | {b[0]} | {b[1]} | {b[2]} | {b[3]} | {b[4]} |")
    print("largest losses (tid, tags, prompt, bound, KV matched, hit):")
    for x in sorted(recs, key=lambda x: x["hit"] - x["bound"])[:a.top]:
        print(f"  {x['tid']} {x['tags']} {x['prompt']} {x['bound']} {x['kv']} {x['hit']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
