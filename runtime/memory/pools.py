"""Two separately sized pools: state slots and KV pages, sized from a byte budget and a ratio.

The ratio is the fraction of the budget given to KDA state slots (SGLang's
`--mamba-full-memory-ratio` expresses the same choice as state:KV).
"""
from __future__ import annotations


from k3compile.model_def.cache import CacheSpec, CacheTensors

from .base import OutOfMemoryError, RelocationListener

# SGLang's --mamba-full-memory-ratio r (default 0.9) sizes state : KV = r, i.e. the state pool gets
# r / (1 + r) of the budget. The split users get without tuning.
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9
DEFAULT_STATE_FRACTION = DEFAULT_MAMBA_FULL_MEMORY_RATIO / (1 + DEFAULT_MAMBA_FULL_MEMORY_RATIO)


def state_fraction_from_ratio(ratio: float) -> float:
    """SGLang's state:KV ratio -> the fraction of the budget given to state slots."""
    if ratio <= 0:
        raise ValueError(f"the state:KV memory ratio must be > 0, got {ratio}")
    return ratio / (1 + ratio)


class FreeList:
    """Integer ids 1..n-1 (0 is the reserved padding sink). LIFO reuse keeps hot blocks warm."""

    def __init__(self, n: int, kind: str):
        self.kind, self.capacity = kind, n
        self._free = list(range(n - 1, 0, -1))
        self._used: set[int] = set()

    def alloc(self, k: int = 1) -> list[int]:
        if k > len(self._free):
            raise OutOfMemoryError(self.kind, k, len(self._free))
        out = [self._free.pop() for _ in range(k)]
        self._used.update(out)
        return out

    def free(self, ids) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"{self.kind} {i} freed twice or never allocated")
            self._used.remove(i)
            self._free.append(i)

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return len(self._used)


class SplitPools:
    def __init__(self, spec: CacheSpec, num_slots: int, num_pages: int, page_size: int, device="cpu"):
        if num_slots < 2 or num_pages < 2:
            raise ValueError(f"need at least 2 slots and 2 pages (index 0 is reserved), got {num_slots}/{num_pages}")
        self.spec, self.page_size, self.device = spec, page_size, device
        self.tensors = CacheTensors.allocate(spec, num_slots, num_pages, page_size, device)
        self._slots = FreeList(num_slots, "KDA state slot")
        self._pages = FreeList(num_pages, "KV page")

    @classmethod
    def from_budget(cls, spec: CacheSpec, budget_bytes: int, page_size: int, state_fraction: float = 0.5,
                    device="cpu") -> "SplitPools":
        if not 0.0 < state_fraction < 1.0:
            raise ValueError(f"state fraction must be in (0, 1), got {state_fraction}")
        slots = int(budget_bytes * state_fraction) // spec.slot_bytes
        pages = int(budget_bytes * (1 - state_fraction)) // spec.page_bytes(page_size)
        if slots < 2 or pages < 2:
            raise ValueError(f"memory budget {budget_bytes} B is too small: {slots} state slots "
                             f"({spec.slot_bytes} B each) and {pages} KV pages ({spec.page_bytes(page_size)} B each)")
        return cls(spec, slots, pages, page_size, device)

    def alloc_slot(self) -> int:
        return self._slots.alloc(1)[0]

    def free_slot(self, slot: int) -> None:
        self._slots.free([slot])

    def alloc_pages(self, n: int) -> list[int]:
        return self._pages.alloc(n)

    def free_pages(self, pages: list[int]) -> None:
        self._pages.free(pages)

    def copy_slot(self, src: int, dst: int) -> None:
        self.tensors.copy_slot(src, dst)

    def zero_slot(self, slot: int) -> None:
        self.tensors.zero_slot(slot)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.tensors.copy_pages(src, dst)

    def num_free_slots(self) -> int:
        return self._slots.num_free()

    def num_free_pages(self) -> int:
        return self._pages.num_free()

    def num_used_slots(self) -> int:
        return self._slots.num_used()

    def num_used_pages(self) -> int:
        return self._pages.num_used()

    def can_fit(self, n_slots: int, n_pages: int) -> bool:
        return n_slots <= self.num_free_slots() and n_pages <= self.num_free_pages()

    # split pools never move blocks: pins and relocation listeners have nothing to do
    def pin_slot(self, slot: int) -> None:
        pass

    def unpin_slot(self, slot: int) -> None:
        pass

    def pin_pages(self, pages: list[int]) -> None:
        pass

    def unpin_pages(self, pages: list[int]) -> None:
        pass

    def add_relocation_listener(self, fn: RelocationListener) -> None:
        pass

    @property
    def total_slots(self) -> int:
        return self._slots.capacity - 1

    @property
    def total_pages(self) -> int:
        return self._pages.capacity - 1
