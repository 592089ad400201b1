"""InFlightMemory: pinned blocks never move, frees of pinned blocks wait for the last unpin, and every
index is accounted for exactly once (owned, deferred or free) -- over split pools and the arena."""
import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from k3compile.model_def.cache import CacheSpec
from k3compile.runtime.inflight_memory import InFlightMemory
from k3compile.runtime.memory.base import OutOfMemoryError
from k3compile.runtime.memory.pools import SplitPools
from k3compile.runtime.memory.unified import UnifiedArena

SPEC = CacheSpec(n_kda=2, kda_heads=1, kda_head_k=2, kda_head_v=2, conv_channels=6, conv_window=2, n_mla=1,
                 kv_width=3, dtype=torch.float32)


def test_free_of_pinned_page_waits_for_unpin():
    mem = InFlightMemory(SplitPools(SPEC, 4, 6, 2))
    pages = mem.alloc_pages(3)
    mem.pin([], pages[:2])
    mem.pin([], pages[:1])
    mem.free_pages(pages)
    assert mem.num_used_pages() == 2 and mem.num_deferred("page") == 2
    mem.unpin([], pages[:2])  # pages[0] is still pinned once
    assert mem.num_used_pages() == 1 and mem.num_deferred("page") == 1
    mem.unpin([], pages[:1])
    assert mem.num_used_pages() == 0 and mem.num_deferred("page") == 0
    with pytest.raises(ValueError, match="unpinned more often"):
        mem.unpin([], pages[:1])


class InFlightMachine(RuleBasedStateMachine):
    """Owners hold blocks and sometimes pin a 'batch' of them; frees happen while pinned."""

    @initialize(arena=st.booleans())
    def setup(self, arena):
        page_size = 2
        inner = (UnifiedArena(SPEC, 6 * SPEC.slot_bytes + 12 * SPEC.page_bytes(page_size), page_size) if arena
                 else SplitPools(SPEC, 7, 13, page_size))
        self.mem = InFlightMemory(inner)
        self.owned = {"slot": set(), "page": set()}
        self.batches: list[tuple[list[int], list[int]]] = []
        self.mem.add_relocation_listener(self._moved)

    def _moved(self, kind, old, new):
        pinned = {s for b in self.batches for s in b[0]} if kind == "slot" else {p for b in self.batches for p in b[1]}
        assert old not in pinned, f"pinned {kind} {old} moved"
        if old in self.owned[kind]:
            self.owned[kind].remove(old)
            self.owned[kind].add(new)

    @rule(n=st.integers(1, 3))
    def alloc(self, n):
        try:
            self.owned["page"].update(self.mem.alloc_pages(n))
        except OutOfMemoryError:
            pass
        try:
            self.owned["slot"].add(self.mem.alloc_slot())
        except OutOfMemoryError:
            pass

    @rule(data=st.data())
    def pin_batch(self, data):
        slots = data.draw(st.lists(st.sampled_from(sorted(self.owned["slot"])), max_size=3)) if self.owned["slot"] else []
        pages = data.draw(st.lists(st.sampled_from(sorted(self.owned["page"])), max_size=4)) if self.owned["page"] else []
        self.mem.pin(slots, pages)
        self.batches.append((slots, pages))

    @rule(data=st.data())
    def free_some(self, data):
        for _ in range(data.draw(st.integers(0, 2))):  # one slot at a time: a free may move the others
            if self.owned["slot"]:
                s = data.draw(st.sampled_from(sorted(self.owned["slot"])))
                self.owned["slot"].remove(s)
                self.mem.free_slot(s)
        if self.owned["page"]:
            victims = data.draw(st.sets(st.sampled_from(sorted(self.owned["page"])), max_size=3))
            self.owned["page"] -= victims
            self.mem.free_pages(sorted(victims))

    @rule(i=st.integers(0, 10))
    def unpin_batch(self, i):
        if self.batches:
            slots, pages = self.batches.pop(i % len(self.batches))
            self.mem.unpin(slots, pages)

    @invariant()
    def accounted(self):
        if not hasattr(self, "mem"):
            return
        assert self.mem.num_used_slots() == len(self.owned["slot"]) + self.mem.num_deferred("slot")
        assert self.mem.num_used_pages() == len(self.owned["page"]) + self.mem.num_deferred("page")
        if not self.batches:
            assert self.mem.num_deferred("slot") == self.mem.num_deferred("page") == 0

    def teardown(self):
        while getattr(self, "batches", None):
            self.mem.unpin(*self.batches.pop())
        if hasattr(self, "mem"):
            assert self.mem.num_deferred("slot") == self.mem.num_deferred("page") == 0


TestInFlightMemory = InFlightMachine.TestCase
TestInFlightMemory.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
