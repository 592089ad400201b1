"""Which KDA states the scheduler hands to the prefix cache, and how many the cache keeps.

Snapshots are only possible where a forward ends at a checkpoint boundary (a multiple of the
cache's checkpoint interval): at the end of a prefill chunk, and every `track_interval` tokens in
decode. A policy says which of those snapshots are donated to the tree:

* `none`: no prefix cache at all.
* `end`: only the newest snapshot when a request finishes (or is retracted).
* `every_chunk`: every prefill chunk end and every decode track point (dense at a small chunk size;
  at the engine's default of 256 about as sparse as `end`).
* `sparse`: Marconi-style admission -- the state at the branch point a request's match reported
  (so the next request forking there restores directly), the state at the end of the request
  (multi-turn reuse) and at the prompt's tail, the last checkpoint boundary before the prompt's
  last token (a repeat matches prompt[:-1], so that is where it can restore; prefill is cut there
  and the state donated at once, which also puts a shared system prompt into the tree before the
  first request finishes). A per-path cap of 2 progress checkpoints (branch points exempt) bounds
  what stays; memory pressure evicts least recently used first.
* `valued` (ours): the same admission, and under memory pressure Marconi's FLOP-aware eviction
  (runtime/cache/radix.py, "value"): the checkpoint with the lowest recency + weight x recompute
  FLOPs saved per byte goes first. In both `sparse` and `valued` a branch point that two or more
  live paths continue from is never evicted before the leaves below it.

Tuning (issue 15, `k3compile bench cache-pressure --seeds 0`, 226-383 requests per trace, engine
default chunk 256, budgets 2048 and 1024 KiB; traces/cache_pressure/tune_seed0/; the reported
seeds are 1-3): a per-path cap of 1 instead of 2 holds ~35% fewer checkpoint bytes on the agent
trace at the same hit rate, but costs the tree-of-thought trace 9 points of the KV-only bound (a
branch that arrives after its first sibling finished finds the parent's state superseded by the
sibling's), so 2 stays. `value_weight` 4 instead of 1 loses 1-3 points on both; 1 stays. A global
cap of 10% of the state slots (`max_checkpoints=0.1`) lost most hits on the agent trace (the
stem's branch point goes once its leaves are evicted under KV pressure); no global cap by default.

Why `sparse` holds about as many checkpoint bytes as `every_chunk` at the default chunk of 256:
there `every_chunk` is itself sparse (one state per 256 new tokens: 162 stored vs `end`'s 151 on
the seed-0 agent trace, `sparse` 474), while `sparse` needs at least the newest state of every live
session, and under memory pressure every policy fills the state slots it is not using for running
requests. The old "<= 25% of every_chunk's bytes" was measured at a chunk of 16, where
`every_chunk` is dense.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CachePolicy:
    name: str
    enabled: bool = True
    donate_chunks: bool = False  # every prefill chunk that ends on a checkpoint boundary
    donate_decode: bool = False  # every decode track point
    donate_handover: bool = False  # the newest snapshot when prefill hands over to decode
    donate_finish: bool = False  # the newest snapshot at finish and at retraction
    branch_points: bool = False  # end a chunk at the match's branch point and donate the state there
    split_prompt_tail: bool = False  # end a chunk at the last boundary before the prompt's end
    max_checkpoints_per_path: int | None = None
    max_checkpoints: int | None = None
    eviction: str = "lru"  # under memory pressure: "lru" or "value" (HybridRadixCache)
    value_weight: float = 1.0  # "value": weight of FLOPs-saved-per-byte against recency (Marconi's alpha)

    def with_caps(self, per_path: int | None, total: int | None) -> "CachePolicy":
        return replace(self, max_checkpoints_per_path=per_path, max_checkpoints=total)


POLICIES = {
    "none": CachePolicy("none", enabled=False),
    "end": CachePolicy("end", donate_finish=True),
    "every_chunk": CachePolicy("every_chunk", donate_chunks=True, donate_decode=True, donate_handover=True,
                               donate_finish=True),
    "sparse": CachePolicy("sparse", donate_finish=True, branch_points=True, split_prompt_tail=True,
                          max_checkpoints_per_path=2),
    "valued": CachePolicy("valued", donate_finish=True, branch_points=True, split_prompt_tail=True,
                          max_checkpoints_per_path=2, eviction="value"),
}


def get_policy(name: str) -> CachePolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]
