"""`protect_reused` (issue 15: stems lost under pressure): state pressure takes checkpoints that never
showed reuse before a shared stem that new requests keep restoring from, even when the stem is the
least recently used and least valuable by the utility; KV pressure keeps the utility order. The eviction order
itself is property-tested in test_value_eviction.py."""
from __future__ import annotations

import pytest

from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache
from k3compile.runtime.cache.recompute_cost import RecomputeCost

from .harness import donate_sequence, make_memory

P = 2
STEM = (7, 7, 7, 7)


def setup(protect: bool, shared_leaves: bool = False):
    mem = make_memory(P, num_slots=32, num_pages=256)
    cache = HybridRadixCache(mem, P, eviction="value", recompute_cost=RecomputeCost(1.0, 0.0), value_weight=0.25,
                             protect_reused=protect, protect_shared_leaves=shared_leaves)
    res, pages = donate_sequence(cache, mem, STEM)  # a stem's state (a template, a tool prefix)
    for _ in range(2):  # two requests restore from it: reuse shown
        assert cache.match(STEM + (1, 2, 3)).cached_len == len(STEM)
    for i in range(4):  # newer one-off tails nobody has used yet (more recent, deeper: higher utility)
        donate_sequence(cache, mem, (i + 10,) * 8)
    return mem, cache


@pytest.mark.parametrize("protect", [False, True])
def test_state_pressure_takes_unused_tails_before_a_reused_stem(protect):
    mem, cache = setup(protect)
    cache.evict_checkpoints(2)
    assert (cache.match(STEM + (5,), touch=False).cached_len == len(STEM)) is protect  # LRU-ish value: the stem went
    cache.evict_checkpoints(2)
    if protect:  # the stem goes only when nothing unproven is left
        assert cache.match(STEM + (5,), touch=False).cached_len == len(STEM)
        assert cache.evict_checkpoints(1) == 1 and cache.num_checkpoints() == 0
    check_cache(cache)


def test_kv_pressure_keeps_the_utility_order():
    """Protection orders state evictions only: under KV pressure the stem leaf goes by utility as
    without it (protecting hit leaves there took live agent sessions' newest leaves first)."""
    for protect in (False, True):
        mem, cache = setup(protect)
        cache.evict_pages(len(STEM) // P)
        assert cache.match(STEM + (5,), touch=False).cached_len == 0
        check_cache(cache)


def test_kv_pressure_takes_a_leaf_restored_from_twice_last_with_protect_shared_leaves():
    """`protect_shared_leaves` (session 10: a prompted-ToT template's state, restored from by 9
    problems, went with its KV under KV pressure once its problems were done): leaves restored
    from by two or more lookups go after every other leaf, and then by utility."""
    mem, cache = setup(True, shared_leaves=True)
    cache.evict_pages(len(STEM) // P)  # one tail (4 pages) goes instead of the stem
    assert cache.match(STEM + (5,), touch=False).cached_len == len(STEM) and cache.num_checkpoints() == 4
    cache.evict_pages(3 * 4)  # the other three tails (4 pages each), not yet the stem
    assert cache.match(STEM + (5,), touch=False).cached_len == len(STEM) and cache.num_checkpoints() == 1
    assert cache.evict_pages(1) == len(STEM) // P and cache.num_checkpoints() == 0
    check_cache(cache)


def test_protect_needs_value_eviction():
    with pytest.raises(ValueError, match="protect_reused"):
        HybridRadixCache(make_memory(P), P, protect_reused=True)
    with pytest.raises(ValueError, match="protect_shared_leaves"):
        HybridRadixCache(make_memory(P), P, protect_shared_leaves=True)
