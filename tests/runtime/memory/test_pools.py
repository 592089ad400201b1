"""SplitPools: the two-pool baseline the unified arena is compared against."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from k3compile.model_def.cache import CacheSpec
from k3compile.model_def.config import get_preset
from k3compile.runtime.memory.base import OutOfMemoryError
from k3compile.runtime.memory.pools import SplitPools

SPEC = CacheSpec.from_config(get_preset("k3-tiny"), dtype=torch.float32)


def test_budget_split_sizes_both_pools():
    budget = 40 * SPEC.slot_bytes
    p = SplitPools.from_budget(SPEC, budget, page_size=16, state_fraction=0.25)
    assert p.total_slots == 10 - 1  # index 0 is the padding sink
    assert p.total_pages == int(budget * 0.75) // SPEC.page_bytes(16) - 1
    with pytest.raises(ValueError, match="state fraction"):
        SplitPools.from_budget(SPEC, budget, 16, state_fraction=1.0)
    with pytest.raises(ValueError, match="too small"):
        SplitPools.from_budget(SPEC, SPEC.slot_bytes, 16)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["slot", "pages", "free_slot", "free_pages"]), st.integers(0, 5)),
                    max_size=40))
def test_random_alloc_free_keeps_pools_disjoint_and_counted(ops):
    p = SplitPools(SPEC, num_slots=6, num_pages=12, page_size=4)
    slots, pages = [], []
    for op, n in ops:
        if op == "slot":
            try:
                slots.append(p.alloc_slot())
            except OutOfMemoryError:
                assert len(slots) == 5
        elif op == "pages":
            before = p.num_free_pages()
            try:
                pages += p.alloc_pages(n)
            except OutOfMemoryError as e:
                assert n > before == p.num_free_pages() == e.free
        elif op == "free_slot" and slots:
            p.free_slot(slots.pop(n % len(slots)))
        elif op == "free_pages" and pages:
            k = n % len(pages) + 1
            p.free_pages(pages[:k])
            del pages[:k]
        assert 0 not in slots and 0 not in pages
        assert len(set(slots)) == len(slots) and len(set(pages)) == len(pages)
        assert p.num_free_slots() + len(slots) == 5 and p.num_free_pages() + len(pages) == 11
    if slots:
        with pytest.raises(ValueError, match="freed twice"):
            p.free_slot(slots[0]) or p.free_slot(slots[0])
