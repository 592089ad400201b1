"""What every memory manager offers the runtime: state slots and KV pages, plus the views steps read.

Two implementations: `SplitPools` (two separately sized pools, SGLang-style ratio) and
`UnifiedArena` (`--enable-unified-memory`: one buffer, state from one end, KV from the other).
Index 0 of each kind is reserved as a padding sink for CUDA-graph dummy requests and is never
handed out.
"""
from __future__ import annotations

from typing import Callable, Protocol

from k3compile.model_def.cache import CacheSpec, CacheTensors


class OutOfMemoryError(RuntimeError):
    """Not enough free slots or pages. Carries what was asked and what was free so callers can retract."""

    def __init__(self, kind: str, requested: int, free: int):
        super().__init__(f"out of {kind} memory: requested {requested}, free {free}")
        self.kind, self.requested, self.free = kind, requested, free


# Called after a block moved (unified arena compaction): kind is "slot" or "page".
RelocationListener = Callable[[str, int, int], None]


class KVStateMemory(Protocol):
    spec: CacheSpec
    page_size: int
    tensors: CacheTensors

    def alloc_slot(self) -> int: ...
    def free_slot(self, slot: int) -> None: ...
    def alloc_pages(self, n: int) -> list[int]: ...
    def free_pages(self, pages: list[int]) -> None: ...
    def copy_slot(self, src: int, dst: int) -> None: ...
    def num_free_slots(self) -> int: ...
    def num_free_pages(self) -> int: ...
    def num_used_slots(self) -> int: ...
    def num_used_pages(self) -> int: ...
    # Both free counts can be true at once in split pools but not in a unified arena (one free
    # region serves both kinds), so admission asks for the combination it needs.
    def can_fit(self, n_slots: int, n_pages: int) -> bool: ...
    # Blocks referenced by a batch being built or run must not move (unified compaction); no-ops
    # for memories that never move blocks.
    def pin_slot(self, slot: int) -> None: ...
    def unpin_slot(self, slot: int) -> None: ...
    def pin_pages(self, pages: list[int]) -> None: ...
    def unpin_pages(self, pages: list[int]) -> None: ...
    def add_relocation_listener(self, fn: RelocationListener) -> None: ...
