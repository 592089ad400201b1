"""Random interleavings of admit / prefill / snapshot / donate / finish / abort / match / lock /
unlock / evict / relocate on the hybrid radix cache over split pools and over the unified arena.

After every step: the tree's structure and reverse maps are consistent; every live page and slot
is accounted for exactly once (tree, a live request, or free: nothing leaked, nothing freed twice);
ref counts equal the live locks; no unlocked tombstone leaf (but KV-only leaves with `decay_keeps_kv`, and a
decay in a lookup frees no KV then); the caps hold; with `kv_value_weight` 0 KV pressure takes the least recently
used leaf first, a protected leaf (`protect_branch_leaves`) goes only after every unprotected one and a leaf with a
state only after every KV-only one; every
checkpoint holds the toy model's state for its node's prefix; every tree page holds the KV of its tokens; every
running request's page table, working state and pending snapshots are right.
"""
from __future__ import annotations

import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache
from k3compile.runtime.cache.recompute_cost import RecomputeCost
from k3compile.runtime.cache.request_table import RequestTable
from k3compile.runtime.cache.state_slots import TooManyStateSlotsError
from k3compile.runtime.memory.base import OutOfMemoryError
from k3compile.runtime.memory.pools import SplitPools
from k3compile.runtime.memory.unified import UnifiedArena

from .harness import SPEC, TrackingMemory, forward, kv_matches, kv_patterns, prefix_hashes, state_matches

# A few shared stems make prefixes collide often (forks, shared system prompts, repeats).
STEMS = [
    (0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0),
    (0, 1, 2, 0, 1, 2, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2),
    (2, 2, 1, 1, 0, 0, 2, 2, 1, 1, 0, 0, 2, 2, 1, 1),
]
TOKENS = st.one_of(
    st.builds(lambda stem, cut, tail: STEMS[stem][:cut] + tuple(tail), st.integers(0, 2), st.integers(2, 16),
              st.lists(st.integers(0, 2), max_size=8)),
    st.lists(st.integers(0, 2), min_size=2, max_size=20).map(tuple))
MAX_RUNNING = 4


class Sim:
    """What the test's 'scheduler' knows about one running request."""

    def __init__(self, req, tokens):
        self.req, self.tokens, self.pos = req, tokens, req.prefix_len


class CacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), interval_pages=st.sampled_from([1, 2]),
                per_path=st.sampled_from([None, 1, 2, 3]), global_cap=st.sampled_from([None, 2, 5]),
                arena=st.booleans(), eviction=st.sampled_from(["lru", "value"]),
                decay=st.sampled_from([(None, None, None), (1, None, None), (2, 6, None), (2, 6, 5), (None, None, 3)]),
                keep_kv=st.booleans(), kv_weight=st.sampled_from([None, 0.0]), protect_branch=st.booleans())
    def setup(self, page_size, interval_pages, per_path, global_cap, arena, eviction, decay, keep_kv, kv_weight,
              protect_branch):
        if arena:
            size = 10 * SPEC.slot_bytes + 40 * SPEC.page_bytes(page_size)
            inner = UnifiedArena(SPEC, size, page_size)
        else:
            inner = SplitPools(SPEC, num_slots=14, num_pages=72 // page_size + 2, page_size=page_size)
        self.mem = TrackingMemory(inner)
        self.interval = interval_pages * page_size
        self.cache = HybridRadixCache(self.mem, self.interval, max_checkpoints_per_path=per_path,
                                      max_checkpoints=global_cap, eviction=eviction,
                                      recompute_cost=RecomputeCost(linear=1.0, attention=0.05),
                                      unused_ttl=decay[0], unused_max_age=decay[1], stale_age=decay[2],
                                      decay_keeps_kv=keep_kv, kv_value_weight=kv_weight,
                                      protect_branch_leaves=protect_branch and eviction == "value")
        self.table = RequestTable(self.cache)
        self.sims: dict[int, Sim] = {}
        self.locks = []
        self.next_rid = 0

    # ------------------------------------------------------------------ helpers
    def _pick(self, i):
        rids = sorted(self.sims)
        return self.sims[rids[i % len(rids)]]

    def _retry(self, fn, relieve):
        """Run fn; on OutOfMemoryError relieve pressure once and retry; None if still out."""
        try:
            return fn()
        except OutOfMemoryError:
            relieve()
        try:
            return fn()
        except OutOfMemoryError:
            event("out of memory after eviction")
            return None

    def _donate(self, sim, position):
        req = sim.req
        before = req.prefix_len
        res = self.table.donate(req, sim.tokens, position)
        assert before <= res.length <= position and req.prefix_len == res.length
        assert res.pages == self.cache.path_pages(res.node)
        if res.checkpoint_stored:
            assert res.length == position
            hit = self.cache.match(sim.tokens[:position], touch=False)
            assert hit.cached_len == position and state_matches(self.mem, hit.checkpoint_slot, sim.tokens[:position])
            event("donated checkpoint stored")
        else:
            event("donated checkpoint not stored")

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.sims) < MAX_RUNNING)
    @rule(tokens=TOKENS)
    def admit(self, tokens):
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        req = self._retry(lambda: self.table.admit(rid, tokens[:-1]), lambda: self.cache.evict_checkpoints(1))
        if req is None:
            return
        hit = req.hit
        # The copy-on-write restore gave the request exactly the state after its cached prefix.
        assert req.prefix_len == hit.cached_len and hit.cached_len % self.interval == 0
        assert tuple(self.cache.path_tokens(req.lock.node)) == tuple(tokens[: hit.cached_len])
        assert state_matches(self.mem, req.slots.working, tokens[: hit.cached_len])
        assert hit.cached_len <= hit.kv_match_len <= len(tokens) - 1
        if hit.branch_point is not None:
            assert hit.cached_len < hit.branch_point <= hit.kv_match_len
            assert hit.branch_point == hit.kv_match_len - hit.kv_match_len % self.interval
            event("branch point")
        if hit.cached_len:
            event("hit")
        if hit.branch_point is not None and hit.cached_len:
            event("branch point below a hit")
        self.sims[rid] = Sim(req, tokens)

    @precondition(lambda self: len(self.sims) < MAX_RUNNING)
    @rule(tokens=TOKENS, chunk=st.integers(1, 8), every=st.booleans())
    def serve(self, tokens, chunk, every):
        """A whole request: admit, prefill to the end (a snapshot at the branch point, and at every
        boundary or only the last one), donate, finish. Fills the tree the way traffic does."""
        rid = self.next_rid
        self.admit(tokens)
        sim = self.sims.get(rid)
        if sim is None:
            return
        last = len(tokens) - len(tokens) % self.interval
        while sim.pos < len(tokens):
            before = sim.pos
            self.prefill(sorted(self.sims).index(rid), chunk, every)
            if sim.pos == before:
                break  # out of memory even after eviction
            if not every and sim.pos == last and last not in sim.req.slots.snapshot_positions():
                self.prefill_snapshot(sim, last)
            positions = sim.req.slots.snapshot_positions()
            if every and positions and positions[-1] == sim.pos:
                self._donate(sim, sim.pos)
        self.finish(sorted(self.sims).index(rid))

    def prefill_snapshot(self, sim, position):
        try:
            self._retry(lambda: self.table.snapshot(sim.req, position), lambda: self.cache.evict_checkpoints(1))
        except TooManyStateSlotsError:
            event("transient slot cap")

    @precondition(lambda self: self.sims)
    @rule(i=st.integers(0, 7), k=st.integers(1, 8), snap=st.booleans())
    def prefill(self, i, k, snap):
        """Compute a chunk; chunks end at every checkpoint-interval boundary (scheduler's rule), and
        a snapshot is taken there sometimes (always at the admission's branch point)."""
        sim = self._pick(i)
        req, I = sim.req, self.interval
        target = min(sim.pos + k, len(sim.tokens), (sim.pos // I + 1) * I)
        if target <= sim.pos:
            return
        if self._retry(lambda: self.table.ensure_pages(req, target), lambda: self.cache.evict_pages(target)) is None:
            return
        forward(self.mem, req.slots.working, self.table.page_table(req), sim.tokens, sim.pos, target)
        sim.pos = target
        if target % I == 0 and (snap or target == req.hit.branch_point):
            self.prefill_snapshot(sim, target)

    @precondition(lambda self: any(s.req.slots.snapshot_positions() for s in self.sims.values()))
    @rule(i=st.integers(0, 7), j=st.integers(0, 3))
    def donate(self, i, j):
        sims = [s for s in self.sims.values() if s.req.slots.snapshot_positions()]
        sim = sims[i % len(sims)]
        positions = sim.req.slots.snapshot_positions()
        self._donate(sim, positions[j % len(positions)])

    @precondition(lambda self: self.sims)
    @rule(i=st.integers(0, 7))
    def finish(self, i):
        sim = self._pick(i)
        positions = sim.req.slots.snapshot_positions()
        if positions:
            self._donate(sim, positions[-1])
        self.table.release(sim.req)
        del self.sims[sim.req.rid]

    @precondition(lambda self: self.sims)
    @rule(i=st.integers(0, 7))
    def abort(self, i):
        sim = self._pick(i)
        self.table.release(sim.req)
        del self.sims[sim.req.rid]
        with pytest.raises(ValueError):
            self.table.release(sim.req)

    @rule(tokens=TOKENS, touch=st.booleans())
    def match(self, tokens, touch):
        pages_before = self.cache.num_pages()
        hit = self.cache.match(tokens, touch=touch)
        if self.cache.decay_keeps_kv:  # decay (which runs in a lookup) frees states only, never the tree's KV
            assert self.cache.num_pages() == pages_before
        p, I = self.cache.page_size, self.interval
        assert hit.cached_len % I == 0 and hit.cached_len <= hit.kv_match_len <= len(tokens)
        assert self.cache.path_tokens(hit.node) == tuple(tokens[: hit.cached_len])
        assert hit.pages == self.cache.path_pages(hit.node) and len(hit.pages) * p == hit.cached_len
        if hit.checkpoint_slot is None:
            assert hit.cached_len == 0
        else:
            assert state_matches(self.mem, hit.checkpoint_slot, tokens[: hit.cached_len])
        # Brute force: KV matched as far as any node's prefix goes, the hit is the deepest checkpoint.
        paths = [(self.cache.path_tokens(nd), nd.checkpoint is not None) for nd in self.cache.nodes()]
        kv = max((d for path, _ in paths for d in range(0, min(len(path), len(tokens)) + 1, p)
                  if path[:d] == tuple(tokens[:d])), default=0)
        best = max((len(path) for path, ck in paths if ck and path == tuple(tokens[: len(path)])), default=0)
        assert hit.kv_match_len == kv and hit.cached_len == best

    @rule(tokens=TOKENS, pin=st.booleans())
    def lock(self, tokens, pin):
        node = self.cache.match(tokens, touch=False).node
        self.locks.append(self.cache.lock(node, pin_checkpoint=pin))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 7))
    def unlock(self, i):
        lk = self.locks.pop(i % len(self.locks))
        self.cache.unlock(lk)
        with pytest.raises(ValueError):
            self.cache.unlock(lk)

    @rule(n=st.integers(0, 12))
    def evict_pages(self, n):
        free_before = len(self.mem.live_pages)
        c = self.cache
        leaves = [nd for nd in c.nodes() if nd.is_leaf and not nd.kv_lock]
        lru = None
        protecting = c.protect_shared_leaves or c.protect_branch_leaves
        if c.eviction == "value" and c.kv_value_weight == 0 and not protecting:
            lru = min(leaves, key=lambda nd: (nd.last_access, nd.id), default=None)  # recency alone decides
        shielded = {nd.id for nd in leaves if c.eviction == "value" and c._shared_leaf(nd)}
        freed = self.cache.evict_pages(n)
        if lru is not None and n > 0:
            assert not lru.alive, f"kv_value_weight 0: the least recently used leaf {lru!r} must go first"
        if any(not nd.alive for nd in leaves if not nd.kv_only):  # a leaf with a state went: no KV-only one is left
            assert all(not nd.alive for nd in leaves if nd.kv_only)
        if any(not nd.alive for nd in leaves if nd.id in shielded):  # a protected leaf went: no other could
            assert all(not nd.alive for nd in leaves if nd.id not in shielded)
        assert free_before - len(self.mem.live_pages) == freed
        assert freed >= n or self.cache.evictable_pages() == 0

    @rule(n=st.integers(0, 3))
    def evict_checkpoints(self, n):
        before = self.cache.num_checkpoints()
        freed = self.cache.evict_checkpoints(n)
        assert before - self.cache.num_checkpoints() == freed
        assert freed >= n or self.cache.evictable_checkpoints() == 0

    @precondition(lambda self: self.mem.live_pages or self.mem.live_slots)
    @rule(slot=st.booleans(), i=st.integers(0, 1000))
    def relocate(self, slot, i):
        live = sorted(self.mem.live_slots if slot else self.mem.live_pages)
        if not live:
            return
        try:
            self.mem.move("slot" if slot else "page", live[i % len(live)])
        except OutOfMemoryError:
            event("no room to relocate")

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        check_cache(self.cache, self.table)
        for nd in self.cache.nodes():
            if nd.checkpoint is None:
                kind = ("KV-only leaf" if nd.kv_only else "locked tombstone leaf") if nd.is_leaf else "internal tombstone"
                event(kind)
        if self.mem.moves:
            event("relocations happened")
        # Every live index has exactly one owner (check_cache proved the owners are disjoint).
        tree_pages = {pg for nd in self.cache.nodes() for pg in nd.pages}
        own_pages = {pg for s in self.sims.values() for pg in s.req.own_pages}
        assert tree_pages | own_pages == self.mem.live_pages
        tree_slots = {nd.checkpoint for nd in self.cache.nodes() if nd.checkpoint is not None}
        own_slots = {sl for s in self.sims.values() for sl in s.req.slots.held()}
        assert tree_slots | own_slots == self.mem.live_slots
        # Contents: checkpoints and tree KV hold what the toy model computes for their prefixes.
        for nd in self.cache.nodes():
            path = self.cache.path_tokens(nd)
            if nd.checkpoint is not None:
                assert state_matches(self.mem, nd.checkpoint, path), f"checkpoint of {nd!r} is stale"
            hs = prefix_hashes(path)[nd.depth - len(nd.key):]
            p = self.cache.page_size
            rows = self.mem.tensors.kv[nd.pages].reshape(len(nd.pages), SPEC.n_mla, p, SPEC.kv_width)
            assert (rows.permute(0, 2, 1, 3).reshape(-1, SPEC.n_mla, SPEC.kv_width) == kv_patterns(hs)).all()
        # Running requests: page table, working state and pending snapshots.
        for sim in self.sims.values():
            req = sim.req
            assert kv_matches(self.mem, self.table.page_table(req), sim.tokens, sim.pos)
            assert state_matches(self.mem, req.slots.working, sim.tokens[: sim.pos])
            for pos in req.slots.snapshot_positions():
                assert state_matches(self.mem, req.slots.snapshot_slot(pos), sim.tokens[:pos])

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for sim in list(self.sims.values()):
            self.table.release(sim.req)
        for lk in self.locks:
            self.cache.unlock(lk)
        check_cache(self.cache, self.table)  # no tombstone leaf once nothing is locked
        assert all(nd.checkpoint is not None or (nd.kv_only and self.cache.decay_keeps_kv)
                   for nd in self.cache.nodes() if nd.is_leaf)
        self.cache.evict_pages(10 ** 9)
        assert not list(self.cache.nodes()) and not self.mem.live_pages and not self.mem.live_slots


# derandomize: the same examples on every machine and run (CI determinism). A random search of 2000
# examples (50 steps each) passed once the per-path-cap bug this machine found was fixed; that case is
# a plain test in test_radix.py (a fork losing a path while the global cap makes room for its own
# checkpoint).
CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None, derandomize=True)
TestCacheMachine = CacheMachine.TestCase
