"""Memory as the scheduler sees it: blocks of scheduled batches are pinned; freeing one waits.

A batch's metadata bakes in slot and page indices when it is built, and with the overlap scheduler
it is built while the previous batch still runs. Until that batch has run, none of its blocks may
move (unified-arena compaction) or be handed to someone else (a freed page reused by a request
whose copy-on-write restore runs right away on the scheduler thread). So the scheduler pins every
block of a batch when it builds it and unpins them when it has processed the results; a free of a
pinned block -- e.g. a duplicate page the tree frees when a request donates its prefix while its
next decode batch is already built -- is deferred to the last unpin (mini-sglang's lazy-free
region plays the same role).

Pins are kept per pin call (a batch's blocks), not per index: a batch pins every page of every
request in it, so per-index counts cost O(live context pages) Python work per step (most of a
long-context replay's time). `unpin` takes exactly what one `pin` call took; "is it pinned?" is
asked only when something is freed, and builds the groups' sets lazily.

Wraps any KVStateMemory; the tree and the request table register their relocation listeners
here and hear every move of the inner memory.

`ops`: when a list (a parallel engine's rank 0), every change to the pools' bytes made outside a
step -- slot copies, zeroed slots, page copies, compaction moves -- is appended to it, in order, as
("copy_slot", src, dst) | ("zero_slot", slot) | ("copy_pages", srcs, dsts) | ("move", kind, src, dst);
the other ranks replay
them on their own pools before the next step (runtime/parallel/mirror.py).
"""
from __future__ import annotations

from k3compile.runtime.memory.base import KVStateMemory, RelocationListener


class _PinGroup:
    """The blocks of one pin call; membership sets are built on first use."""

    __slots__ = ("ids", "_sets")

    def __init__(self, slots: list[int], pages: list[int]):
        self.ids = {"slot": slots, "page": pages}
        self._sets: dict[str, set[int]] = {}

    def has(self, kind: str, i: int) -> bool:
        s = self._sets.get(kind)
        if s is None:
            s = self._sets[kind] = set(self.ids[kind])
        return i in s


class InFlightMemory:
    def __init__(self, inner: KVStateMemory):
        self.inner = inner
        self.spec, self.page_size, self.tensors = inner.spec, inner.page_size, inner.tensors
        self._groups: list[_PinGroup] = []  # one per pin call not yet unpinned
        self._deferred = {"slot": set(), "page": set()}  # freed by their owner, waiting for the last unpin
        self._listeners: list[RelocationListener] = []
        self.ops: list | None = None
        inner.add_relocation_listener(self._moved)

    # ---- allocation ----
    def alloc_slot(self) -> int:
        return self.inner.alloc_slot()

    def alloc_pages(self, n: int) -> list[int]:
        return self.inner.alloc_pages(n)

    def free_slot(self, slot: int) -> None:
        if self._pinned("slot", slot):
            self._deferred["slot"].add(slot)
        else:
            self.inner.free_slot(slot)

    def free_pages(self, pages: list[int]) -> None:
        now = []
        for pg in pages:
            if self._pinned("page", pg):
                self._deferred["page"].add(pg)
            else:
                now.append(pg)
        if now:
            self.inner.free_pages(now)

    def copy_slot(self, src: int, dst: int) -> None:
        self.inner.copy_slot(src, dst)
        if self.ops is not None:
            self.ops.append(("copy_slot", src, dst))

    def zero_slot(self, slot: int) -> None:
        self.inner.zero_slot(slot)
        if self.ops is not None:
            self.ops.append(("zero_slot", slot))

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.inner.copy_pages(src, dst)
        if self.ops is not None:
            self.ops.append(("copy_pages", list(src), list(dst)))

    # ---- pins ----
    def pin(self, slots: list[int], pages: list[int]) -> None:
        for s in slots:
            self.inner.pin_slot(s)
        self.inner.pin_pages(pages)
        self._groups.append(_PinGroup(list(slots), list(pages)))

    def unpin(self, slots: list[int], pages: list[int]) -> None:
        slots, pages = list(slots), list(pages)
        for j in range(len(self._groups) - 1, -1, -1):
            g = self._groups[j]
            if g.ids["slot"] == slots and g.ids["page"] == pages:
                break
        else:
            raise ValueError(f"unpin(slots={slots[:8]}, pages={pages[:8]}...) matches no pin call: unpinned more often "
                             f"than pinned (unpin takes exactly the blocks of one pin call)")
        del self._groups[j]
        released = {kind: {i for i in self._deferred[kind] if g.has(kind, i) and not self._pinned(kind, i)}
                    if self._deferred[kind] else set() for kind in ("slot", "page")}
        self._releasing = released  # relocations during the unpins and frees below re-key these
        try:
            for s in slots:
                self.inner.unpin_slot(s)  # may compact: blocks no longer pinned can move
            self.inner.unpin_pages(pages)
            while released["slot"]:  # one at a time: each free may move the others
                s = released["slot"].pop()
                self._deferred["slot"].discard(s)
                self.inner.free_slot(s)
            if released["page"]:
                self._deferred["page"].difference_update(released["page"])
                self.inner.free_pages(sorted(released["page"]))
        finally:
            self._releasing = None

    def _pinned(self, kind: str, i: int) -> bool:
        return any(g.has(kind, i) for g in self._groups)

    def num_pinned(self) -> int:
        """Distinct pinned blocks."""
        return sum(len(set().union(*(g.ids[kind] for g in self._groups))) for kind in ("slot", "page"))

    def num_deferred(self, kind: str) -> int:
        return len(self._deferred[kind])

    # ---- the rest of the protocol ----
    def num_free_slots(self) -> int:
        return self.inner.num_free_slots()

    def num_free_pages(self) -> int:
        return self.inner.num_free_pages()

    def num_used_slots(self) -> int:
        return self.inner.num_used_slots()

    def num_used_pages(self) -> int:
        return self.inner.num_used_pages()

    def can_fit(self, n_slots: int, n_pages: int) -> bool:
        return self.inner.can_fit(n_slots, n_pages)

    def pin_slot(self, slot: int) -> None:
        self.pin([slot], [])

    def unpin_slot(self, slot: int) -> None:
        self.unpin([slot], [])

    def pin_pages(self, pages: list[int]) -> None:
        self.pin([], list(pages))

    def unpin_pages(self, pages: list[int]) -> None:
        self.unpin([], list(pages))

    def add_relocation_listener(self, fn: RelocationListener) -> None:
        self._listeners.append(fn)

    _releasing: dict | None = None

    def _moved(self, kind: str, old: int, new: int) -> None:
        if self.ops is not None:
            self.ops.append(("move", kind, old, new))
        # Pinned blocks never move; a deferred block moves only between its last unpin and its free.
        for group in (self._deferred[kind], (self._releasing or {}).get(kind, set())):
            if old in group:
                group.discard(old)
                group.add(new)
        for fn in self._listeners:
            fn(kind, old, new)
