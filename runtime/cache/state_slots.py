"""A running request's KDA state slots, and the three state moves between them and the tree.

A request computes in one *working* slot, which every step overwrites. To keep a state for the
cache it takes *snapshots*: extra slots, each a frozen copy of the working state at a chunk-aligned
position, allocated only at the boundary that needs one (SGLang's extra_buffer_lazy). Snapshots are
never written again, so handing one to the tree is safe at any time after its copy was queued.

The moves, each one device operation on the current (forward) stream and no synchronisation:
stream order makes every later kernel see the bytes, and makes the copy see every earlier kernel.
* copy-on-write restore (`restore_state`): the tree's checkpoint is only ever read; the request
  continues from its own copy in the working slot (or from the zero state on a miss).
* snapshot (`snapshot_state`): working slot -> a fresh extra slot. Queue it right after the forward
  that ends at the snapshot's position and before the next forward that writes the working slot
  (with an overlap scheduler: when batch N is launched, not when its results are processed).
* donate (`StateSlots.donate`): the snapshot's index goes to the tree; no bytes move.

Under an overlap scheduler a request can have the snapshot of the chunk in flight plus the one
before it waiting to be donated; a running request holds at most `max_slots` (4) slots in all.
"""
from __future__ import annotations

import operator

from k3compile.runtime.memory.base import KVStateMemory

MAX_TRANSIENT_SLOTS = 4


class TooManyStateSlotsError(RuntimeError):
    """A request asked for more transient state slots than it may hold."""


def zero_state(memory: KVStateMemory, slot: int) -> None:
    """The state before the first token: zero recurrent state and empty conv windows."""
    memory.zero_slot(slot)


def restore_state(memory: KVStateMemory, checkpoint_slot: int | None, working_slot: int) -> None:
    """Copy-on-write restore: checkpoint -> working slot, or the zero state when there is none."""
    if checkpoint_slot is None:
        zero_state(memory, working_slot)
    else:
        memory.copy_slot(checkpoint_slot, working_slot)


def snapshot_state(memory: KVStateMemory, working_slot: int, snapshot_slot: int) -> None:
    memory.copy_slot(working_slot, snapshot_slot)


class StateSlots:
    """Bookkeeping of one request's working slot and pending snapshots (at most `max_slots` in all).

    Frees go one slot at a time: a unified arena may relocate the others while it frees one, and
    its listener reaches `relocate` through the request's owner (RequestTable).
    """

    def __init__(self, memory: KVStateMemory, max_slots: int = MAX_TRANSIENT_SLOTS):
        if not isinstance(max_slots, int) or max_slots < 2:
            raise ValueError(f"max_slots must be an int >= 2 (a working slot and a snapshot), got {max_slots!r}")
        self.memory, self.max_slots = memory, max_slots
        self.working: int | None = None
        self._snapshots: list[list[int]] = []  # [position, slot], positions increasing

    def held(self) -> list[int]:
        return ([] if self.working is None else [self.working]) + [s for _, s in self._snapshots]

    def snapshot_positions(self) -> list[int]:
        return [pos for pos, _ in self._snapshots]

    def snapshot_slot(self, position: int) -> int:
        for pos, slot in self._snapshots:
            if pos == position:
                return slot
        raise KeyError(f"no snapshot at position {position} (have {self.snapshot_positions()})")

    def open(self, checkpoint_slot: int | None = None) -> int:
        """Allocate the working slot and restore it from `checkpoint_slot` (None: zero state)."""
        if self.working is not None:
            raise RuntimeError(f"working slot already open ({self.working})")
        self.working = self.memory.alloc_slot()
        restore_state(self.memory, checkpoint_slot, self.working)
        return self.working

    def snapshot(self, position: int, copy: bool = True) -> int:
        """Allocate an extra slot for the state after `position` tokens and copy the working state
        into it. `copy=False` only allocates (for a step that writes chunk-boundary states itself)."""
        position = operator.index(position)
        if self.working is None:
            raise RuntimeError("snapshot before the working slot was opened")
        if self._snapshots and position <= self._snapshots[-1][0]:
            raise ValueError(f"snapshot positions must increase: {position} after {self._snapshots[-1][0]}")
        if len(self.held()) >= self.max_slots:
            raise TooManyStateSlotsError(
                f"a request holds at most {self.max_slots} state slots (working + snapshots at "
                f"{self.snapshot_positions()}); donate or drop a snapshot first")
        slot = self.memory.alloc_slot()
        if copy:
            snapshot_state(self.memory, self.working, slot)
        self._snapshots.append([position, slot])
        return slot

    def donate(self, position: int) -> int:
        """Give up the snapshot at `position`: its index now belongs to whoever took it (the tree)."""
        for i, (pos, slot) in enumerate(self._snapshots):
            if pos == position:
                del self._snapshots[i]
                return slot
        raise KeyError(f"no snapshot at position {position} (have {self.snapshot_positions()})")

    def drop_before(self, position: int) -> int:
        """Free the snapshots older than `position` (superseded). Returns how many."""
        n = 0
        while self._snapshots and self._snapshots[0][0] < position:
            _, slot = self._snapshots.pop(0)
            self.memory.free_slot(slot)
            n += 1
        return n

    def release(self) -> None:
        """Free every slot held (finish, abort, retraction)."""
        while self._snapshots:
            _, slot = self._snapshots.pop()
            self.memory.free_slot(slot)
        if self.working is not None:
            slot, self.working = self.working, None
            self.memory.free_slot(slot)

    def relocate(self, old: int, new: int) -> bool:
        """A memory moved slot `old` to `new`. Returns whether this request held it."""
        if self.working == old:
            self.working = new
            return True
        for entry in self._snapshots:
            if entry[1] == old:
                entry[1] = new
                return True
        return False
