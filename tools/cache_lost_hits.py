"""Why a repeat or a shared stem missed: which call took the state that would have served it.

    OMP_NUM_THREADS=1 .venv/bin/python tools/cache_lost_hits.py tot 4096 valued --seed 4

A diagnosis for issue 15's "repeats and shared stems always hit" (session 10; run on seeds that
are not reported: 0, 4, 5). Replays one (trace, budget, policy, seed) like `bench cache-pressure`,
listening to the engine's cache (HybridRadixCache.add_checkpoint_listener): every checkpoint's store
and drop with the lookup count, its depth, hits and whether it was a branch point, and for a drop
the cache call it came from (`_expire_unused`, `_expire_stale`, `evict_checkpoints` = state pressure,
`evict_pages` = KV pressure, `_make_room` = a cap). Then, for every `repeat` or `stem` request that
restored nothing, prints its lookups (lookup count, tokens restored, KV tokens matched) and the
store / drop events that bear on it: for a repeat those at its prompt-tail depth between the first
and the last lookup of that prompt, for a stem those at depths up to its KV match before its lookup.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cache_state_reuse import replay_arguments, replay_listening  # noqa: E402  (tools/, next to this script)

from k3compile.runtime.cache import radix  # noqa: E402

CALLERS = ("_expire_unused", "_expire_stale", "evict_checkpoints", "evict_pages", "_make_room", "unlock")


def _caller() -> str:
    f, names = sys._getframe(2), []
    while f is not None:
        if f.f_code.co_name in CALLERS:
            names.append(f.f_code.co_name)
        f = f.f_back
    return "/".join(names)


def record(trace: str, kib: int, policy: str, seed: int, unified=None):
    """(roots, bench row, checkpoint events, lookups by query) for one replay."""
    events, lookups = [], {}  # events: (lookup, "store"/"drop", serial, depth, hits, branch, caller)

    def listen(cache):
        def on(event, serial):
            if event == "hit":
                return
            nd = next((n for n in cache.nodes() if n.ckpt_serial == serial and n.checkpoint is not None), None)
            events.append((cache.stats().lookups, event, serial, nd.depth if nd else -1, nd.ckpt_hits if nd else -1,
                           bool(cache._is_branch(nd)) if nd else None, _caller() if event == "drop" else ""))

        cache.add_checkpoint_listener(on)

    def on_match(cache, token_ids, r):
        lookups.setdefault(radix.as_token_tuple(token_ids), []).append((cache.stats().lookups, r.cached_len,
                                                                         r.kv_match_len))

    roots, row = replay_listening(trace, kib, policy, seed, listen, on_match, unified=unified)
    return roots, row, events, lookups


def main() -> int:
    ap = replay_arguments(__doc__.splitlines()[0], "valued or valued:protect_shared=0")
    a = ap.parse_args()
    roots, row, events, lookups = record(a.trace, a.kib, a.policy, a.seed, unified=a.unified)
    print({k: row[k] for k in ("hit_rate", "fraction_of_bound", "repeats_hit", "repeats", "stems_hit", "stems")})
    stack = [r.req for r in roots]
    while stack:
        req = stack.pop()
        stack.extend(req.children)
        tags = getattr(req, "tags", ())
        if not ({"repeat", "stem"} & set(tags)) or row["_cached"].get(req.tid, 0) > 0:
            continue
        seen = lookups.get(tuple(req.user[:-1]), [])  # roots and standalone prompts: their own tokens
        print(f"LOST {req.tid} {tags} prompt {len(req.user)} tokens; lookups (at, restored, KV matched): {seen}")
        if not seen:
            continue
        if "repeat" in tags:
            tail = (len(req.user) - 1) // 16 * 16
            for e in events:
                if seen[0][0] - 1 <= e[0] <= seen[-1][0] and e[3] == tail:
                    print("   ", e)
        else:
            at, _, kv = seen[0]
            for e in [e for e in events if e[0] <= at and 0 < e[3] <= max(kv, 16)][-8:]:
                print("   ", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
