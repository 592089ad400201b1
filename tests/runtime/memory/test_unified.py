"""UnifiedArena: random alloc / free / pin / unpin / copy sequences with live-data checksums.

The model below knows only what the protocol promises: which indices are live (relocation
listeners re-key them), what was written there through the CacheTensors views, and which are
pinned. Byte ranges are read off the views themselves (storage offsets), so the checks also prove
that the ssm / conv / kv views really sit on the arena bytes the allocator believes it handed out.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from k3compile.model_def.cache import CacheSpec
from k3compile.model_def.config import get_preset
from k3compile.runtime.memory.base import OutOfMemoryError
from k3compile.runtime.memory.unified import UnifiedArena

SPEC = CacheSpec.from_config(get_preset("k3-tiny"), dtype=torch.float32)
S = SPEC.slot_bytes


def byte_range(t: torch.Tensor, base: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of a contiguous view `t` inside the uint8 buffer `base`."""
    start = t.data_ptr() - base.data_ptr()
    return start, start + t.numel() * t.element_size()


class ArenaMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([4, 16, 64, 128]), extra=st.integers(0, 8 * S),
                seed=st.integers(0, 2**16))
    def setup(self, page_size, extra, seed):
        # big enough for the padding region plus a few blocks of each kind, small enough to hit OOM
        budget = 3 * S + 3 * SPEC.page_bytes(page_size) + extra
        self.arena = UnifiedArena.from_budget(SPEC, budget, page_size)
        self.gen = torch.Generator().manual_seed(seed)
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # index -> expected (ssm, conv)
        self.pages: dict[int, torch.Tensor] = {}  # index -> expected kv
        self.pins = {"slot": Counter(), "page": Counter()}
        self.arena.add_relocation_listener(self.on_move)

    # --- the owner side: relocation re-keys whatever the owner keeps by index ---
    def on_move(self, kind, old, new):
        live = self.slots if kind == "slot" else self.pages
        assert old in live, f"moved a {kind} that is not live: {old}"
        assert new not in live, f"moved a {kind} onto live {new}"
        assert not self.pins[kind][old], f"moved pinned {kind} {old}"
        # compaction moves toward the band's base: slots down, pages up
        assert (new < old) if kind == "slot" else (new > old)
        live[new] = live.pop(old)
        event(f"{kind} moved")

    def fill_slot(self, i):
        t = self.arena.tensors
        ssm = torch.randn(t.ssm[i].shape, generator=self.gen)
        conv = torch.randn(t.conv[i].shape, generator=self.gen)
        t.ssm[i].copy_(ssm)
        t.conv[i].copy_(conv)
        self.slots[i] = (ssm, conv)

    def fill_page(self, j):
        kv = torch.randn(self.arena.tensors.kv[j].shape, generator=self.gen)
        self.arena.tensors.kv[j].copy_(kv)
        self.pages[j] = kv

    def snapshot(self):
        a = self.arena
        return (a.free_region(), a.num_free_slots(), a.num_free_pages(), a.num_used_slots(),
                a.num_used_pages(), a.num_holes("slot"), a.num_holes("page"), a.compaction_stats(),
                sorted(self.slots), sorted(self.pages))

    # --- rules ---
    @rule()
    def alloc_slot(self):
        before = self.snapshot()
        expect_fit = self.model_can_fit(1, 0)
        try:
            i = self.arena.alloc_slot()
        except OutOfMemoryError:
            event("slot out of memory")
            assert not expect_fit
            assert self.snapshot() == before
            return
        assert expect_fit
        assert i not in self.slots
        self.fill_slot(i)

    @rule(n=st.integers(0, 6))
    def alloc_pages(self, n):
        before = self.snapshot()
        expect_fit = self.model_can_fit(0, n)
        try:
            got = self.arena.alloc_pages(n)
        except OutOfMemoryError:
            event("pages out of memory")
            assert not expect_fit
            assert self.snapshot() == before
            return
        assert expect_fit
        assert len(got) == n == len(set(got)) and not set(got) & set(self.pages)
        for j in got:
            self.fill_page(j)

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def free_slot(self, data):
        i = data.draw(st.sampled_from(sorted(self.slots)))
        if self.pins["slot"][i]:
            before = self.snapshot()
            with pytest.raises(ValueError, match="pinned"):
                self.arena.free_slot(i)
            assert self.snapshot() == before
            return
        del self.slots[i]  # the owner drops its entry before freeing, as runtime owners do
        self.arena.free_slot(i)

    @precondition(lambda self: self.pages)
    @rule(data=st.data())
    def free_pages(self, data):
        unpinned = [j for j in sorted(self.pages) if not self.pins["page"][j]]
        if not unpinned:
            return
        chosen = data.draw(st.lists(st.sampled_from(unpinned), min_size=1, max_size=5, unique=True))
        for j in chosen:
            del self.pages[j]
        self.arena.free_pages(chosen)

    @precondition(lambda self: self.pins["page"])
    @rule(data=st.data())
    def free_pinned_page_is_refused(self, data):
        j = data.draw(st.sampled_from(sorted(self.pins["page"])))
        before = self.snapshot()
        with pytest.raises(ValueError, match="pinned"):
            self.arena.free_pages([j])
        assert self.snapshot() == before

    @rule(index=st.integers(0, 60), kind=st.sampled_from(["slot", "page"]))
    def free_dead_index_is_refused(self, index, kind):
        if index in (self.slots if kind == "slot" else self.pages):
            return
        before = self.snapshot()
        with pytest.raises(ValueError, match="not allocated"):
            self.arena.free_slot(index) if kind == "slot" else self.arena.free_pages([index])
        assert self.snapshot() == before

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def pin_slot(self, data):
        i = data.draw(st.sampled_from(sorted(self.slots)))
        self.arena.pin_slot(i)
        self.pins["slot"][i] += 1

    @precondition(lambda self: self.pins["slot"])
    @rule(data=st.data())
    def unpin_slot(self, data):
        i = data.draw(st.sampled_from(sorted(self.pins["slot"])))
        self.pins["slot"][i] -= 1
        if not self.pins["slot"][i]:
            del self.pins["slot"][i]
        self.arena.unpin_slot(i)

    @precondition(lambda self: self.pages)
    @rule(data=st.data())
    def pin_pages(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.pages)), min_size=1, max_size=3))
        self.arena.pin_pages(chosen)
        self.pins["page"].update(chosen)

    @precondition(lambda self: self.pins["page"])
    @rule(data=st.data())
    def unpin_pages(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.pins["page"])), min_size=1, max_size=3,
                                    unique=True))
        for j in chosen:
            self.pins["page"][j] -= 1
            if not self.pins["page"][j]:
                del self.pins["page"][j]
        self.arena.unpin_pages(chosen)

    @precondition(lambda self: len(self.slots) >= 2 or len(self.pages) >= 2)
    @rule(data=st.data())
    def pin_end_block_then_free_below_it(self, data):
        """The case compaction must defer: the block that would fill the hole is in use."""
        kind = data.draw(st.sampled_from([k for k, d in (("slot", self.slots), ("page", self.pages))
                                          if len(d) >= 2]))
        live = self.slots if kind == "slot" else self.pages
        end = max(live) if kind == "slot" else min(live)  # slots grow up, pages grow down
        below = [i for i in sorted(live) if i != end and not self.pins[kind][i]]
        if not below:
            return
        victim = data.draw(st.sampled_from(below))
        self.pins[kind][end] += 1
        del live[victim]
        if kind == "slot":
            self.arena.pin_slot(end)
            self.arena.free_slot(victim)
        else:
            self.arena.pin_pages([end])
            self.arena.free_pages([victim])
        assert self.arena.num_holes(kind) >= 1

    @precondition(lambda self: self.pins["slot"] or self.pins["page"])
    @rule()
    def unpin_everything(self):
        for kind, pins in self.pins.items():
            held = list(pins.items())
            pins.clear()  # the owner forgets its pins first: unpinning may start compaction moves
            for idx, k in held:
                for _ in range(k):
                    self.arena.unpin_slot(idx) if kind == "slot" else self.arena.unpin_pages([idx])
        assert self.arena.num_holes("slot") == self.arena.num_holes("page") == 0

    @precondition(lambda self: len(self.slots) >= 2)
    @rule(data=st.data())
    def copy_slot(self, data):
        src, dst = data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=2, max_size=2, unique=True))
        self.arena.copy_slot(src, dst)
        self.slots[dst] = tuple(x.clone() for x in self.slots[src])

    @precondition(lambda self: self.slots or self.pages)
    @rule(data=st.data())
    def rewrite(self, data):
        kind = data.draw(st.sampled_from([k for k, d in (("slot", self.slots), ("page", self.pages)) if d]))
        if kind == "slot":
            self.fill_slot(data.draw(st.sampled_from(sorted(self.slots))))
        else:
            self.fill_page(data.draw(st.sampled_from(sorted(self.pages))))

    # --- the model's own view of the geometry, from the views' byte offsets ---
    def slot_range(self, i):
        return byte_range(self.arena.tensors.slot_rows[i], self.arena.buffer)

    def page_range(self, j):
        start, _ = byte_range(self.arena.tensors.kv[j], self.arena.buffer)
        return start, start + self.arena.tensors.kv.stride(0) * self.arena.tensors.kv.element_size()

    def first_slot_row(self):
        # slot rows below this one share bytes with a padding sink (slot 0 or page 0)
        sink_end = max(self.slot_range(0)[1], self.page_range(0)[1])
        return -(-sink_end // S)

    def bands(self):
        """(lowest free slot-side byte, slot holes, highest-free page-side byte, page holes)."""
        a = self.arena
        lo_row = self.first_slot_row()
        top_row = max(self.slots, default=lo_row - 1)
        slot_holes = sum(1 for i in range(lo_row, top_row + 1) if i not in self.slots)
        top_page = a.tensors.num_pages - 1
        bottom_row = min(self.pages, default=top_page + 1)
        page_holes = sum(1 for j in range(bottom_row, top_page + 1) if j not in self.pages)
        return self.slot_range(top_row)[1], slot_holes, bottom_row, page_holes

    def model_can_fit(self, n_slots, n_pages):
        slot_top, slot_holes, bottom_row, page_holes = self.bands()
        grow_s = max(0, n_slots - slot_holes)
        grow_p = max(0, n_pages - page_holes)
        new_slot_top = slot_top + grow_s * S
        if grow_p == 0:
            return new_slot_top <= self.page_range(bottom_row)[0] if bottom_row < self.arena.tensors.num_pages \
                else new_slot_top <= self.arena.buffer.numel()
        new_bottom = bottom_row - grow_p
        return new_bottom >= 0 and self.page_range(new_bottom)[0] >= new_slot_top

    # --- invariants after every step ---
    @invariant()
    def contents_survive(self):
        t = self.arena.tensors
        for i, (ssm, conv) in self.slots.items():
            assert torch.equal(t.ssm[i], ssm) and torch.equal(t.conv[i], conv), f"slot {i} corrupted"
        for j, kv in self.pages.items():
            assert torch.equal(t.kv[j], kv), f"page {j} corrupted"

    @invariant()
    def live_blocks_never_overlap(self):
        ranges = [self.slot_range(0), self.page_range(0)]  # the padding sinks may overlap each other
        blocks = sorted([self.slot_range(i) for i in self.slots] + [self.page_range(j) for j in self.pages])
        assert 0 not in self.slots and 0 not in self.pages, "padding index handed out"
        for (s0, e0), (s1, _) in zip(blocks, blocks[1:]):
            assert e0 <= s1, "live blocks overlap"
        for s, e in blocks:
            assert 0 <= s and e <= self.arena.buffer.numel()
            for rs, re_ in ranges:
                assert e <= rs or s >= re_, "a live block overlaps a padding sink"

    @invariant()
    def counts_are_consistent(self):
        a = self.arena
        assert a.num_used_slots() == len(self.slots) and a.num_used_pages() == len(self.pages)
        slot_top, slot_holes, bottom_row, page_holes = self.bands()
        assert a.num_holes("slot") == slot_holes and a.num_holes("page") == page_holes
        if slot_holes or page_holes:
            event("holes behind a pinned end block")
        # holes exist only behind a pinned end block (slots end at the top, pages at the bottom)
        assert not slot_holes or self.pins["slot"][max(self.slots)]
        assert not page_holes or self.pins["page"][min(self.pages)]
        page_bottom = self.page_range(bottom_row)[0] if self.pages else a.buffer.numel()
        assert a.free_region() == (slot_top, page_bottom)
        assert a.num_free_slots() == slot_holes + (page_bottom - slot_top) // S
        assert a.num_free_pages() == page_holes + (page_bottom - slot_top) // a.page_bytes

    @invariant()
    def free_region_is_one_piece_without_pins(self):
        if self.pins["slot"] or self.pins["page"]:
            return
        slot_top, slot_holes, bottom_row, page_holes = self.bands()
        assert slot_holes == 0 and page_holes == 0
        assert sorted(self.slots) == list(range(self.first_slot_row(), self.first_slot_row() + len(self.slots)))
        top = self.arena.tensors.num_pages
        assert sorted(self.pages) == list(range(top - len(self.pages), top))

    @invariant()
    def stats_add_up(self):
        for kind, d in self.arena.compaction_stats().items():
            unit = S if kind == "slot" else self.arena.page_bytes
            assert d["bytes_moved"] == d["moves"] * unit and d["moves"] <= d["frees"]


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)


# --- directed tests ---

def make(budget=10 * S, page_size=16):
    return UnifiedArena.from_budget(SPEC, budget, page_size)


def test_views_of_every_kind_see_the_arena_bytes():
    a = make()
    i, (j,) = a.alloc_slot(), a.alloc_pages(1)
    a.tensors.ssm[i].fill_(1.5)
    a.tensors.conv[i].fill_(-2.0)
    a.tensors.kv[j].fill_(3.25)
    s0, _ = a.block_bytes("slot", i)
    ssm_raw = a.buffer[s0: s0 + SPEC.ssm_bytes_per_slot].view(torch.float32)
    assert torch.all(ssm_raw == 1.5)
    conv_off = s0 + (SPEC.ssm_bytes_per_slot + 255) // 256 * 256
    assert torch.all(a.buffer[conv_off: conv_off + SPEC.conv_bytes_per_slot].view(torch.float32) == -2.0)
    p0, p1 = a.block_bytes("page", j)
    assert p1 == a.arena_bytes, "the first page sits at the top of the arena"
    assert torch.all(a.buffer[p0: p0 + SPEC.kv_bytes_per_token * 16].view(torch.float32) == 3.25)
    assert a.buffer[s0 - 1 if s0 else 0].item() == 0 and a.buffer[p0 - 1].item() == 0


def test_free_in_the_middle_moves_the_end_block_and_notifies():
    a = make()
    moves = []
    a.add_relocation_listener(lambda *m: moves.append(m))
    slots = [a.alloc_slot() for _ in range(3)]
    a.tensors.ssm[slots[2]].fill_(7.0)
    a.free_slot(slots[0])
    assert moves == [("slot", slots[2], slots[0])]
    assert torch.all(a.tensors.ssm[slots[0]] == 7.0)
    pages = a.alloc_pages(4)
    a.free_pages([pages[0], pages[1]])  # two holes at the top, two live below: two moves
    assert moves[1:] == [("page", pages[3], pages[0]), ("page", pages[2], pages[1])]
    st = a.compaction_stats()
    assert st["slot"] == {"frees": 1, "moves": 1, "bytes_moved": S, "bytes_moved_per_free": float(S)}
    assert st["page"]["moves"] == 2 and st["page"]["bytes_moved_per_free"] == a.page_bytes


def test_freeing_the_end_block_moves_nothing():
    a = make()
    moves = []
    a.add_relocation_listener(lambda *m: moves.append(m))
    s1, s2 = a.alloc_slot(), a.alloc_slot()
    a.free_slot(s2)
    a.free_pages(a.alloc_pages(3))
    assert moves == [] and a.compaction_stats()["page"]["bytes_moved"] == 0


def test_pinned_end_defers_the_hole_until_unpin():
    a = make()
    moves = []
    a.add_relocation_listener(lambda *m: moves.append(m))
    s = [a.alloc_slot() for _ in range(3)]
    a.pin_slot(s[2])
    a.free_slot(s[0])
    assert moves == [] and a.num_holes("slot") == 1
    free_before = a.num_free_slots()
    a.pin_slot(s[2])  # pins are counted
    a.unpin_slot(s[2])
    assert moves == [] and a.num_holes("slot") == 1
    a.unpin_slot(s[2])  # last unpin finishes the compaction
    assert moves == [("slot", s[2], s[0])] and a.num_holes("slot") == 0
    assert a.num_free_slots() == free_before
    # a hole is reused before the band grows
    a.pin_slot(s[1])
    a.free_slot(s[0])
    assert a.num_holes("slot") == 1 and a.alloc_slot() == s[0] and a.num_holes("slot") == 0


def test_out_of_memory_changes_nothing():
    a = make(budget=5 * S)
    free_pages = a.num_free_pages()
    with pytest.raises(OutOfMemoryError) as e:
        a.alloc_pages(free_pages + 1)
    assert e.value.requested == free_pages + 1 and e.value.free == free_pages
    assert a.num_free_pages() == free_pages and a.num_used_pages() == 0
    slots = [a.alloc_slot() for _ in range(a.num_free_slots())]
    region = a.free_region()
    with pytest.raises(OutOfMemoryError, match="KDA state slot"):
        a.alloc_slot()
    assert a.free_region() == region and a.num_used_slots() == len(slots)


def test_both_kinds_share_the_capacity():
    a = make(budget=10 * S, page_size=16)
    pages_only = a.num_free_pages()
    a.alloc_slot()
    # one slot costs ceil(S / P) pages' worth of bytes, no more (no common page size forced)
    assert pages_only - a.num_free_pages() <= -(-S // a.page_bytes)
    assert a.can_fit(0, a.num_free_pages()) and not a.can_fit(1, a.num_free_pages())


def test_bad_calls_raise_clear_errors():
    a = make()
    i = a.alloc_slot()
    with pytest.raises(ValueError, match="not allocated"):
        a.free_slot(0)  # the padding sink
    with pytest.raises(ValueError, match="not allocated"):
        a.free_pages([a.tensors.num_pages - 1])
    with pytest.raises(ValueError, match="freed twice in one call"):
        p = a.alloc_pages(1)
        a.free_pages(p + p)
    with pytest.raises(ValueError, match="unpinned more often"):
        a.unpin_slot(i)
    with pytest.raises(ValueError, match="cannot be pinned"):
        a.pin_pages([0])
    with pytest.raises(ValueError, match="non-negative"):
        a.alloc_pages(-1)
    with pytest.raises(TypeError, match="must be an int"):
        a.free_slot("1")
    with pytest.raises(ValueError, match="too small"):
        UnifiedArena.from_budget(SPEC, S, 16)
    with pytest.raises(ValueError, match="positive"):
        UnifiedArena.from_budget(SPEC, 0, 16)


def test_pages_bigger_than_slots_reserve_enough_low_rows():
    a = make(budget=12 * S, page_size=256)  # a page is several slots wide
    assert a.page_bytes > S and a.reserved_slot_rows > 1
    assert a.reserved_bytes >= a.block_bytes("page", 0)[1]
    i = a.alloc_slot()
    assert a.block_bytes("slot", i)[0] >= a.block_bytes("page", 0)[1]


def test_meta_device_does_bookkeeping_at_k3_size():
    spec = CacheSpec.from_config(get_preset("k3"), dtype=torch.bfloat16, tp_size=8)
    a = UnifiedArena.from_budget(spec, 120 * 2**30, 64, device="meta")
    moves = []
    a.add_relocation_listener(lambda *m: moves.append(m))
    s = [a.alloc_slot() for _ in range(100)]
    p = a.alloc_pages(10_000)
    a.free_slot(s[0])
    a.free_pages(p[:10])
    assert len(moves) == 11 and a.num_used_slots() == 99 and a.num_used_pages() == 9_990
    assert a.compaction_stats()["slot"]["bytes_moved"] == spec.slot_bytes
