"""Which KDA states the scheduler hands to the prefix cache, and how many the cache keeps.

Snapshots are only possible where a forward ends at a checkpoint boundary (a multiple of the
cache's checkpoint interval): at the end of a prefill chunk, and every `track_interval` tokens in
decode. A policy says which of those snapshots are donated to the tree:

* `none`: no prefix cache at all.
* `end`: only the newest snapshot when a request finishes (or is retracted).
* `every_chunk`: every prefill chunk end and every decode track point (dense; the most memory).
* `sparse`: Marconi-style admission -- the state at the branch point a request's match reported
  (so the next request forking there restores directly), the state at the end of the request
  (multi-turn reuse) and at the prompt's tail, the last checkpoint boundary before the prompt's
  last token (a repeat matches prompt[:-1], so that is where it can restore; prefill is cut there
  and the state donated at once, which also puts a shared system prompt into the tree before the
  first request finishes). A per-path cap of 2 progress checkpoints (branch points exempt) bounds
  what stays; memory pressure evicts least recently used first.
* `valued` (ours): the same admission, and under memory pressure Marconi's FLOP-aware eviction
  (runtime/cache/radix.py, "value"): the checkpoint with the lowest recency + weight x recompute
  FLOPs saved per byte goes first, and a branch point that live paths still share is kept until
  the leaves below it are gone.

Issue 15 changed two things measured on the old trace below: the prompt-end donation now sits at
the prompt's tail (the old one, at the prompt's end, never served a repeat when the length was a
multiple of the grid, nor ever at page size 1), which replaces the handover donation in `sparse`;
and branch points no longer count against the per-path cap. The figures below predate both.

Tuning (`k3compile bench cache`, k3-tiny, CPU; numbers in traces/cache_k3-tiny.md and
traces/cache_variants/): the prompt-end donation matters -- it puts a shared system prompt's KV
into the tree before the first session finishes, so the next session gets a branch point instead
of a miss (without it: 88.6% of the KV-only bound instead of 94.2% on a 3-turn trace). Per-path caps
2, 3, 4 and none gave the same hit rate; 2 holds the least. Donating every prefill chunk as well
(`sparse:chunks=1`) helps when many sessions start while their shared prompt is still being
prefilled (busy trace: 92.5% -> 95.2% of the bound) but costs hits on the default trace (96.5% ->
94.6%: under the cap, progress checkpoints push out branch points), so it is off by default.
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
