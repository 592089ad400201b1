"""The order KV pressure (`evict_pages`) deletes leaves in under the `value` eviction (issue 15, session 13):
`kv_value_weight` weighs recompute saved per byte for KV pressure alone (0: recency alone, SGLang's LRU, while
state pressure keeps Marconi's utility), and `protect_branch_leaves` deletes a leaf that holds a planted branch
point (a shared stem whose sessions are gone) only once no other unlocked leaf is left."""
from __future__ import annotations

import pytest

from k3compile.bench.cache import parse_policy
from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache
from k3compile.runtime.cache.recompute_cost import RecomputeCost

from .harness import has_state_at, make_memory, store_prefix

P = 2  # page size = checkpoint interval
LONG = [1] * 16  # an old, long leaf: many FLOPs saved per byte
SHORT = [2, 2]  # a newer, short one: its state slot is most of what it frees, little recompute saved


def make(**kw):
    mem = make_memory(P, num_slots=16, num_pages=64)
    return mem, HybridRadixCache(mem, P, eviction="value", recompute_cost=RecomputeCost(linear=1.0, attention=0.05),
                                 value_weight=4.0, **kw)


@pytest.mark.parametrize("kv_weight, gone", [(None, SHORT), (0.0, LONG)])
def test_kv_weight_zero_deletes_the_least_recently_used_leaf(kv_weight, gone):
    mem, cache = make(kv_value_weight=kv_weight)
    store_prefix(cache, mem, LONG)
    store_prefix(cache, mem, SHORT)
    assert cache.checkpoint_efficiency(cache.match(LONG, touch=False).node) > \
        cache.checkpoint_efficiency(cache.match(SHORT, touch=False).node)
    cache.evict_pages(1)  # value weight 4: the short leaf's low value outweighs its recency; weight 0: recency alone
    kept = LONG if gone is SHORT else SHORT
    assert not has_state_at(cache, gone) and has_state_at(cache, kept)
    check_cache(cache)


def test_kv_weight_leaves_state_pressure_to_the_value_weight():
    mem, cache = make(kv_value_weight=0.0)
    store_prefix(cache, mem, LONG)
    store_prefix(cache, mem, SHORT)
    cache.evict_checkpoints(1)  # state pressure: Marconi's utility with value_weight 4, the short one goes
    assert not has_state_at(cache, SHORT) and has_state_at(cache, LONG)


def test_a_planted_branch_point_leaf_goes_last_under_kv_pressure():
    mem, cache = make(protect_branch_leaves=True)
    store_prefix(cache, mem, [5, 5, 6, 6, 7, 7])
    store_prefix(cache, mem, [5, 5, 6, 6])  # splits the edge: a planted branch point (a stem) ...
    cache.evict_pages(1)  # ... whose path goes under pressure, leaving the stem a leaf
    (stem,) = cache.nodes()
    assert stem.is_leaf and stem.planted and stem.checkpoint is not None
    store_prefix(cache, mem, [3, 3])  # newer, unprotected leaves
    store_prefix(cache, mem, [4, 4])
    assert cache.evict_pages(1) == 1 and has_state_at(cache, [5, 5, 6, 6])  # not the oldest: the stem stays
    assert cache.evict_pages(1) == 1 and has_state_at(cache, [5, 5, 6, 6])
    assert cache.evict_pages(1) == 2 and not list(cache.nodes())  # nothing else left: now it goes
    check_cache(cache)


def test_protect_branch_leaves_needs_the_value_eviction():
    mem = make_memory(P)
    with pytest.raises(ValueError, match="protect_branch_leaves"):
        HybridRadixCache(mem, P, protect_branch_leaves=True)
    with pytest.raises(ValueError, match="kv_value_weight"):
        HybridRadixCache(mem, P, eviction="value", recompute_cost=RecomputeCost(1.0, 0.05), kv_value_weight=-1.0)


def test_the_policy_keys():
    pol = parse_policy("valued:kv_weight=0,protect_branch=1")
    assert pol.kv_value_weight == 0.0 and pol.protect_branch_leaves
    # `valued` deletes leaves by recency under KV pressure since session 13; the key sets the weight back
    assert parse_policy("valued").kv_value_weight == 0.0 and not parse_policy("valued").protect_branch_leaves
    assert parse_policy("valued:kv_weight=0.25").kv_value_weight == 0.25 and parse_policy("sparse").kv_value_weight is None
