"""`stale_age`: any checkpoint -- hit ones and branch points too -- that no lookup has covered (passed
through or restored from) for more than that many lookups since its store is dropped, pressure or not;
a fork that still has two paths stays (issue 15, session 10: on prompted tree-of-thought half of the
state bytes `valued` held were states after their last hit). Random trees with hypothesis: after
every lookup no droppable checkpoint is staler than the limit, and no fork lost its state."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from k3compile.bench.cache import parse_policy
from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache

from .harness import has_state_at, make_memory, run_random_ops, store_prefix

P = 2  # page size = checkpoint interval


def make(stale, slots=32, pages=256, **kw):
    mem = make_memory(P, num_slots=slots, num_pages=pages)
    return mem, HybridRadixCache(mem, P, stale_age=stale, **kw)


def test_a_hit_checkpoint_goes_once_no_lookup_covers_it():
    mem, cache = make(stale=3)
    store_prefix(cache, mem, [1, 1, 2, 2])
    assert cache.match([1, 1, 2, 2, 5]).cached_len == 4  # hit: reuse shown (lookup 1 covers it)
    for i in range(3):  # 3 lookups elsewhere: not over the limit yet
        cache.match([9, 9, i, i])
    assert has_state_at(cache, [1, 1, 2, 2])
    cache.match([9, 9, 7, 7])  # 4 lookups since it was last covered > 3: dropped before this walk
    cache.match([9, 9, 8, 8])
    assert not has_state_at(cache, [1, 1, 2, 2])
    assert cache.stats().checkpoints_stale == 1 and not mem.live_slots and not mem.live_pages
    check_cache(cache)


def test_passing_through_keeps_a_checkpoint():
    mem, cache = make(stale=2)
    store_prefix(cache, mem, [1, 1, 2, 2])
    for i in range(10):  # every lookup goes through (1, 1, 2, 2) and beyond: covered each time
        cache.match([1, 1, 2, 2, 3, i])
    assert has_state_at(cache, [1, 1, 2, 2]) and cache.stats().checkpoints_stale == 0


def test_a_fork_stays_while_younger_paths_below_it_do():
    mem, cache = make(stale=3)
    store_prefix(cache, mem, [1, 1, 2, 2, 3, 3])
    store_prefix(cache, mem, [1, 1, 2, 2, 4, 4])
    store_prefix(cache, mem, [1, 1, 2, 2])  # the fork's state, stored at lookup 0
    for i in range(3):
        cache.match([9, 9, i, i])
    # younger checkpoints below both paths (born at lookup 3; stored without a lookup covering the
    # fork, as when a long prefill stores a state well after its admission lookup)
    store_prefix(cache, mem, [1, 1, 2, 2, 3, 3, 5, 5])
    store_prefix(cache, mem, [1, 1, 2, 2, 4, 4, 6, 6])
    cache.match([9, 9, 7, 7])
    cache.match([9, 9, 8, 8])  # the fork, (3, 3) and (4, 4) are stale: the two become tombstones, the fork stays
    assert has_state_at(cache, [1, 1, 2, 2]) and not has_state_at(cache, [1, 1, 2, 2, 3, 3])
    assert has_state_at(cache, [1, 1, 2, 2, 3, 3, 5, 5]) and has_state_at(cache, [1, 1, 2, 2, 4, 4, 6, 6])
    for i in range(4):
        cache.match([9, 9, i, i])
    assert cache.num_checkpoints() == 0 and not mem.live_pages  # then all went, deepest first
    check_cache(cache)


def test_bad_stale_age_and_policy_syntax():
    mem = make_memory(P)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="stale_age"):
            HybridRadixCache(mem, P, stale_age=bad)
    assert parse_policy("valued:stale=0").stale_age is None
    assert parse_policy("valued:stale=300").stale_age == 300


SEQS = st.lists(st.integers(0, 3), min_size=2, max_size=12).map(tuple)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.sampled_from(["store", "match", "lock", "unlock", "evict"]), SEQS), max_size=40),
       stale=st.sampled_from([1, 2, 5]), ttl=st.sampled_from([None, 2]))
def test_no_droppable_checkpoint_is_staler_than_the_limit(ops, stale, ttl):
    mem, cache = make(stale, slots=64, pages=512, unused_ttl=ttl, value_weight=0.25)

    def on_match(seq):
        forks = {nd.id for nd in cache.nodes() if nd.checkpoint is not None and len(nd.children) >= 2}
        cache.match(seq)
        for nd in cache.nodes():
            if nd.id in forks and len(nd.children) >= 2:  # still a fork: its state did not go
                assert nd.checkpoint is not None
            if nd.checkpoint is None or len(nd.children) >= 2 or not cache._checkpoint_evictable(nd):
                continue
            # swept at the start of this lookup (lookups - 1 then): nothing droppable over the limit
            assert cache.stats().lookups - 1 - max(nd.ckpt_born, nd.last_pass) <= stale

    run_random_ops(cache, mem, ops, on_match)


def test_with_root_clock_new_only_a_root_anchored_checkpoint_goes_stale_by_new_families_only():
    """A one-off's tail that a repeat restored from once is anchored at the root: traffic into other
    families does not make it stale, new families (lookups that match nothing) do (session 10: a
    second repeat came 450 lookups after the first on a prompted-ToT trace)."""
    mem, cache = make(stale=3, root_clock_new_only=True)
    store_prefix(cache, mem, [5, 5, 6, 6])
    store_prefix(cache, mem, [1, 1, 2, 2])
    assert cache.match([1, 1, 2, 2, 3]).cached_len == 4  # the first repeat
    for i in range(10):  # the family at (5, 5, 6, 6) keeps being hit, so it stays too
        cache.match([5, 5, 6, 6, 7, i])
    assert has_state_at(cache, [1, 1, 2, 2])
    for i in range(5):
        cache.match([9 + i, 9, 9, 9])
    assert not has_state_at(cache, [1, 1, 2, 2])
    assert not has_state_at(cache, [5, 5, 6, 6])  # anchored at the root as well: the new families aged it too
    check_cache(cache)


@pytest.mark.parametrize("unused_global", [False, True])
def test_root_stale_unused_global_ages_only_never_hit_root_anchored_checkpoints_on_all_traffic(unused_global):
    """`root_stale_unused_global` (session 12): on the root's new-family clock a one-off tail that no repeat ever
    came for was held to the end of a prompted-ToT trace (that clock hardly moves there). With the flag a never-hit
    root-anchored checkpoint goes stale on all traffic; one a repeat restored from still waits for new families."""
    mem, cache = make(stale=3, root_clock_new_only=True, root_stale_unused_global=unused_global)
    store_prefix(cache, mem, [1, 1, 2, 2])  # a repeat will restore from it
    store_prefix(cache, mem, [5, 5, 6, 6])  # a family with traffic
    store_prefix(cache, mem, [3, 3, 4, 4])  # a one-off tail nobody restores from
    assert cache.match([1, 1, 2, 2, 9]).cached_len == 4
    for i in range(6):  # traffic into the (5, 5, 6, 6) family only: no new family, nothing covers the other two
        assert cache.match([5, 5, 6, 6, 7, i]).cached_len == 4
    assert has_state_at(cache, [1, 1, 2, 2]) and has_state_at(cache, [5, 5, 6, 6])
    assert has_state_at(cache, [3, 3, 4, 4]) is not unused_global
    assert cache.stats().checkpoints_stale == int(unused_global)
    check_cache(cache)
    assert parse_policy("valued:root_stale=1").root_stale_unused_global
    assert not parse_policy("valued:root_stale=0").root_stale_unused_global

