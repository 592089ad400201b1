"""Unit tests of the hybrid radix cache's tricky paths (the random interleavings are in
test_cache_properties.py)."""
from __future__ import annotations

import pytest
import torch

from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache

from .harness import SPEC, donate_sequence, kv_matches, make_memory, state_matches

A = tuple(range(1, 17))  # 16 tokens
B = A[:10] + (90, 91, 92, 93, 94, 95)  # shares 10 tokens with A


def setup(page_size=1, interval=4, **caps):
    mem = make_memory(page_size, num_slots=caps.pop("num_slots", 16), num_pages=caps.pop("num_pages", 128))
    return mem, HybridRadixCache(mem, interval, **caps)


def owned(cache, mem):
    """Every live index is the tree's (no request in these tests)."""
    check_cache(cache)
    assert {pg for nd in cache.nodes() for pg in nd.pages} == mem.live_pages
    assert {nd.checkpoint for nd in cache.nodes() if nd.checkpoint is not None} == mem.live_slots


def test_empty_tree_misses():
    mem, cache = setup()
    hit = cache.match(A)
    assert (hit.node, hit.cached_len, hit.pages, hit.checkpoint_slot, hit.kv_match_len, hit.branch_point) == \
        (cache.root, 0, [], None, 0, None)


def test_hit_goes_no_deeper_than_the_checkpoint():
    mem, cache = setup()
    res, pages = donate_sequence(cache, mem, A[:8])
    assert res.checkpoint_stored and res.length == 8 and res.pages == pages and res.freed_pages == []
    full = cache.match(A[:8])
    assert full.cached_len == 8 and full.pages == pages and state_matches(mem, full.checkpoint_slot, A[:8])
    # One token short of the checkpoint: the KV matches 7 tokens but no state exists there.
    short = cache.match(A[:7])
    assert (short.cached_len, short.kv_match_len, short.branch_point, short.checkpoint_slot) == (0, 7, 4, None)
    longer = cache.match(A)
    assert (longer.cached_len, longer.kv_match_len, longer.branch_point) == (8, 8, None)
    owned(cache, mem)


def test_split_mid_edge_frees_duplicate_pages_and_leaves_a_tombstone():
    mem, cache = setup()
    _, pages_a = donate_sequence(cache, mem, A)
    res, pages_b = donate_sequence(cache, mem, B[:12])  # diverges at 10: split there (page_size 1)
    assert res.checkpoint_stored and res.length == 12
    assert res.pages[:10] == pages_a[:10] and res.pages[10:] == pages_b[10:]
    assert res.freed_pages == pages_b[:10]  # the duplicates went back to memory
    assert not set(pages_b[:10]) & mem.live_pages
    fork = res.node.parent
    assert fork.depth == 10 and fork.checkpoint is None and len(fork.children) == 2  # internal tombstone
    assert cache.match(A).cached_len == 16 and cache.match(B[:12]).cached_len == 12
    owned(cache, mem)


@pytest.mark.parametrize("page_size,interval,shared", [(1, 4, 10), (16, 32, 40)])
def test_branch_point_is_planted_and_then_restores_directly(page_size, interval, shared):
    mem, cache = setup(page_size, interval)
    n = 4 * interval
    a = tuple(range(1, n + 1))
    b = a[:shared] + tuple(1000 + i for i in range(n - shared))
    donate_sequence(cache, mem, a)  # one checkpoint, at the end of a
    hit = cache.match(b)
    fork = shared - shared % page_size  # KV matches whole pages only
    bp = fork - fork % interval
    assert (hit.cached_len, hit.kv_match_len, hit.branch_point) == (0, fork, bp)
    # The request restores from the zero state, prefills to the branch point, snapshots, donates.
    res, _ = donate_sequence(cache, mem, b[:bp])
    assert res.checkpoint_stored and res.length == bp and res.node.depth == bp
    assert len(res.freed_pages) == bp // page_size  # all of b[:bp] was already in the tree
    again = cache.match(b)
    assert (again.cached_len, again.branch_point) == (bp, None)
    assert state_matches(mem, again.checkpoint_slot, b[:bp])
    assert cache.match(a).cached_len == n  # a's path still whole
    owned(cache, mem)


def test_page_size_16_keys_on_whole_pages():
    mem, cache = setup(16, 16)
    a = tuple(range(1, 33))
    donate_sequence(cache, mem, a)
    mid_page = a[:5] + (99,) + a[6:]
    assert cache.match(mid_page).kv_match_len == 0  # differs inside the first page
    assert cache.match(a[:31]).kv_match_len == 16  # the unaligned tail never matches
    with pytest.raises(ValueError, match="multiple of page_size"):
        cache.insert(a[:20], [1], None)
    with pytest.raises(ValueError, match="multiple of the page size 16"):
        HybridRadixCache(mem, 8)
    # Page-aligned but not chunk-aligned: no checkpoint there.
    mem32 = make_memory(16)
    cache32 = HybridRadixCache(mem32, 32)
    with pytest.raises(ValueError, match="multiple of checkpoint_interval 32"):
        cache32.insert(a[:16], mem32.alloc_pages(1), mem32.alloc_slot())
    owned(cache, mem)


def test_bad_input_is_rejected_without_changing_anything():
    mem, cache = setup()
    _, pages_a = donate_sequence(cache, mem, A[:8])
    before = (mem.live_pages.copy(), mem.live_slots.copy(), cache.stats())
    slot = next(iter(mem.live_slots))
    with pytest.raises(ValueError, match="another position"):
        cache.insert(B[:8][::-1], pages_a, None)  # the tree's pages, for other tokens
    with pytest.raises(ValueError, match="already a checkpoint"):
        cache.insert(A[:4], pages_a[:4], slot)
    with pytest.raises(ValueError, match="need 4 pages"):
        cache.insert(A[:4], pages_a[:3], None)
    with pytest.raises(ValueError, match="duplicate page"):
        cache.insert(A[:2], [pages_a[0], pages_a[0]], None)
    with pytest.raises(ValueError, match="reserved"):
        cache.insert(A[:1], [0], None)
    with pytest.raises(TypeError, match="token ids"):
        cache.match([1.5, 2.0])
    with pytest.raises(ValueError, match="positive multiple"):
        HybridRadixCache(mem, 0)
    with pytest.raises(ValueError, match="max_checkpoints_per_path"):
        HybridRadixCache(mem, 4, max_checkpoints_per_path=0)
    with pytest.raises(ValueError, match="non-negative"):
        cache.evict_pages(-1)
    assert (mem.live_pages, mem.live_slots) == before[:2] and cache.stats() == before[2]
    assert cache.match(torch.tensor(A[:8])).cached_len == 8  # a 1-D tensor of ids works
    owned(cache, mem)


def test_duplicate_checkpoint_frees_the_donated_slot():
    mem, cache = setup()
    donate_sequence(cache, mem, A[:8])
    res, pages = donate_sequence(cache, mem, A[:8])
    assert not res.checkpoint_stored and res.freed_pages == pages and cache.num_checkpoints() == 1
    assert cache.stats().checkpoints_duplicate == 1
    owned(cache, mem)


def test_insert_without_checkpoint_adopts_no_new_tail():
    mem, cache = setup()
    _, pages_a = donate_sequence(cache, mem, A[:8])
    res, pages_b = donate_sequence(cache, mem, A[:6] + (50, 51, 52, 53), checkpoint=False)
    # Shared part deduplicated, the new tail stays with the caller (a leaf without state is never made).
    assert res.length == 6 and res.pages == pages_a[:6] and res.freed_pages == pages_b[:6]
    assert res.node.depth == 6 and res.node.checkpoint is None and not res.node.is_leaf
    assert set(pages_b[6:]) <= mem.live_pages and not set(pages_b[6:]) & {pg for nd in cache.nodes() for pg in nd.pages}
    mem.free_pages(pages_b[6:])
    owned(cache, mem)


def test_tombstone_keeps_kv_and_is_refilled():
    mem, cache = setup()
    donate_sequence(cache, mem, A[:4])
    donate_sequence(cache, mem, A[:8])
    inner = cache.match(A[:4], touch=False).node
    assert cache.evict_checkpoints(1) == 1  # LRU: the node at 4, internal, becomes a tombstone
    assert inner.alive and inner.checkpoint is None and len(inner.pages) == 4
    hit = cache.match(A[:6])
    assert (hit.cached_len, hit.kv_match_len, hit.branch_point) == (0, 6, 4)
    res, _ = donate_sequence(cache, mem, A[:4])
    assert res.checkpoint_stored and res.node is inner and cache.match(A[:6]).cached_len == 4
    owned(cache, mem)


def test_per_path_cap_tombstones_the_lru_ancestor():
    mem, cache = setup(max_checkpoints_per_path=2)
    for n in (4, 8, 12):
        donate_sequence(cache, mem, A[:n])
    depths = sorted(nd.depth for nd in cache.nodes() if nd.checkpoint is not None)
    assert depths == [8, 12]  # the oldest (4) went; its node keeps its KV
    assert cache.match(A[:4], touch=False).kv_match_len == 4
    # Refilling 4 would put 3 on the path 4-8-12; only checkpoints above 4 may make room (none).
    res, _ = donate_sequence(cache, mem, A[:4])
    assert not res.checkpoint_stored and cache.stats().checkpoints_rejected == 1
    owned(cache, mem)


def test_per_path_cap_rejects_when_the_ancestors_are_pinned():
    mem, cache = setup(max_checkpoints_per_path=1)
    donate_sequence(cache, mem, A[:4])
    lock = cache.lock(cache.match(A[:4]).node)  # a request restoring from it
    free_before = len(mem.live_pages)
    res, pages = donate_sequence(cache, mem, A[:8])
    assert not res.checkpoint_stored and res.length == 4 and res.node is lock.node
    assert res.freed_pages == pages[:4]  # the shared part is deduplicated, the tail stays with the caller
    assert set(pages[4:]) <= mem.live_pages and len(mem.live_pages) == free_before + 4
    mem.free_pages(pages[4:])
    cache.unlock(lock)
    res, _ = donate_sequence(cache, mem, A[:8])  # unpinned now: 4 becomes a tombstone
    assert res.checkpoint_stored and cache.match(A[:4], touch=False).node is cache.root
    owned(cache, mem)


def test_per_path_cap_exempts_a_checkpoint_planted_inside_an_edge():
    mem, cache = setup(max_checkpoints_per_path=2)
    donate_sequence(cache, mem, A[:4])
    donate_sequence(cache, mem, A[:12])
    res, _ = donate_sequence(cache, mem, A[:8])  # lands mid-edge: a branch point, not counted
    assert res.checkpoint_stored and res.node.depth == 8
    assert sorted(nd.depth for nd in cache.nodes() if nd.checkpoint is not None) == [4, 8, 12]
    donate_sequence(cache, mem, A[:16])  # a third progress checkpoint: the LRU one (4) goes, never 8
    assert sorted(nd.depth for nd in cache.nodes() if nd.checkpoint is not None) == [8, 12, 16]
    assert cache.match(A[:8], touch=False).cached_len == 8
    owned(cache, mem)


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_forking_requests_keep_the_branch_point_they_planted(eviction):
    """Issue 15: requests over a shared stem, each leaving a prompt-tail and an end checkpoint on its
    own path. The second plants the stem's branch point; its own later checkpoints must not evict it
    (nor may the first request's two checkpoints below block it), so every later request restores."""
    from k3compile.runtime.cache.recompute_cost import RecomputeCost

    mem = make_memory(1, num_slots=32, num_pages=256)
    cache = HybridRadixCache(mem, 4, max_checkpoints_per_path=2, eviction=eviction,
                             recompute_cost=RecomputeCost(1.0, 0.01))
    stem = tuple(range(200, 208))
    hits = []
    for i in range(5):
        seq = stem + tuple(range(10 * i, 10 * i + 12))
        hit = cache.match(seq[:-1])
        hits.append(hit.cached_len)
        if hit.branch_point is not None:  # the scheduler ends a chunk there and donates the state
            donate_sequence(cache, mem, seq[:hit.branch_point])
        donate_sequence(cache, mem, seq[:16])  # prompt tail
        donate_sequence(cache, mem, seq[:20])  # end of the request
    assert hits == [0, 0, 8, 8, 8]
    owned(cache, mem)


@pytest.mark.parametrize("eviction", ["lru", "value"])
@pytest.mark.parametrize("page_size,interval", [(1, 4), (2, 2), (16, 256)])
def test_a_fork_that_loses_a_path_to_the_global_cap_stays_a_branch_point(page_size, interval, eviction):
    """Found by the state machine: a checkpoint stored at a tombstone fork is a branch point (not
    counted by the per-path cap), but making room for it under the global cap can delete one of the
    fork's paths. It must still be a branch point once stored, or the surviving path holds two
    progress checkpoints under a per-path cap of 1."""
    from k3compile.runtime.cache.recompute_cost import RecomputeCost

    mem = make_memory(page_size, num_slots=16, num_pages=3 * 3 * interval // page_size + 8)
    cache = HybridRadixCache(mem, interval, max_checkpoints_per_path=1, max_checkpoints=3, eviction=eviction,
                             recompute_cost=RecomputeCost(1.0, 0.01))
    stem = tuple(range(1, interval + 1))
    x = stem + tuple(range(100, 100 + interval))
    y = stem + tuple(range(200, 200 + interval))
    z = tuple(range(300, 300 + interval))
    donate_sequence(cache, mem, x)
    donate_sequence(cache, mem, y)  # a tombstone fork at the stem's end, over x and y
    donate_sequence(cache, mem, z)
    cache.match(y)
    cache.match(z)  # x is the least recently used (and least valuable per byte: same cost, same bytes as y)
    res, _ = donate_sequence(cache, mem, stem)  # at the cap: x goes to make room, the fork keeps y alone
    assert res.checkpoint_stored and res.node.depth == interval
    assert cache.match(x, touch=False).kv_match_len == interval  # x's own KV went with it
    assert cache.match(y, touch=False).cached_len == 2 * interval  # y's state survives: the stem is a branch point
    owned(cache, mem)  # per-path cap: the stem's checkpoint does not count against y's


def test_global_cap_deletes_the_lru_leaf_with_its_kv():
    mem, cache = setup(max_checkpoints=2)
    seqs = [tuple(range(s, s + 8)) for s in (100, 200, 300)]
    _, first = donate_sequence(cache, mem, seqs[0])
    donate_sequence(cache, mem, seqs[1])
    cache.match(seqs[1])
    donate_sequence(cache, mem, seqs[2])
    assert cache.num_checkpoints() == 2 and cache.match(seqs[0]).kv_match_len == 0
    assert not set(first) & mem.live_pages
    assert cache.stats().nodes_evicted == 1 and cache.stats().checkpoints_evicted == 1
    owned(cache, mem)


def test_global_cap_may_evict_an_ancestor_of_the_new_checkpoint():
    mem, cache = setup(max_checkpoints=2)
    donate_sequence(cache, mem, A[:4])
    donate_sequence(cache, mem, A[:8])
    res, _ = donate_sequence(cache, mem, A[:12])  # the LRU checkpoint is the one at 4, above it
    assert res.checkpoint_stored
    assert sorted(nd.depth for nd in cache.nodes() if nd.checkpoint is not None) == [8, 12]
    assert cache.match(A[:4], touch=False).kv_match_len == 4  # a tombstone: KV kept
    owned(cache, mem)


def test_global_cap_never_evicts_the_leaf_being_split():
    mem, cache = setup(max_checkpoints=1)
    donate_sequence(cache, mem, A[:8])
    res, _ = donate_sequence(cache, mem, A[:4])  # would split the only leaf: rejected, not deleted
    assert not res.checkpoint_stored and cache.match(A[:8]).cached_len == 8
    owned(cache, mem)


def test_global_cap_eviction_under_a_split_leaves_no_tombstone_leaf():
    mem, cache = setup(2, 2, max_checkpoints=2)
    x = (1, 2, 3, 4, 5, 6, 7, 8)
    y = (1, 2, 3, 4, 9, 9, 9, 9)
    donate_sequence(cache, mem, x)
    donate_sequence(cache, mem, y)  # fork at 4: a tombstone over x and y
    cache.evict_checkpoints(1)  # x's leaf goes: the fork has y alone below it
    donate_sequence(cache, mem, (5, 5))
    assert cache.match(x, touch=False).kv_match_len == 4 and cache.num_checkpoints() == 2
    # A checkpoint at 2, inside the fork's edge: the global cap evicts y (LRU), the only thing under
    # the very edge being split; what is left below the split must not stay as a tombstone leaf.
    res, _ = donate_sequence(cache, mem, (1, 2))
    assert res.checkpoint_stored and res.node.depth == 2 and res.node.is_leaf
    assert sorted(nd.depth for nd in cache.nodes()) == [2, 2] and cache.match(y).cached_len == 2
    owned(cache, mem)


def test_lru_touch_refreshes_only_the_consumed_node():
    mem, cache = setup()
    donate_sequence(cache, mem, A[:4])  # X
    donate_sequence(cache, mem, A[:8])  # Y, below X
    w, _ = donate_sequence(cache, mem, (200, 201, 202, 203, 70, 71, 72, 73))  # W, another path, after X and Y
    assert cache.match(A[:9]).cached_len == 8  # consumes Y only
    x = cache.match(A[:4], touch=False).node
    assert cache.evict_checkpoints(1) == 1  # refreshing the whole path would have evicted W instead
    assert x.alive and x.checkpoint is None and w.node.alive
    assert cache.evict_checkpoints(1) == 1  # without the refresh, Y would go before W
    assert not w.node.alive and [nd.depth for nd in cache.nodes() if nd.checkpoint is not None] == [8]


def test_kv_pressure_evicts_lru_unlocked_leaves():
    mem, cache = setup()
    ra, pa = donate_sequence(cache, mem, A)
    rb, pb = donate_sequence(cache, mem, tuple(range(50, 58)))
    cache.match(A)  # refresh A's leaf
    assert cache.evict_pages(1) == 8 and not rb.node.alive and ra.node.alive
    lock = cache.lock(ra.node)
    assert cache.evictable_pages() == 0 and cache.evict_pages(100) == 0 and ra.node.alive
    cache.unlock(lock)
    assert cache.evict_pages(100) == 16 and not mem.live_pages and not mem.live_slots
    assert cache.stats().pages_evicted == 24


def test_locks_protect_checkpoints():
    mem, cache = setup()
    donate_sequence(cache, mem, A[:4])
    leaf, _ = donate_sequence(cache, mem, A[:8])
    inner = leaf.node.parent
    pin = cache.lock(inner)  # pinned checkpoint at 4
    assert pin.pinned and inner.ckpt_lock == 1 and inner.kv_lock == 1
    assert cache.evict_checkpoints(5) == 1 and not leaf.node.alive  # only the leaf could go
    assert inner.checkpoint is not None
    cache.unpin_checkpoint(pin)  # KV still locked, state free to go
    assert inner.is_leaf and cache.evictable_checkpoints() == 0  # a locked leaf keeps its state
    cache.unlock(pin)
    # An internal checkpoint under a KV lock (not pinned) can become a tombstone.
    leaf, _ = donate_sequence(cache, mem, A[:8])
    held = cache.lock(leaf.node, pin_checkpoint=False)
    assert cache.evict_checkpoints(5) == 1 and inner.checkpoint is None and leaf.node.checkpoint is not None
    cache.unlock(held)
    owned(cache, mem)


def test_lock_misuse_raises():
    mem, cache = setup()
    res, _ = donate_sequence(cache, mem, A[:4])
    lock = cache.lock(res.node, pin_checkpoint=False)
    with pytest.raises(ValueError, match="does not pin"):
        cache.unpin_checkpoint(lock)
    cache.unlock(lock)
    with pytest.raises(ValueError, match="already released"):
        cache.unlock(lock)
    assert res.node.kv_lock == 0
    cache.evict_pages(4)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(res.node)
    other = HybridRadixCache(make_memory(1), 4)
    res2, _ = donate_sequence(other, other.memory, A[:4])
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(res2.node)
    with pytest.raises(TypeError):
        cache.unlock(res2.node)


def test_locked_tombstone_leaf_is_deleted_when_the_lock_goes():
    mem, cache = setup()
    donate_sequence(cache, mem, A[:8])
    donate_sequence(cache, mem, A[:4] + (60, 61, 62, 63))
    fork = cache.match(A[:8]).node.parent
    assert fork.depth == 4 and fork.checkpoint is None
    lock = cache.lock(fork)  # a request reading the shared 4 tokens
    assert cache.evict_pages(100) == 8  # both leaves go; the fork stays while locked
    assert fork.alive and fork.is_leaf and len(mem.live_pages) == 4
    check_cache(cache)  # a locked tombstone leaf is allowed
    cache.unlock(lock)
    assert not fork.alive and not mem.live_pages and not mem.live_slots


def test_evicting_a_leaf_state_deletes_tombstone_ancestors():
    mem, cache = setup()
    donate_sequence(cache, mem, A[:8])
    donate_sequence(cache, mem, A[:4] + (60, 61, 62, 63))
    cache.evict_checkpoints(1)  # A's leaf: deleted, the fork keeps the other branch
    assert cache.match(A[:8], touch=False).kv_match_len == 4
    cache.evict_checkpoints(1)  # the other leaf: deleted, and the fork (now a tombstone leaf) with it
    assert not list(cache.nodes()) and not mem.live_pages and not mem.live_slots


@pytest.mark.parametrize("arena", [False, True])
def test_relocation_updates_pages_and_slots(arena):
    mem = make_memory(2, num_slots=8, num_pages=32, arena=arena)
    cache = HybridRadixCache(mem, 4)
    scratch = mem.alloc_pages(3)  # low pages, freed below: an arena fills the holes from the end
    res, pages = donate_sequence(cache, mem, A[:8])
    donate_sequence(cache, mem, A[:4] + (7, 7, 7, 7))
    mem.free_pages(scratch)
    for pg in list(cache.path_pages(res.node)):
        mem.move("page", pg)
    mem.move("slot", res.node.checkpoint)
    assert mem.moves >= 5
    check_cache(cache)
    hit = cache.match(A[:8])
    assert hit.cached_len == 8 and state_matches(mem, hit.checkpoint_slot, A[:8])
    assert kv_matches(mem, hit.pages, A[:8], 8)  # the KV moved with its pages
    owned_pages = {pg for nd in cache.nodes() for pg in nd.pages}
    assert owned_pages == mem.live_pages


def test_stats_count_hits_and_checkpoint_bytes():
    mem, cache = setup(max_checkpoints=1)
    donate_sequence(cache, mem, A[:8])
    cache.match(A[:9])
    cache.match(A[:3] + (77,) * 5)
    s = cache.stats()
    assert (s.lookups, s.query_tokens, s.hit_tokens, s.kv_match_tokens) == (2, 17, 8, 11)
    assert s.hit_rate == 8 / 17
    assert (s.num_checkpoints, s.checkpoint_bytes, s.num_pages, s.inserted_tokens) == (1, SPEC.slot_bytes, 8, 8)
    donate_sequence(cache, mem, (5, 5, 5, 5))
    s = cache.stats()
    assert (s.checkpoints_evicted, s.nodes_evicted, s.pages_evicted, s.peak_checkpoint_bytes) == \
        (1, 1, 8, SPEC.slot_bytes)
    assert s.as_dict()["hit_rate"] == s.hit_rate


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_state_pressure_never_takes_a_fork_before_its_leaves(eviction):
    """A checkpoint at a node two live paths continue from goes only after the leaves below it,
    whatever its recency; with only forks left (their leaves locked), nothing is freed."""
    from k3compile.runtime.cache.recompute_cost import RecomputeCost

    mem = make_memory(1, num_slots=16, num_pages=128)
    cache = HybridRadixCache(mem, 4, eviction=eviction, recompute_cost=RecomputeCost(1.0, 0.1))
    donate_sequence(cache, mem, A[:8])  # the stem: the oldest checkpoint
    donate_sequence(cache, mem, A[:12])
    donate_sequence(cache, mem, A[:8] + (50, 51, 52, 53))  # a second path below the stem: a fork at 8
    fork = cache.match(A[:8], touch=False).node
    assert len(fork.children) == 2 and fork.checkpoint is not None
    locks = [cache.lock(cache.match(s, touch=False).node) for s in (A[:12], A[:8] + (50, 51, 52, 53))]
    assert cache.evict_checkpoints(1) == 0 and fork.checkpoint is not None  # leaves in use, the fork stays
    for lk in locks:
        cache.unlock(lk)
    assert cache.evict_checkpoints(1) == 1 and fork.checkpoint is not None  # a leaf went, not the fork
    assert len(fork.children) == 1  # no longer shared: an ordinary checkpoint, recency decides from here
    assert cache.evict_checkpoints(2) == 2 and cache.num_checkpoints() == 0
    owned(cache, mem)


def test_global_cap_as_a_share_of_the_state_slots():
    mem = make_memory(1, num_slots=16, num_pages=128)
    cache = HybridRadixCache(mem, 4, max_checkpoints=0.25)  # 16 slots (padding slot aside) -> 3 or 4
    cap = cache.max_checkpoints
    assert cap == int(0.25 * (mem.num_free_slots() + mem.num_used_slots()))
    for k in range(cap + 2):
        donate_sequence(cache, mem, (300 + k, 1, 2, 3))
    assert cache.num_checkpoints() == cap
    with pytest.raises(ValueError, match="share of the state slots"):
        HybridRadixCache(mem, 4, max_checkpoints=1.5)
