"""Cache-side bookkeeping of running requests, so that finishing, aborting or retracting one
returns every page and slot it holds: nothing leaks, nothing is freed twice.

A request's page table is the tree's pages of the prefix it has locked (`prefix_len` tokens, read
only) followed by pages it owns (`own_pages`, positions from `prefix_len` on). Its state lives in
transient slots (`StateSlots`). Life of a request, as the scheduler drives it:

    req = table.admit(rid, prompt[:-1])   # match, lock the hit, working slot, copy-on-write restore
    table.ensure_pages(req, n)            # own pages up to n tokens
    ... enqueue a forward whose chunk ends at a chunk-aligned position q (e.g. req.hit.branch_point)
    table.snapshot(req, q)                # right after enqueuing it
    table.donate(req, tokens, q)          # KV [0, q) + the snapshot go to the tree; page table
                                          # rewritten to the tree's pages; lock moves down
    table.finish(req, tokens)             # donate the newest snapshot, then release
    table.release(req)                    # abort or retraction: give everything back

The table listens for relocations: own pages are re-keyed in O(1) (page -> (request, absolute page
index)); a moved slot is looked up among the live requests' few transient slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterator

from .radix import HybridRadixCache, InsertResult, Lock, MatchResult, as_token_tuple
from .state_slots import MAX_TRANSIENT_SLOTS, StateSlots


@dataclass(eq=False)
class CachedRequest:
    rid: Hashable
    lock: Lock  # the tree node ending at prefix_len (KV locked along its path)
    slots: StateSlots
    hit: MatchResult  # what admission matched: cached_len, kv_match_len, branch_point
    own_pages: list[int] = field(default_factory=list)
    live: bool = True

    @property
    def prefix_len(self) -> int:
        """Tokens whose KV the request reads from the tree."""
        return self.lock.node.depth


class RequestTable:
    def __init__(self, cache: HybridRadixCache, max_state_slots: int = MAX_TRANSIENT_SLOTS):
        self.cache, self.memory = cache, cache.memory
        self.page_size, self.max_state_slots = cache.page_size, max_state_slots
        self._live: dict[Hashable, CachedRequest] = {}
        self._page_owner: dict[int, tuple[CachedRequest, int]] = {}  # own page -> (request, absolute page index)
        self.memory.add_relocation_listener(self._on_relocate)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, rid) -> bool:
        return rid in self._live

    def get(self, rid) -> CachedRequest:
        return self._live[rid]

    def requests(self) -> Iterator[CachedRequest]:
        return iter(self._live.values())

    # ------------------------------------------------------------------ lifecycle
    def admit(self, rid: Hashable, token_ids) -> CachedRequest:
        """Match `token_ids` (the prompt without its last token), lock the hit and restore the
        working state from its checkpoint. Raises OutOfMemoryError (nothing held) if no slot is free."""
        if rid in self._live:
            raise ValueError(f"request {rid!r} is already admitted")
        hit = self.cache.match(token_ids)
        lock = self.cache.lock(hit.node)  # pins the checkpoint until the restore copy is queued
        slots = StateSlots(self.memory, self.max_state_slots)
        try:
            slots.open(lock.node.checkpoint)
        except BaseException:
            self.cache.unlock(lock)
            raise
        if lock.pinned:  # the copy is queued: any later writer of that slot comes after it in stream order
            self.cache.unpin_checkpoint(lock)
        req = CachedRequest(rid, lock, slots, hit)
        self._live[rid] = req
        return req

    def page_table(self, req: CachedRequest) -> list[int]:
        self._check_live(req)
        return self.cache.path_pages(req.lock.node) + req.own_pages

    def ensure_pages(self, req: CachedRequest, num_tokens: int) -> list[int]:
        """Own pages so that the page table covers `num_tokens` tokens. Returns the new pages;
        raises OutOfMemoryError (nothing allocated) when the memory has too few."""
        self._check_live(req)
        p = self.page_size
        have = req.prefix_len // p + len(req.own_pages)
        need = -(-num_tokens // p) - have
        if need <= 0:
            return []
        new = self.memory.alloc_pages(need)
        for i, pg in enumerate(new):
            self._page_owner[pg] = (req, have + i)
        req.own_pages.extend(new)
        return new

    def snapshot(self, req: CachedRequest, position: int) -> int:
        """Working state -> a fresh snapshot slot for the state after `position` tokens."""
        self._check_live(req)
        if position <= 0 or position % self.cache.checkpoint_interval:
            raise ValueError(f"snapshots are taken at positive multiples of the checkpoint interval "
                             f"{self.cache.checkpoint_interval}, not at {position}")
        return req.slots.snapshot(position)

    def donate(self, req: CachedRequest, token_ids, position: int) -> InsertResult:
        """Hand KV [0, position) and the snapshot at `position` to the tree.

        Afterwards the request reads [0, result.length) from the tree (its duplicate pages were
        freed, the new ones adopted), holds a lock there, and older snapshots are freed.
        """
        self._check_live(req)
        tokens = as_token_tuple(token_ids)
        p = self.page_size
        if position > len(tokens):
            raise ValueError(f"cannot donate the state after {position} tokens of a {len(tokens)}-token sequence")
        if position < req.prefix_len:
            raise ValueError(f"position {position} lies inside the prefix the request already reads from the "
                             f"tree ({req.prefix_len} tokens)")
        table = self.page_table(req)
        if len(table) * p < position:
            raise ValueError(f"request {req.rid!r} has pages for {len(table) * p} tokens, cannot donate {position}")
        slot = req.slots.snapshot_slot(position)
        result = self.cache.insert(tokens[:position], table[: position // p], slot)
        req.slots.donate(position)  # only now: if insert raised, the slot is still the request's

        # Pages for [prefix_len, result.length) are the tree's now (adopted, or freed as duplicates).
        first = req.prefix_len // p
        taken = result.length // p - first
        for i, pg in enumerate(req.own_pages[:taken]):
            if self._page_owner.get(pg) == (req, first + i):  # a freed duplicate's index may be reused already
                del self._page_owner[pg]
        req.own_pages = req.own_pages[taken:]
        new_lock = self.cache.lock(result.node, pin_checkpoint=False)
        old_lock, req.lock = req.lock, new_lock
        self.cache.unlock(old_lock)
        req.slots.drop_before(position)
        return result

    def fork(self, parent: CachedRequest, rid: Hashable, num_tokens: int) -> CachedRequest:
        """A new request continuing from `parent`'s state after `num_tokens` tokens (n > 1 sampling):
        it locks the node the parent reads from (the tree's KV pages are shared, not copied), gets
        its own working slot restored from the parent's working slot (copy-on-write: KDA state and
        conv windows), and copies of the parent's own pages up to `num_tokens` (the tail past the
        tree prefix). Raises OutOfMemoryError with nothing held when a slot or the pages are missing."""
        self._check_live(parent)
        if rid in self._live:
            raise ValueError(f"request {rid!r} is already admitted")
        p = self.page_size
        copy_from = parent.own_pages[: -(-num_tokens // p) - parent.prefix_len // p]
        slots = StateSlots(self.memory, self.max_state_slots)
        slots.open(parent.slots.working)
        try:
            pages = self.memory.alloc_pages(len(copy_from)) if copy_from else []
        except BaseException:
            slots.release()
            raise
        if pages:
            self.memory.copy_pages(copy_from, pages)
        req = CachedRequest(rid, self.cache.lock(parent.lock.node, pin_checkpoint=False), slots, parent.hit)
        first = req.prefix_len // p
        for i, pg in enumerate(pages):
            self._page_owner[pg] = (req, first + i)
        req.own_pages = list(pages)
        self._live[rid] = req
        return req

    def finish(self, req: CachedRequest, token_ids) -> InsertResult | None:
        """A finished request: donate its newest snapshot (the state after its last aligned
        position, Marconi's end-of-request checkpoint) with the KV before it, then release."""
        positions = req.slots.snapshot_positions()
        result = self.donate(req, token_ids, positions[-1]) if positions else None
        self.release(req)
        return result

    def release(self, req: CachedRequest) -> None:
        """Finish, abort or retract: free own pages and state slots, drop the lock."""
        self._check_live(req)
        first = req.prefix_len // self.page_size
        pages, req.own_pages = req.own_pages, []
        for i, pg in enumerate(pages):
            if self._page_owner.get(pg) == (req, first + i):
                del self._page_owner[pg]
        if pages:
            self.memory.free_pages(pages)
        req.slots.release()  # still live here, so relocations during these frees reach it
        self.cache.unlock(req.lock)
        del self._live[req.rid]
        req.live = False

    # ------------------------------------------------------------------ internals
    def _check_live(self, req: CachedRequest) -> None:
        if not isinstance(req, CachedRequest):
            raise TypeError(f"expected a CachedRequest, got {type(req).__name__}")
        if not req.live or self._live.get(req.rid) is not req:
            raise ValueError(f"request {req.rid!r} was already released (finished, aborted or retracted)")

    def _on_relocate(self, kind: str, old: int, new: int) -> None:
        if kind == "page":
            owner = self._page_owner.pop(old, None)
            if owner is not None:
                req, index = owner
                i = index - req.prefix_len // self.page_size
                if 0 <= i < len(req.own_pages) and req.own_pages[i] == old:
                    req.own_pages[i] = new
                    self._page_owner[new] = owner
        elif kind == "slot":
            for req in self._live.values():
                if req.slots.relocate(old, new):
                    return
