"""Checkpoint listeners (HybridRadixCache.add_checkpoint_listener): every admitted checkpoint is told
once as "store" with a fresh serial, every lookup that restores from it as "hit", and its leaving the
tree (caps, pressure, decay, KV eviction) as "drop". The benchmark's oracle (bench/cache_replay.py
oracle_held) is built on these events, so they must follow the tree exactly: random operation
sequences with hypothesis check that the listener's live set is the tree's."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from k3compile.runtime.cache.radix import HybridRadixCache

from .harness import make_memory, run_random_ops, store_prefix

P = 2  # page size = checkpoint interval


def make(**kw):
    mem = make_memory(P, num_slots=kw.pop("slots", 32), num_pages=kw.pop("pages", 256))
    cache = HybridRadixCache(mem, P, **kw)
    events = []
    cache.add_checkpoint_listener(lambda event, serial: events.append((event, serial)))
    return mem, cache, events


def test_store_hit_and_drop_are_told_with_the_checkpoints_serial():
    mem, cache, events = make(max_checkpoints_per_path=1)
    store_prefix(cache, mem, [1, 1, 2, 2])
    assert events == [("store", 1)]
    assert cache.match([1, 1, 2, 2, 5]).cached_len == 4  # a repeat restores from serial 1
    cache.match([7, 7, 7])  # a miss tells nothing
    cache.match([1, 1, 2, 2, 5], touch=False)  # nor does a dry run
    assert events == [("store", 1), ("hit", 1)]
    store_prefix(cache, mem, [1, 1, 2, 2, 3, 3])  # the per-path cap of 1 drops serial 1 for serial 2
    assert events[2:] == [("drop", 1), ("store", 2)]
    cache.evict_pages(cache.evictable_pages())
    assert events[-1] == ("drop", 2) and cache.num_checkpoints() == 0
    store_prefix(cache, mem, [1, 1, 2, 2])  # the same place stored again: a new serial
    assert events[-1] == ("store", 3)
    with pytest.raises(TypeError, match="callable"):
        cache.add_checkpoint_listener(42)


def test_decay_tells_drop():
    mem, cache, events = make(unused_ttl=1)
    store_prefix(cache, mem, [1, 1, 2, 2])
    for i in range(3):
        cache.match([9, 9, i, i])
    assert events == [("store", 1), ("drop", 1)] and cache.stats().checkpoints_expired == 1


SEQS = st.lists(st.integers(0, 3), min_size=2, max_size=12).map(tuple)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.sampled_from(["store", "match", "lock", "unlock", "evict", "evict_states"]), SEQS),
                    max_size=40),
       per_path=st.sampled_from([None, 1, 2]), total=st.sampled_from([None, 3]), ttl=st.sampled_from([None, 2]))
def test_the_listeners_live_set_is_the_trees(ops, per_path, total, ttl):
    mem, cache, events = make(slots=64, pages=512, max_checkpoints_per_path=per_path, max_checkpoints=total,
                              unused_ttl=ttl)
    live, stored, seen = set(), set(), 0

    def follow():
        nonlocal seen
        for event, serial in events[seen:]:
            if event == "store":
                assert serial == max(stored, default=0) + 1  # serials count stores
                stored.add(serial)
                live.add(serial)
            elif event == "drop":
                live.remove(serial)  # KeyError: a drop of something not live
            else:
                assert serial in live, f"hit on a checkpoint that is not in the tree: {serial}"
        seen = len(events)
        assert live == {nd.ckpt_serial for nd in cache.nodes() if nd.checkpoint is not None}

    def on_match(seq):
        before = len(events)
        hit = cache.match(seq)
        hits = [s for e, s in events[before:] if e == "hit"]
        assert hits == ([] if hit.node is cache.root else [hit.node.ckpt_serial])

    run_random_ops(cache, mem, ops, on_match, after_op=follow)
