"""Reused lines (`short_unused_ttl` / `short_unused_max_age` / `short_stale_age`): a checkpoint that
continues a line some request already restored from (the nearest checkpoint above it was hit, or
itself continues such a line, and is no branch point) or is anchored at the root keeps the long
ages; every other checkpoint decays on the short ones (issue 15, session 12: short-lived checkpoints
cut prompted tree-of-thought's bytes but cost an agent's tool loop the states its next step restores
from). Random trees with hypothesis: no droppable checkpoint outlives its own limit, none on a line goes before the long one,
and short ages equal to the long ones change nothing."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from k3compile.bench.cache import parse_policy
from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache

from .harness import has_state_at, make_memory, run_random_ops, store_prefix

P = 2  # page size = checkpoint interval


def make(slots=32, pages=256, **kw):
    mem = make_memory(P, num_slots=slots, num_pages=pages)
    return mem, HybridRadixCache(mem, P, **kw)


def node_at(cache, tokens):
    return cache.match(tokens, touch=False).node


def test_a_state_continuing_a_restored_line_keeps_the_long_stale_age():
    mem, cache = make(stale_age=10, short_stale_age=2)
    store_prefix(cache, mem, [1, 1, 8, 8])
    store_prefix(cache, mem, [1, 1, 2, 2])  # a first step's state, under the fork at (1, 1): off any line
    assert cache.match([1, 1, 2, 2, 3]).cached_len == 4  # the next step restores from it ...
    store_prefix(cache, mem, [1, 1, 2, 2, 3, 3])  # ... and stores its own: a line's continuation
    store_prefix(cache, mem, [1, 1, 2, 2, 3, 3, 4, 4])  # below that one, unhit: still on the line
    assert not node_at(cache, [1, 1, 2, 2]).on_line and not node_at(cache, [1, 1, 8, 8]).on_line
    assert node_at(cache, [1, 1, 2, 2, 3, 3]).on_line and node_at(cache, [1, 1, 2, 2, 3, 3, 4, 4]).on_line
    for i in range(4):  # 4 lookups into the sibling (the fork stays one): past the short age, within the long one
        cache.match([1, 1, 8, 8, 5, i])
    assert has_state_at(cache, [1, 1, 2, 2, 3, 3, 4, 4]) and has_state_at(cache, [1, 1, 2, 2, 3, 3])
    assert not has_state_at(cache, [1, 1, 2, 2])  # the line's head, off it, went on the short age
    for i in range(8):
        cache.match([1, 1, 8, 8, 5, i])
    assert not has_state_at(cache, [1, 1, 2, 2, 3, 3]) and not has_state_at(cache, [1, 1, 2, 2, 3, 3, 4, 4])  # long age
    assert has_state_at(cache, [1, 1, 8, 8])  # covered all along
    check_cache(cache)


def test_a_checkpoint_anchored_at_the_root_keeps_the_long_ages():
    """A one-off's tail waits for its repeat (seed 0's tot_fork lost one to the short ages)."""
    mem, cache = make(stale_age=10, short_stale_age=2, unused_ttl=10, short_unused_ttl=1)
    store_prefix(cache, mem, [1, 1, 2, 2])
    assert not node_at(cache, [1, 1, 2, 2]).on_line
    for i in range(6):
        cache.match([9, 9, i, i])
    assert has_state_at(cache, [1, 1, 2, 2])
    for i in range(6):
        cache.match([9, 9, i, i])
    assert not has_state_at(cache, [1, 1, 2, 2])
    check_cache(cache)


def test_siblings_under_a_fork_are_off_the_line_even_when_the_fork_was_hit():
    mem, cache = make(stale_age=10, short_stale_age=2)
    store_prefix(cache, mem, [1, 1, 2, 2])
    store_prefix(cache, mem, [1, 1, 3, 3])  # diverges at (1, 1): a fork's branch point ...
    store_prefix(cache, mem, [1, 1])
    assert cache.match([1, 1, 4]).cached_len == 2  # ... hit, as a template's stem is
    store_prefix(cache, mem, [1, 1, 4, 4])  # a new sibling: a tree search's prompt tail, not a line
    assert not node_at(cache, [1, 1, 4, 4]).on_line
    for i in range(4):  # into another sibling (the fork stays one); the 4th's sweep sees 3 lookups past its store
        cache.match([1, 1, 2, 2, 5, i])
    assert not has_state_at(cache, [1, 1, 4, 4]) and has_state_at(cache, [1, 1, 2, 2])
    check_cache(cache)


def test_a_fresh_tail_off_a_line_leaves_on_the_short_unused_ttl():
    mem, cache = make(unused_ttl=20, short_unused_ttl=2)
    store_prefix(cache, mem, [1, 1, 2, 2])
    store_prefix(cache, mem, [1, 1, 3, 3])  # fork at (1, 1): anchor of both tails
    assert cache.match([1, 1, 2, 2, 5]).cached_len == 4  # (1, 1, 2, 2) restored from: its line
    store_prefix(cache, mem, [1, 1, 2, 2, 5, 5])  # the line's next state (anchor: the fork)
    store_prefix(cache, mem, [1, 1, 3, 3, 6, 6])  # below an unhit tail: off any line
    assert node_at(cache, [1, 1, 2, 2, 5, 5]).on_line and not node_at(cache, [1, 1, 3, 3, 6, 6]).on_line
    for i in range(4):  # lookups through the fork that reach neither
        cache.match([1, 1, 7, i])
    assert has_state_at(cache, [1, 1, 2, 2, 5, 5]) and not has_state_at(cache, [1, 1, 3, 3, 6, 6])
    check_cache(cache)


def test_short_ages_need_long_ones_no_shorter_and_parse():
    mem = make_memory(P)
    with pytest.raises(ValueError, match="short_stale_age"):
        HybridRadixCache(mem, P, short_stale_age=5)  # no stale_age
    with pytest.raises(ValueError, match="short_unused_ttl"):
        HybridRadixCache(mem, P, unused_ttl=4, short_unused_ttl=8)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="short_unused_max_age"):
            HybridRadixCache(mem, P, unused_ttl=4, unused_max_age=8, short_unused_max_age=bad)
    pol = parse_policy("valued:short_stale=15,short_ttl=8,short_max_age=8")
    assert (pol.short_stale_age, pol.short_unused_ttl, pol.short_unused_max_age) == (15, 8, 8)
    assert parse_policy("valued:short_stale=0").short_stale_age is None


SEQS = st.lists(st.integers(0, 3), min_size=2, max_size=12).map(tuple)
OPS = st.lists(st.tuples(st.sampled_from(["store", "match", "lock", "unlock", "evict"]), SEQS), max_size=40)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(ops=OPS, stale=st.sampled_from([3, 6]), short=st.sampled_from([1, 2]))
def test_every_checkpoint_keeps_to_its_own_stale_age(ops, stale, short):
    mem, cache = make(slots=64, pages=512, stale_age=stale, short_stale_age=short, value_weight=0.25)

    def limit_of(nd):  # the long age on a reused line or at the root (the anchor as the sweep sees it)
        return stale if nd.on_line or cache._anchor(nd) is cache.root else short

    def on_match(seq):
        before = {nd.id: (limit_of(nd), max(nd.ckpt_born, nd.last_pass))
                  for nd in cache.nodes() if nd.checkpoint is not None}
        now = cache.stats().lookups
        cache.match(seq)
        after = {nd.id for nd in cache.nodes() if nd.checkpoint is not None}
        for nid, (limit, covered) in before.items():  # no pressure here: whatever left, left stale, past its own age
            assert nid in after or now - covered > limit
        for nd in cache.nodes():  # and nothing droppable stayed past its own age
            if nd.checkpoint is None or len(nd.children) >= 2 or not cache._checkpoint_evictable(nd):
                continue
            assert cache.stats().lookups - 1 - max(nd.ckpt_born, nd.last_pass) <= limit_of(nd)

    run_random_ops(cache, mem, ops, on_match)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=OPS, stale=st.sampled_from([2, 5]), ttl=st.sampled_from([1, 3]))
def test_short_ages_equal_to_the_long_ones_change_nothing(ops, stale, ttl):
    runs = []
    for short in (False, True):
        extra = dict(short_stale_age=stale, short_unused_ttl=ttl, short_unused_max_age=ttl + 1) if short else {}
        mem, cache = make(slots=64, pages=512, stale_age=stale, unused_ttl=ttl, unused_max_age=ttl + 1,
                          value_weight=0.25, **extra)
        trace = []
        run_random_ops(cache, mem, ops, lambda seq: trace.append(cache.match(seq).cached_len))
        runs.append((trace, sorted((nd.depth, nd.key) for nd in cache.nodes() if nd.checkpoint is not None),
                     cache.stats()))
    assert runs[0] == runs[1]
