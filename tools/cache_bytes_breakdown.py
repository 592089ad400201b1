"""Where a policy's checkpoint bytes go: held state x lookups, by how the state was donated and whether it was hit.

    OMP_NUM_THREADS=1 .venv/bin/python tools/cache_bytes_breakdown.py tot 65536 valued --seed 0

A diagnosis for issue 15's bytes goal (session 13; run on seed 0, the tuning seed). Replays one (trace, budget,
policy, seed) like `bench cache-pressure` (tools/cache_state_reuse.replay_listening) and records per stored
checkpoint its store and drop (lookup count), its hits, and how it came: the scheduler call that donated it
(`finish`: a request's end state at finish or retraction; `cut`: a chunk cut at the match's branch point or the
prompt tail; `chunk`: a plain chunk end or decode track point, for policies that donate those), whether it was a
branch point at the store, and whether it sits under the root. Sums slot x lookups held per group, split into
held before the last hit and after it (or never hit), and the drop cause (decay / pressure / cap / end of trace).
"""
from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cache_state_reuse import replay_arguments, replay_listening  # noqa: E402  (tools/, next to this script)

DONORS = {"_settle": "finish", "_retract": "finish", "process": "cut"}
DROPS = ("_expire_unused", "_expire_stale", "evict_checkpoints", "evict_pages", "_make_room", "insert")


def _frames(names) -> str:
    f, found = sys._getframe(2), []
    while f is not None:
        if f.f_code.co_name in names:
            found.append(f.f_code.co_name)
        f = f.f_back
    return found[0] if found else "?"


def record(trace: str, kib: int, policy: str, seed: int, unified=None):
    """(bench row, per-serial records, lookups at the end) for one replay."""
    recs: dict[int, dict] = {}
    end = {}

    def listen(cache):
        end["cache"] = cache

        def on(event, serial):
            now = cache.stats().lookups
            if event == "store":
                nd = next(n for n in cache.nodes() if n.ckpt_serial == serial and n.checkpoint is not None)
                donor = DONORS.get(_frames(DONORS), "chunk")
                recs[serial] = dict(store=now, depth=nd.depth, branch=bool(cache._is_branch(nd)),
                                    root=cache._anchor(nd) is cache.root, on_line=nd.on_line, donor=donor,
                                    hits=[], drop=None, cause=None)
            elif event == "hit":
                recs[serial]["hits"].append(now)
            else:
                recs[serial]["drop"], recs[serial]["cause"] = now, _frames(DROPS)

        cache.add_checkpoint_listener(on)

    _, row = replay_listening(trace, kib, policy, seed, listen, unified=unified)
    return row, recs, end["cache"].stats().lookups


def summarize(recs: dict, last: int) -> list[tuple]:
    """Rows (group, stored, hit, lookups held before the last hit, lookups held after it / never hit, drop causes)."""
    groups = collections.defaultdict(lambda: [0, 0, 0, 0, collections.Counter()])
    for r in recs.values():
        kind = f"{r['donor']}{'/branch' if r['branch'] else ''}{'/root' if r['root'] else ''}" \
               f"{'/line' if r['on_line'] else ''}"
        g = groups[(kind, bool(r["hits"]))]
        drop = r["drop"] if r["drop"] is not None else last
        useful = (r["hits"][-1] - r["store"]) if r["hits"] else 0
        g[0] += 1
        g[1] += len(r["hits"])
        g[2] += useful
        g[3] += drop - r["store"] - useful
        g[4][r["cause"] or "end"] += 1
    return sorted(((k, hit, *v) for (k, hit), v in groups.items()), key=lambda t: -(t[4] + t[5]))


def main() -> int:
    ap = replay_arguments(__doc__.splitlines()[0], "valued")
    a = ap.parse_args()
    row, recs, last = record(a.trace, a.kib, a.policy, a.seed, unified=a.unified)
    print({k: row[k] for k in ("hit_rate", "fraction_of_bound", "checkpoint_bytes_mean", "checkpoints_stored",
                               "repeats_hit", "repeats", "stems_hit", "stems")})
    rows = summarize(recs, last)
    total = sum(t[4] + t[5] for t in rows) or 1
    print(f"{'kind':28} {'hit':>4} {'stored':>6} {'hits':>5} {'held to last hit':>16} {'held after/never':>16}  drops")
    for kind, hit, n, hits, useful, idle, causes in rows:
        print(f"{kind:28} {str(hit):>4} {n:6d} {hits:5d} {useful / total:16.1%} {idle / total:16.1%}  "
              f"{dict(causes)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
