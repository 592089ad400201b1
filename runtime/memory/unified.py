"""One byte arena for KDA state slots and MLA KV pages (the default memory; `--disable-unified-memory` for split pools).

State slots (`slot_bytes` each) grow up from the low end, KV pages (`page_bytes` each) grow down
from the high end; the bytes between the two bands are the only free region, so capacity follows
the traffic instead of a start-up ratio. The two kinds keep their own sizes (no common page size).

Layout of an arena of N bytes (S = slot_bytes, P = page_bytes, both multiples of 256):

    byte 0                                                                        byte N
    | reserved | slot k | slot k+1 | ... | slot top ->   free   <- page bottom | ... | page R-1 |

* `tensors.ssm/conv` (slot rows) view the whole arena from byte 0: slot i is bytes [i*S, (i+1)*S).
* `tensors.kv` (page rows) views the whole arena aligned to its end: page j is bytes
  [N - (R-j)*P, N - (R-j-1)*P) with R = N // P, so the topmost page is R-1 and pages are handed out
  R-1, R-2, ... Step code indexes slots and pages exactly as with split pools; the allocator makes
  sure live slot rows and live page rows never share a byte.
* Index 0 of each kind is the padding sink (base.py). Slot 0 sits at byte 0; page 0 is the lowest
  page row, within P bytes of byte 0. Both sinks live in a reserved low region of the first `k`
  slot rows, never handed out (k = ceil((start of page 0 + P) / S): 1 for K3, whose page is a few
  percent of a slot); dummy requests may scribble over both sinks at once, which is harmless
  because nothing real lives there.

Compaction. A band is rows at positions 0..count-1 counted from its base (slots: row k + pos,
pages: row R-1 - pos). Freeing a block turns its row into a hole; then, while the band has holes,
either the end row is itself a hole (the band just shrinks) or the live end block is copied into
the hole farthest from the end and every relocation listener hears `fn(kind, old, new)`. Filling
the farthest hole first means each block moves at most once per free.

Pinned blocks (in a batch being built or run, `pin_*`/`unpin_*`, counted) are never moved. If the
end block of a band is pinned, compaction stops there and the remaining holes stay on a small
per-kind hole list; allocations fill holes before growing the band, and the unpin that releases
the end block resumes compaction. Invariants: the free region between the bands is always one
contiguous piece; a band has holes only while its end block is pinned, so with nothing pinned all
free memory is that one piece. Holes never outnumber the blocks freed behind a pinned end block.

Why moves are safe with respect to kernels already enqueued: a move is one copy kernel on the
current (forward) stream. Every step kernel that read or wrote the source or destination rows
was enqueued earlier on the same stream, so the copy starts after they finish and reads the
final bytes; everything enqueued later uses the new index because listeners update the owners'
tables before the next batch's metadata is built. What a move must never do is relocate a block
whose index is already baked into metadata of a batch not yet enqueued (overlap scheduling builds
batch n+1 while batch n runs) -- that is what pins are for. Users of the arena on other streams
(offload, transfer) must order themselves against the forward stream.
"""
from __future__ import annotations

import heapq
import operator
from collections import Counter
from dataclasses import dataclass

import torch

from k3compile.model_def.cache import CacheSpec, CacheTensors

from .base import OutOfMemoryError, RelocationListener

_ALIGN = 256  # slot_bytes and page_bytes are multiples of this; the arena size is rounded to it


@dataclass
class CompactionStats:
    """Per kind: blocks freed, blocks moved by compaction, bytes those moves copied."""
    frees: int = 0
    moves: int = 0
    bytes_moved: int = 0

    @property
    def bytes_moved_per_free(self) -> float:
        return self.bytes_moved / self.frees if self.frees else 0.0

    def as_dict(self) -> dict:
        return {"frees": self.frees, "moves": self.moves, "bytes_moved": self.bytes_moved,
                "bytes_moved_per_free": self.bytes_moved_per_free}


class _Band:
    """Bookkeeping of one kind's band: positions 0..count-1 from the band's base row, holes, pins."""

    def __init__(self, kind: str, label: str, base_row: int, step: int):
        self.kind, self.label = kind, label  # "slot"/"page" for listeners, human label for errors
        self.base_row, self.step = base_row, step  # row = base_row + step * pos
        self.count = 0  # rows in the band, live or hole
        self.holes: set[int] = set()  # positions
        self._hole_heap: list[int] = []  # lazy min-heap of positions (farthest from the end first)
        self.pins: Counter[int] = Counter()  # row -> pin count
        self.stats = CompactionStats()

    def row(self, pos: int) -> int:
        return self.base_row + self.step * pos

    def pos(self, row: int) -> int:
        return (row - self.base_row) * self.step

    def is_live(self, row: int) -> bool:
        p = self.pos(row)
        return 0 <= p < self.count and p not in self.holes

    def num_live(self) -> int:
        return self.count - len(self.holes)

    def add_hole(self, pos: int) -> None:
        self.holes.add(pos)
        heapq.heappush(self._hole_heap, pos)

    def drop_end(self) -> None:
        """The end row is a hole: shrink the band past it."""
        self.holes.remove(self.count - 1)
        self.count -= 1
        if not self.holes:
            self._hole_heap.clear()  # only stale entries are left

    def take_hole(self) -> int:
        """Remove and return the hole farthest from the band's end (lowest position)."""
        while True:
            p = heapq.heappop(self._hole_heap)
            if p in self.holes:  # skip positions that stopped being holes when the band shrank
                self.holes.remove(p)
                return p

    def index(self, row) -> int:
        try:
            return operator.index(row)
        except TypeError:
            raise TypeError(f"{self.label} index must be an int, got {type(row).__name__}") from None

    def check_live(self, row: int, what: str) -> None:
        if not self.is_live(row):
            raise ValueError(f"{self.label} {row} {what}: it is not allocated (freed twice, never "
                             f"allocated, or a reserved padding index)")


class UnifiedArena:
    """KVStateMemory over one uint8 buffer: slots from the low end, pages from the high end."""

    def __init__(self, spec: CacheSpec, arena_bytes: int, page_size: int, device="cpu"):
        if page_size < 1:
            raise ValueError(f"page size must be >= 1, got {page_size}")
        S, P = spec.slot_bytes, spec.page_bytes(page_size)
        N = arena_bytes // _ALIGN * _ALIGN
        self.spec, self.page_size, self.device = spec, page_size, device
        self.slot_bytes, self.page_bytes, self.arena_bytes = S, P, N
        self.num_slot_rows, self.num_page_rows = N // S, N // P
        self._page_base = N - self.num_page_rows * P  # byte offset of page row 0 (< P)
        # Reserve enough low slot rows to cover slot 0 and page 0 (the two padding sinks).
        self.reserved_slot_rows = max(1, -(-(self._page_base + P) // S))
        self.reserved_bytes = self.reserved_slot_rows * S
        if self.reserved_bytes + S + P > N:
            raise ValueError(f"arena of {arena_bytes} B is too small: it must hold the reserved padding "
                             f"region ({self.reserved_bytes} B) plus one state slot ({S} B) and one KV "
                             f"page ({P} B)")
        # device="meta" gives pure bookkeeping (sizes, indices, listeners) without memory: copies
        # become no-ops, which is what the K3-sized capacity simulation uses.
        self.buffer = torch.zeros(N, dtype=torch.uint8, device=device)
        self.tensors = CacheTensors.from_buffers(spec, self.buffer, self.num_slot_rows,
                                                 self.buffer[self._page_base:], self.num_page_rows, page_size)
        self._page_rows = self.buffer[self._page_base:].view(self.num_page_rows, P)
        self._slots = _Band("slot", "KDA state slot", base_row=self.reserved_slot_rows, step=1)
        self._pages = _Band("page", "KV page", base_row=self.num_page_rows - 1, step=-1)
        self._listeners: list[RelocationListener] = []

    @classmethod
    def from_budget(cls, spec: CacheSpec, budget_bytes: int, page_size: int, device="cpu") -> "UnifiedArena":
        if budget_bytes <= 0:
            raise ValueError(f"memory budget must be positive, got {budget_bytes} B")
        return cls(spec, budget_bytes, page_size, device)

    # --- geometry ---
    def _slot_top(self, extra: int = 0) -> int:
        """First byte above the slot band (grown by `extra` rows)."""
        return (self.reserved_slot_rows + self._slots.count + extra) * self.slot_bytes

    def _page_bottom(self, extra: int = 0) -> int:
        """First byte of the page band (grown by `extra` rows)."""
        return self._page_base + (self.num_page_rows - self._pages.count - extra) * self.page_bytes

    def block_bytes(self, kind: str, index: int) -> tuple[int, int]:
        """[start, end) byte range of a slot or page row inside the arena."""
        if kind == "slot":
            return index * self.slot_bytes, (index + 1) * self.slot_bytes
        if kind == "page":
            start = self._page_base + index * self.page_bytes
            return start, start + self.page_bytes
        raise ValueError(f"kind must be 'slot' or 'page', got {kind!r}")

    def free_region(self) -> tuple[int, int]:
        """[start, end) bytes between the two bands."""
        return self._slot_top(), self._page_bottom()

    def free_bytes(self) -> int:
        lo, hi = self.free_region()
        return hi - lo

    def can_fit(self, n_slots: int, n_pages: int) -> bool:
        """Would `n_slots` slots and `n_pages` pages fit at once (holes first, then the free region)?"""
        grow_s = max(0, n_slots - len(self._slots.holes))
        grow_p = max(0, n_pages - len(self._pages.holes))
        return self._slot_top(grow_s) <= self._page_bottom(grow_p)

    # --- allocation ---
    def alloc_slot(self) -> int:
        return self._alloc(self._slots, 1)[0]

    def alloc_pages(self, n: int) -> list[int]:
        return self._alloc(self._pages, n)

    def _alloc(self, band: _Band, n: int) -> list[int]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"number of {band.label}s to allocate must be a non-negative int, got {n!r}")
        if not (self.can_fit(n, 0) if band is self._slots else self.can_fit(0, n)):
            raise OutOfMemoryError(band.label, n, self._num_free(band))
        out = [band.row(band.take_hole()) for _ in range(min(n, len(band.holes)))]
        grow = n - len(out)
        out.extend(band.row(band.count + i) for i in range(grow))
        band.count += grow
        return out

    def free_slot(self, slot: int) -> None:
        self._free(self._slots, [slot])

    def free_pages(self, pages: list[int]) -> None:
        self._free(self._pages, list(pages))

    def _free(self, band: _Band, rows: list[int]) -> None:
        # Validate everything first so a bad call changes nothing.
        rows = [band.index(r) for r in rows]
        if len(set(rows)) != len(rows):
            raise ValueError(f"{band.label}s freed twice in one call: {sorted(rows)}")
        for r in rows:
            band.check_live(r, "cannot be freed")
            if band.pins[r]:
                raise ValueError(f"{band.label} {r} cannot be freed while pinned (unpin it first)")
        for r in rows:
            band.add_hole(band.pos(r))
        band.stats.frees += len(rows)
        self._compact(band)

    def _compact(self, band: _Band) -> None:
        nbytes = self.slot_bytes if band is self._slots else self.page_bytes
        while band.holes:
            end = band.count - 1
            if end in band.holes:  # trailing hole: the band just shrinks
                band.drop_end()
                continue
            src = band.row(end)
            if band.pins[src]:
                return  # the end block is in use by a batch: keep the holes until it is unpinned
            dst = band.row(band.take_hole())
            self.copy_block(band.kind, src, dst)
            band.count -= 1
            band.stats.moves += 1
            band.stats.bytes_moved += nbytes
            for fn in self._listeners:
                fn(band.kind, src, dst)

    # --- pins ---
    def pin_slot(self, slot: int) -> None:
        self._pin(self._slots, [slot])

    def unpin_slot(self, slot: int) -> None:
        self._unpin(self._slots, [slot])

    def pin_pages(self, pages: list[int]) -> None:
        self._pin(self._pages, list(pages))

    def unpin_pages(self, pages: list[int]) -> None:
        self._unpin(self._pages, list(pages))

    def _pin(self, band: _Band, rows: list[int]) -> None:
        rows = [band.index(r) for r in rows]
        for r in rows:
            band.check_live(r, "cannot be pinned")
        band.pins.update(rows)

    def _unpin(self, band: _Band, rows: list[int]) -> None:
        need = Counter(band.index(r) for r in rows)
        for r, k in need.items():
            if band.pins[r] < k:
                raise ValueError(f"{band.label} {r} unpinned more often than pinned")
        band.pins.subtract(need)
        for r in need:
            if not band.pins[r]:
                del band.pins[r]
        self._compact(band)  # finish compaction that a pinned end block deferred

    def is_pinned(self, kind: str, index: int) -> bool:
        return bool(self._band(kind).pins[index])

    # --- the rest of the protocol ---
    def copy_slot(self, src: int, dst: int) -> None:
        self.tensors.copy_slot(src, dst)

    def zero_slot(self, slot: int) -> None:
        self.tensors.zero_slot(slot)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.tensors.copy_pages(src, dst)

    def copy_block(self, kind: str, src: int, dst: int) -> None:
        """Copy a whole slot or page row (what compaction does per move; a mirror replays it).
        One copy kernel on the current stream; see the module docstring for why this is safe."""
        rows = self.tensors.slot_rows if kind == "slot" else self._page_rows
        rows[dst].copy_(rows[src])

    def _num_free(self, band: _Band) -> int:
        """Blocks of this kind that could be allocated now if all free memory went to this kind."""
        lo, hi = self.free_region()
        return len(band.holes) + (hi - lo) // (self.slot_bytes if band is self._slots else self.page_bytes)

    def num_free_slots(self) -> int:
        return self._num_free(self._slots)

    def num_free_pages(self) -> int:
        return self._num_free(self._pages)

    def num_used_slots(self) -> int:
        return self._slots.num_live()

    def num_used_pages(self) -> int:
        return self._pages.num_live()

    def num_holes(self, kind: str) -> int:
        return len(self._band(kind).holes)

    def add_relocation_listener(self, fn: RelocationListener) -> None:
        self._listeners.append(fn)

    def compaction_stats(self) -> dict:
        return {"slot": self._slots.stats.as_dict(), "page": self._pages.stats.as_dict()}

    def _band(self, kind: str) -> _Band:
        if kind == "slot":
            return self._slots
        if kind == "page":
            return self._pages
        raise ValueError(f"kind must be 'slot' or 'page', got {kind!r}")
