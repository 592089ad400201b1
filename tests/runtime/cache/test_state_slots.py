"""StateSlots: the per-request transient slot budget and the three state moves."""
from __future__ import annotations

import pytest
import torch

from k3compile.runtime.cache.state_slots import StateSlots, TooManyStateSlotsError, restore_state, snapshot_state

from .harness import forward, make_memory, state_matches, write_state

T = (3, 1, 4, 1, 5, 9, 2, 6)


def test_restore_copies_the_checkpoint_or_zeroes():
    mem = make_memory(1)
    ckpt, work = mem.alloc_slot(), mem.alloc_slot()
    write_state(mem, ckpt, T[:4])
    write_state(mem, work, T)  # stale contents from an earlier owner
    restore_state(mem, ckpt, work)
    assert state_matches(mem, work, T[:4]) and state_matches(mem, ckpt, T[:4])
    restore_state(mem, None, work)
    assert not mem.tensors.ssm[work].any() and not mem.tensors.conv[work].any()
    snap = mem.alloc_slot()
    write_state(mem, work, T[:6])
    snapshot_state(mem, work, snap)
    forward(mem, work, mem.alloc_pages(8), T, 6, 8)  # the working slot moves on; the snapshot does not
    assert state_matches(mem, snap, T[:6]) and state_matches(mem, work, T)


def test_working_slot_and_snapshots_lifecycle():
    mem = make_memory(1)
    ckpt = mem.alloc_slot()
    write_state(mem, ckpt, T[:2])
    slots = StateSlots(mem)
    with pytest.raises(RuntimeError, match="before the working slot"):
        slots.snapshot(2)
    work = slots.open(ckpt)
    with pytest.raises(RuntimeError, match="already open"):
        slots.open()
    pages = mem.alloc_pages(8)
    forward(mem, work, pages, T, 2, 4)
    s4 = slots.snapshot(4)
    forward(mem, work, pages, T, 4, 6)
    s6 = slots.snapshot(6)
    assert state_matches(mem, s4, T[:4]) and state_matches(mem, s6, T[:6])
    with pytest.raises(ValueError, match="must increase"):
        slots.snapshot(6)
    assert slots.donate(6) == s6 and slots.held() == [work, s4]  # ownership left; nothing freed
    with pytest.raises(KeyError):
        slots.donate(6)
    assert slots.drop_before(6) == 1 and slots.held() == [work]
    mem.free_slot(s6)  # the test stands in for the tree that took it
    slots.release()
    assert slots.held() == [] and mem.live_slots == {ckpt}


def test_at_most_four_transient_slots():
    mem = make_memory(1)
    slots = StateSlots(mem)
    slots.open()
    for pos in (2, 4, 6):
        slots.snapshot(pos)
    free = mem.num_free_slots()
    with pytest.raises(TooManyStateSlotsError, match="at most 4"):
        slots.snapshot(8)
    assert mem.num_free_slots() == free and len(slots.held()) == 4
    slots.drop_before(4)
    slots.snapshot(8, copy=False)  # room again; a step may write this one itself
    slots.release()
    assert not mem.live_slots
    with pytest.raises(ValueError, match=">= 2"):
        StateSlots(mem, max_slots=1)


def test_frees_under_an_arena_that_relocates_while_freeing():
    mem = make_memory(1, num_slots=8, num_pages=4, arena=True)
    slots = StateSlots(mem)
    mem.add_relocation_listener(lambda kind, old, new: kind == "slot" and slots.relocate(old, new))
    work = slots.open()
    for n in (2, 4, 6):
        write_state(mem, work, T[:n])
        slots.snapshot(n)
    mem.move("slot", work)  # moves it up, then compaction moves it back down: bookkeeping follows both
    assert mem.moves == 2 and state_matches(mem, slots.working, T[:6])
    # Freeing the snapshot at 2 moves the one at 6 (the arena's end block) into its place before
    # the one at 4 is freed.
    slots.drop_before(6)
    assert mem.moves == 3 and slots.snapshot_positions() == [6]
    assert state_matches(mem, slots.snapshot_slot(6), T[:6]) and state_matches(mem, slots.working, T[:6])
    slots.release()
    assert not mem.live_slots


def test_snapshot_is_a_device_copy_not_an_alias():
    mem = make_memory(1)
    slots = StateSlots(mem)
    work = slots.open()
    mem.tensors.ssm[work] = 7.0
    snap = slots.snapshot(2)
    mem.tensors.ssm[work] = 9.0
    assert torch.all(mem.tensors.ssm[snap] == 7.0)
