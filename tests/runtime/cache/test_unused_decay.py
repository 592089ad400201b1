"""`unused_ttl`: a progress checkpoint no lookup has restored from is dropped once that many lookups
have passed its anchor (nearest fork above it, or the root) without reaching it; branch points and
checkpoints hit once stay (issue 15: most prompt tails and ends on prompted tree-of-thought are never
hit and held most of the checkpoint bytes). Random trees with hypothesis: after every lookup no
probation checkpoint that could go is older than the ttl, and nothing with shown reuse was dropped."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from k3compile.bench.cache import parse_policy
from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache

from .harness import has_state_at, make_memory, run_random_ops, store_prefix

P = 2  # page size = checkpoint interval


def make(ttl, slots=32, pages=256, max_age=None):
    mem = make_memory(P, num_slots=slots, num_pages=pages)
    return mem, HybridRadixCache(mem, P, unused_ttl=ttl, unused_max_age=max_age)


def test_unused_leaf_is_dropped_after_ttl_lookups_that_miss_it():
    mem, cache = make(ttl=3)
    store_prefix(cache, mem, [1, 1, 2, 2])  # a prompt tail nobody repeats
    for i in range(3):  # unrelated lookups: the anchor (root) sees them, the node does not
        cache.match([9, 9, i, i])
        assert has_state_at(cache, [1, 1, 2, 2])
    cache.match([9, 9, 7, 7])  # starts at age 3 (not over the ttl): kept, and ages to 4
    assert has_state_at(cache, [1, 1, 2, 2])
    cache.match([9, 9, 8, 8])  # starts at age 4 > 3: dropped first
    assert not has_state_at(cache, [1, 1, 2, 2])
    assert cache.stats().checkpoints_expired == 1 and not mem.live_slots and not mem.live_pages
    check_cache(cache)


def test_a_checkpoint_hit_once_stays():
    mem, cache = make(ttl=2)
    store_prefix(cache, mem, [1, 1, 2, 2])
    assert cache.match([1, 1, 2, 2, 5]).cached_len == 4  # a repeat restores there: reuse shown
    for i in range(20):
        cache.match([9, 9, i, i])
    assert has_state_at(cache, [1, 1, 2, 2]) and cache.stats().checkpoints_expired == 0


def test_branch_points_stay():
    mem, cache = make(ttl=1)
    store_prefix(cache, mem, [1, 1, 2, 2, 3, 3])
    store_prefix(cache, mem, [1, 1, 2, 2, 4, 4])
    store_prefix(cache, mem, [1, 1, 2, 2])  # the stem's state, at the fork two paths continue from
    fork = cache.match([1, 1, 2, 2], touch=False).node
    assert len(fork.children) == 2
    for _ in range(10):  # lookups that diverge at the fork: the leaves' anchor sees them
        cache.match([1, 1, 2, 2, 9, 9])
    assert has_state_at(cache, [1, 1, 2, 2])  # the fork's state survives; its unused leaves went
    assert not has_state_at(cache, [1, 1, 2, 2, 3, 3]) and not has_state_at(cache, [1, 1, 2, 2, 4, 4])
    check_cache(cache)


def test_extending_lookups_do_not_age_a_node_and_only_its_anchors_traffic_does():
    mem, cache = make(ttl=2)
    # two forks under the root: stem A = (1, 1) with children, stem B = (5, 5) with children
    store_prefix(cache, mem, [1, 1, 2, 2])
    store_prefix(cache, mem, [1, 1, 3, 3])
    store_prefix(cache, mem, [5, 5, 6, 6])
    store_prefix(cache, mem, [5, 5, 7, 7])
    store_prefix(cache, mem, [1, 1, 3, 3, 4, 4])  # (1, 1, 3, 3) is internal now, on probation
    for _ in range(10):  # traffic under fork B only: (1, 1, 3, 3)'s anchor is fork A, which sees none of it
        cache.match([5, 5, 6, 6])
    assert has_state_at(cache, [1, 1, 3, 3])
    assert not has_state_at(cache, [5, 5, 7, 7])  # its sibling's traffic aged it (anchor: fork B)
    for _ in range(10):  # lookups that go through (1, 1, 3, 3) to the state below extend it: no ageing
        assert cache.match([1, 1, 3, 3, 4, 4, 4]).cached_len == 6
    node = cache.match([1, 1, 3, 3], touch=False).node
    assert node.depth == 4 and node.ckpt_hits == 0 and node.unused_age == 0
    check_cache(cache)


def test_a_quiet_neighbourhood_expires_by_max_age():
    mem, cache = make(ttl=100, max_age=3)
    store_prefix(cache, mem, [1, 1, 2, 2])
    store_prefix(cache, mem, [1, 1, 3, 3])  # a finished search: nothing passes fork (1, 1) again
    for i in range(4):
        cache.match([9, 9, i, i])
        assert has_state_at(cache, [1, 1, 2, 2])
    cache.match([9, 9, 9, 9])  # 4 lookups since the store > 3
    assert not has_state_at(cache, [1, 1, 2, 2]) and not has_state_at(cache, [1, 1, 3, 3])
    assert not mem.live_slots and not mem.live_pages
    check_cache(cache)


def test_a_locked_leaf_stays_until_its_lock_goes():
    mem, cache = make(ttl=1)
    res = store_prefix(cache, mem, [1, 1, 2, 2])
    lk = cache.lock(res.node, pin_checkpoint=False)  # a running request reads it
    for i in range(5):
        cache.match([9, 9, i, i])
    assert has_state_at(cache, [1, 1, 2, 2])
    cache.unlock(lk)
    cache.match([9, 9, 9, 9])
    assert not has_state_at(cache, [1, 1, 2, 2])
    check_cache(cache)


def test_bad_ttl_and_policy_syntax():
    mem = make_memory(P)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="unused_ttl"):
            HybridRadixCache(mem, P, unused_ttl=bad)
    with pytest.raises(ValueError, match="unused_max_age"):
        HybridRadixCache(mem, P, unused_max_age=4)
    assert parse_policy("valued:ttl=0").unused_ttl is None
    assert parse_policy("valued:ttl=8,max_age=64").unused_max_age == 64
    assert parse_policy("valued:ttl=12").unused_ttl == 12


SEQS = st.lists(st.integers(0, 3), min_size=2, max_size=12).map(tuple)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.sampled_from(["store", "match", "lock", "unlock", "evict"]), SEQS), max_size=40),
       ttl=st.sampled_from([1, 2, 5]), max_age=st.sampled_from([None, 3, 8]))
def test_no_probation_checkpoint_outlives_the_ttl(ops, ttl, max_age):
    mem, cache = make(ttl, slots=64, pages=512, max_age=max_age)
    shown = set()  # ids of nodes whose checkpoint was hit (reuse shown)

    def on_match(seq):
        before = {nd.id for nd in cache.nodes() if nd.checkpoint is not None and
                  (nd.id in shown or cache._is_branch(nd))}
        hit = cache.match(seq)
        if hit.node is not cache.root:
            shown.add(hit.node.id)
        after = {nd.id for nd in cache.nodes() if nd.checkpoint is not None}
        # expiry never takes a hit or branch checkpoint (only pressure, not exercised here, could)
        assert before <= after
        for nd in cache.nodes():
            if nd.checkpoint is None or nd.ckpt_hits or cache._is_branch(nd):
                continue
            assert nd.id in cache._probation
            if cache._checkpoint_evictable(nd):  # expired at the start of the lookup if it could go
                assert nd.unused_age <= ttl
                assert max_age is None or cache.stats().lookups - 1 - nd.ckpt_born <= max_age

    run_random_ops(cache, mem, ops, on_match)


def test_root_clock_new_only_ages_root_anchored_checkpoints_by_new_families_only():
    """`root_clock_new_only` (session 10: a one-off's tail, or a new template's first state, is
    anchored at the root, whose plain clock is all traffic; a repeat or the template's third root
    came after 48 lookups into other families): lookups that go into a known family do not age it,
    lookups that match nothing do."""
    for new_only in (False, True):
        mem = make_memory(P, num_slots=32, num_pages=256)
        cache = HybridRadixCache(mem, P, unused_ttl=3, root_clock_new_only=new_only)
        store_prefix(cache, mem, [5, 5, 6, 6])
        cache.match([5, 5, 6, 6, 1])  # a family: its state is hit (exempt from now on)
        store_prefix(cache, mem, [1, 1, 2, 2])  # a one-off's tail
        for i in range(6):  # traffic into the family only
            assert cache.match([5, 5, 6, 6, 7, i]).cached_len == 4
        assert has_state_at(cache, [1, 1, 2, 2]) is new_only
        if new_only:
            for i in range(5):  # new families (no KV match): 4 > 3 at the start of the fifth
                cache.match([9 + i, 9, 9, 9])
            assert not has_state_at(cache, [1, 1, 2, 2])
        check_cache(cache)
