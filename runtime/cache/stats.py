"""Counters the hybrid radix cache keeps for the cache benchmark and /metrics."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheStats:
    # lookups (match with touch=True)
    lookups: int = 0
    query_tokens: int = 0  # page-aligned tokens asked for
    hit_tokens: int = 0  # usable hit: up to the deepest live checkpoint
    kv_match_tokens: int = 0  # KV matched, including what lies beyond the last checkpoint
    # inserts
    inserted_tokens: int = 0  # new KV tokens the tree adopted
    duplicate_pages_freed: int = 0  # donated pages for positions the tree already had
    checkpoints_stored: int = 0
    checkpoints_duplicate: int = 0  # donated slot freed: the node already had a checkpoint
    checkpoints_rejected: int = 0  # donated slot freed: the caps could not make room
    # evictions (caps, state pressure and KV pressure together)
    checkpoints_evicted: int = 0
    checkpoints_expired: int = 0  # of those, unused ones dropped by `unused_ttl` (no pressure needed)
    checkpoints_stale: int = 0  # of those, ones no lookup covered for `stale_age` lookups (no pressure needed)
    nodes_evicted: int = 0
    pages_evicted: int = 0
    # gauges, filled in when a snapshot is taken
    num_nodes: int = 0
    num_pages: int = 0
    num_checkpoints: int = 0
    checkpoint_bytes: int = 0
    peak_checkpoints: int = 0
    peak_checkpoint_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}
