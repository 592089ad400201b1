"""Property tests of the FLOP-aware ("value") eviction: on random trees (shared stems, forks,
repeats), with random locks and pins, every eviction takes the lowest-utility candidate, never a
branch point that live paths still share while any other candidate exists, never a pinned or
in-use checkpoint; and the recompute cost model is additive."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache
from k3compile.runtime.cache.recompute_cost import RecomputeCost

from .harness import donate_sequence, make_memory

STEMS = [tuple(range(100, 116)), tuple(range(100, 108)) + tuple(range(300, 308)), tuple(range(400, 416))]
SEQS = st.builds(lambda stem, cut, tail: STEMS[stem][:cut] + tuple(tail), st.integers(0, 2), st.integers(0, 16),
                 st.lists(st.integers(0, 3), min_size=0, max_size=12))
COSTS = st.builds(RecomputeCost, st.floats(0.1, 10.0), st.floats(0.0, 1.0))


def build(seqs, cost, weight, page_size, locks, eviction="value", protect=False):
    mem = make_memory(page_size, num_slots=64, num_pages=512)
    cache = HybridRadixCache(mem, 2 * page_size, eviction=eviction, recompute_cost=cost, value_weight=weight,
                             protect_reused=protect)
    g = cache.checkpoint_interval
    for seq in seqs:
        n = len(seq) // g * g
        if n:
            res, pages = donate_sequence(cache, mem, seq[:n])
            mem.free_pages(pages[res.length // page_size:])  # what the tree did not adopt stays the caller's
    held = []
    for i, pin in locks:
        nodes = sorted(cache.nodes(), key=lambda nd: nd.id)
        if nodes:
            held.append(cache.lock(nodes[i % len(nodes)], pin_checkpoint=pin))
    return mem, cache, held


def utilities(cache, candidates, clock):
    """Marconi's utility of each candidate, computed independently of the cache's own code path:
    recency + weight * FLOPs-saved-per-byte, both min-max normalised."""
    slot, page = cache.memory.spec.slot_bytes, cache.memory.spec.page_bytes(cache.page_size)

    def efficiency(nd):
        anc = nd.parent
        while anc is not cache.root and anc.checkpoint is None:
            anc = anc.parent
        freed = slot + (len(nd.pages) * page if nd.is_leaf else 0)
        return cache.recompute_cost.prefill(anc.depth, nd.depth) / freed

    def norm(xs):
        lo, hi = min(xs), max(xs)
        return [(x - lo) / (hi - lo) if hi > lo else 0.0 for x in xs]

    rec, eff = [getattr(nd, clock) for nd in candidates], [efficiency(nd) for nd in candidates]
    return {nd.id: r + cache.value_weight * e for nd, r, e in zip(candidates, norm(rec), norm(eff))}


def unproven_first(nodes, protect):
    """`protect_reused`, computed independently: candidates never restored from and not branch points
    (a fork, or planted) while there are any."""
    if not protect:
        return nodes
    fresh = [nd for nd in nodes if not (nd.ckpt_hits or len(nd.children) >= 2 or nd.planted)]
    return fresh or nodes


@settings(max_examples=120, deadline=None)
@given(seqs=st.lists(SEQS, min_size=1, max_size=14), cost=COSTS, weight=st.sampled_from([0.0, 0.5, 1.0, 4.0]),
       page_size=st.sampled_from([1, 2]), locks=st.lists(st.tuples(st.integers(0, 100), st.booleans()), max_size=3),
       touches=st.lists(SEQS, max_size=6), eviction=st.sampled_from(["lru", "value", "value+protect"]))
def test_checkpoint_eviction_order(seqs, cost, weight, page_size, locks, touches, eviction):
    """Both policies: never a pinned checkpoint, never a fork's (two live paths continue from it:
    its leaves go first, which makes it an ordinary checkpoint), and among the rest the lowest
    utility ("value") or the least recently used ("lru"); it gives up only when nothing else is left.
    With protect_reused, a checkpoint that was hit or is a branch point only when no other can go."""
    protect = eviction == "value+protect"
    eviction = eviction.removesuffix("+protect")
    mem, cache, held = build(seqs, cost, weight, page_size, locks, eviction, protect)
    for t in touches:  # hits refresh recency
        cache.match(t)
    while True:
        candidates = [nd for nd in cache.nodes() if nd.checkpoint is not None and not nd.ckpt_lock
                      and (nd.children or not nd.kv_lock)]
        forks = {nd.id for nd in candidates if len(nd.children) >= 2}
        pinned = {nd.id for nd in cache.nodes() if nd.checkpoint is not None and nd.ckpt_lock}
        plain = [nd for nd in candidates if nd.id not in forks]
        if eviction == "value":
            plain = unproven_first(plain, protect)
            util = utilities(cache, plain, "ckpt_access") if plain else {}
        else:
            util = {nd.id: (nd.ckpt_access, nd.id) for nd in plain}
        before = {nd.id: nd for nd in cache.nodes() if nd.checkpoint is not None}
        if cache.evict_checkpoints(1) == 0:
            assert not plain  # it only gives up when nothing but forks is evictable
            break
        after = {nd.id for nd in cache.nodes() if nd.checkpoint is not None}
        gone = [before[i] for i in before if i not in after]
        assert len(gone) == 1
        victim = gone[0]
        assert victim.id not in pinned and victim.id not in forks  # a shared branch point outlives its leaves
        if eviction == "value":
            assert util[victim.id] <= min(util.values()) + 1e-12
        else:
            assert util[victim.id] == min(util.values())
        check_cache(cache)
    for lk in held:
        cache.unlock(lk)
    check_cache(cache)


@settings(max_examples=80, deadline=None)
@given(seqs=st.lists(SEQS, min_size=1, max_size=14), cost=COSTS, weight=st.sampled_from([0.0, 1.0, 4.0]),
       locks=st.lists(st.tuples(st.integers(0, 100), st.booleans()), max_size=3),
       touches=st.lists(SEQS, max_size=6), protect=st.booleans())
def test_page_eviction_takes_lowest_utility_unlocked_leaves(seqs, cost, weight, locks, touches, protect):
    mem, cache, held = build(seqs, cost, weight, 1, locks, protect=protect)
    for t in touches:  # hits: recency, and reuse shown for protect_reused
        cache.match(t)
    locked_before = {nd.id for nd in cache.nodes() if nd.kv_lock}
    while True:
        leaves = [nd for nd in cache.nodes() if nd.is_leaf and not nd.kv_lock]  # protect_reused: states only
        before = {nd.id: nd for nd in cache.nodes()}
        util = utilities(cache, leaves, "last_access") if leaves else {}
        freed = cache.evict_pages(1)
        if not freed:
            assert not leaves
            break
        gone = [before[i] for i in before if i not in {nd.id for nd in cache.nodes()}]
        assert not {nd.id for nd in gone} & locked_before  # nothing in use is deleted
        first = min(gone, key=lambda nd: -nd.depth)  # the leaf chosen (ancestors follow as tombstone leaves)
        assert first in leaves and util[first.id] <= min(util.values()) + 1e-12
        check_cache(cache)
    for lk in held:
        cache.unlock(lk)
    cache.evict_pages(10 ** 9)
    assert not list(cache.nodes()) and not mem.live_pages and not mem.live_slots


@given(cost=COSTS, a=st.integers(0, 500), b=st.integers(0, 500), c=st.integers(0, 500))
def test_recompute_cost_is_additive_and_monotone(cost, a, b, c):
    a, b, c = sorted((a, b, c))
    assert abs(cost.prefill(a, c) - (cost.prefill(a, b) + cost.prefill(b, c))) <= 1e-9 * max(1.0, cost.prefill(a, c))
    assert cost.prefill(a, c) >= cost.prefill(b, c) >= 0


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(SEQS, min_size=1, max_size=14), share=st.sampled_from([0.05, 0.1, 0.25, 0.5]),
       eviction=st.sampled_from(["lru", "value"]))
def test_share_cap_holds_after_every_insert(seqs, share, eviction):
    """A global cap given as a share of the state slots is a count fixed at construction, and no
    insert leaves more checkpoints than it."""
    mem = make_memory(1, num_slots=40, num_pages=512)
    cache = HybridRadixCache(mem, 2, max_checkpoints=share, eviction=eviction, recompute_cost=RecomputeCost(1.0, 0.1))
    assert cache.max_checkpoints == max(1, int(share * (mem.num_free_slots() + mem.num_used_slots())))
    for seq in seqs:
        n = len(seq) // 2 * 2
        if n:
            res, pages = donate_sequence(cache, mem, seq[:n])
            mem.free_pages(pages[res.length:])
        assert cache.num_checkpoints() <= cache.max_checkpoints
        check_cache(cache)
