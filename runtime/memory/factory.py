"""The pools for a byte budget: split pools or one unified arena (the one place both are made, so every
rank of a parallel engine builds the same geometry from the same numbers)."""
from __future__ import annotations

from k3compile.model_def.cache import CacheSpec

from .pools import DEFAULT_STATE_FRACTION, SplitPools
from .unified import UnifiedArena


def make_memory(spec: CacheSpec, budget_bytes: int, page_size: int, unified: bool,
                state_fraction: float | None = None, device="cpu"):
    if unified:
        return UnifiedArena.from_budget(spec, budget_bytes, page_size, device=device)
    return SplitPools.from_budget(spec, budget_bytes, page_size, state_fraction or DEFAULT_STATE_FRACTION,
                                  device=device)
