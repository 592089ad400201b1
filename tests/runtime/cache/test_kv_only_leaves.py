"""`decay_keeps_kv`: a leaf whose checkpoint decays (`unused_ttl`, `stale_age`) keeps its KV as a KV-only leaf,
so a later request that diverges inside it still finds where and plants the branch point there (issue 15,
session 13: a never-hit prompt tail on prompted tree-of-thought is mostly a carrier of KV for its next sibling).
Pressure deletes leaves as before; a fork whose other paths are KV only is no fork for eviction or the ages."""
from __future__ import annotations

import pytest

from k3compile.bench.cache import parse_policy
from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache
from k3compile.runtime.cache.recompute_cost import RecomputeCost

from .harness import has_state_at, make_memory, store_prefix

P = 2  # page size = checkpoint interval


def make(keep_kv, **kw):
    mem = make_memory(P, num_slots=16, num_pages=64)
    return mem, HybridRadixCache(mem, P, decay_keeps_kv=keep_kv, **kw)


@pytest.mark.parametrize("keep_kv", [False, True])
def test_a_decayed_tail_keeps_its_kv_and_the_next_sibling_finds_its_branch_point(keep_kv):
    mem, cache = make(keep_kv, unused_ttl=1)
    store_prefix(cache, mem, [1, 1, 2, 2, 3, 3])  # a prompt tail under the root, never hit
    cache.match([9, 9])
    cache.match([8, 8])  # two lookups passed the root without reaching it: over the ttl, dropped at the next
    cache.match([7, 7])
    assert not has_state_at(cache, [1, 1, 2, 2, 3, 3]) and cache.stats().checkpoints_expired == 1
    hit = cache.match([1, 1, 2, 2, 4, 4, 5])  # a sibling diverging after (1, 1, 2, 2)
    if keep_kv:  # the KV is still there: the sibling learns its branch point, a hit for the third sibling
        assert hit.kv_match_len == 4 and hit.branch_point == 4 and cache.num_pages() == 3
        assert [nd.kv_only for nd in cache.nodes()] == [True]
    else:  # the leaf went with its KV
        assert hit.kv_match_len == 0 and hit.branch_point is None and cache.num_pages() == 0
    check_cache(cache)


def test_a_stale_leaf_keeps_its_kv_and_kv_pressure_deletes_it():
    mem, cache = make(True, stale_age=1)
    store_prefix(cache, mem, [1, 1, 2, 2])
    cache.match([9, 9])
    cache.match([8, 8])
    cache.match([7, 7])  # not covered for 3 lookups > 1: the state goes, the KV stays
    assert cache.num_checkpoints() == 0 and cache.num_pages() == 2 and not mem.live_slots
    assert cache.stats().checkpoints_stale == 1
    check_cache(cache)
    assert cache.evict_pages(1) == 2  # KV pressure: the KV-only leaf is a leaf like any other
    assert not list(cache.nodes()) and not mem.live_pages
    check_cache(cache)


def test_a_new_state_at_a_kv_only_leaf_makes_it_an_ordinary_leaf():
    mem, cache = make(True, unused_ttl=1)
    store_prefix(cache, mem, [1, 1, 2, 2])
    for t in (9, 8, 7):
        cache.match([t, t])
    (leaf,) = cache.nodes()
    assert leaf.kv_only and leaf.checkpoint is None
    res = store_prefix(cache, mem, [1, 1, 2, 2])  # the same prefix computed again: its state is stored there
    assert res.node is leaf and res.checkpoint_stored and not leaf.kv_only and has_state_at(cache, [1, 1, 2, 2])
    check_cache(cache)


def test_a_fork_over_a_kv_only_path_is_no_fork():
    """The fork's checkpoint is protected only while two live paths share it: a KV-only path is none."""
    mem, cache = make(True, unused_ttl=1, stale_age=4)
    store_prefix(cache, mem, [1, 1, 2, 2])  # a branch point (stored last: planted at the fork below)
    store_prefix(cache, mem, [1, 1, 2, 2, 3, 3])
    store_prefix(cache, mem, [1, 1, 2, 2, 4, 4])
    fork = cache.match([1, 1, 2, 2], touch=False).node
    assert HybridRadixCache._is_fork(fork)
    cache.match([1, 1, 2, 2, 4, 4, 7])  # (4, 4) is hit: reuse shown, no decay for it
    cache.match([1, 1, 2, 2, 9])
    cache.match([1, 1, 2, 2, 8])  # (3, 3) passed over twice at its anchor: it decays to KV only
    assert not has_state_at(cache, [1, 1, 2, 2, 3, 3]) and len(fork.children) == 2
    assert not HybridRadixCache._is_fork(fork) and HybridRadixCache._paths(fork) == 1
    check_cache(cache)


def test_a_kv_only_leaf_is_allowed_only_with_the_option():
    mem, cache = make(True, unused_ttl=1)
    store_prefix(cache, mem, [1, 1, 2, 2])
    for t in (9, 8, 7):
        cache.match([t, t])
    cache.decay_keeps_kv = False  # the same tree read as a cache without the option: a tombstone leaf
    with pytest.raises(AssertionError, match="unlocked tombstone leaf"):
        check_cache(cache)


def test_the_policy_key():
    assert parse_policy("valued:decay_kv=1").decay_keeps_kv and not parse_policy("valued").decay_keeps_kv


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_kv_pressure_deletes_kv_only_leaves_before_leaves_with_a_state(eviction):
    """A KV-only leaf restores nothing: KV pressure takes it before an older leaf that holds a state (on seeds 1-3 of
    prompted tree-of-thought at 4 MiB, recency alone let KV-only leaves push out stems and repeats' tails)."""
    mem = make_memory(P, num_slots=16, num_pages=64)
    cache = HybridRadixCache(mem, P, decay_keeps_kv=True, unused_ttl=1, eviction=eviction,
                             recompute_cost=RecomputeCost(linear=1.0, attention=0.05) if eviction == "value" else None)
    store_prefix(cache, mem, [5, 5, 6, 6])
    assert cache.match([5, 5, 6, 6, 1]).cached_len == 4  # hit: exempt from the unused ttl
    store_prefix(cache, mem, [1, 1, 2, 2])  # newer, never hit
    for t in (9, 8, 7):
        cache.match([t, t])
    kv_only = [nd for nd in cache.nodes() if nd.kv_only]
    assert len(kv_only) == 1 and kv_only[0].last_access > cache.match([5, 5, 6, 6], touch=False).node.last_access
    assert cache.evict_pages(1) == 2 and not kv_only[0].alive and has_state_at(cache, [5, 5, 6, 6])
    check_cache(cache)
