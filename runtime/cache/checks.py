"""Structural invariants of the hybrid radix cache (and of a RequestTable over it).

Cheap enough to run after every operation in tests or a debug mode; raises CacheInvariantError
listing every violation found. It reads the cache's private maps on purpose: it checks them.
"""
from __future__ import annotations

from collections import Counter

from .radix import HybridRadixCache
from .request_table import RequestTable


class CacheInvariantError(AssertionError):
    pass


def check_cache(cache: HybridRadixCache, table: RequestTable | None = None) -> None:
    problems: list[str] = []
    bad = problems.append
    p, root = cache.page_size, cache.root

    if root.key or root.pages or root.checkpoint is not None or root.parent is not None or root.depth:
        bad("root must be empty")
    # Walk the tree; compare what is reachable with the registry and the reverse maps.
    reachable, page_loc, slot_owner = [], {}, {}
    stack = [root]
    while stack:
        nd = stack.pop()
        for first, child in nd.children.items():
            if child.parent is not nd:
                bad(f"{child!r}: parent pointer does not point at {nd!r}")
            if not child.key or len(child.key) % p:
                bad(f"{child!r}: edge of {len(child.key)} tokens is not a positive multiple of page_size {p}")
            if child.key[:p] != first:
                bad(f"{child!r}: keyed under {first} but its edge starts with {child.key[:p]}")
            if len(child.pages) * p != len(child.key):
                bad(f"{child!r}: {len(child.pages)} pages for {len(child.key)} tokens")
            if child.depth != nd.depth + len(child.key):
                bad(f"{child!r}: depth {child.depth} != parent depth {nd.depth} + edge {len(child.key)}")
            if not child.alive:
                bad(f"{child!r}: reachable but marked dead")
            reachable.append(child)
            stack.append(child)
    if {nd.id for nd in reachable} != set(cache._nodes) or any(cache._nodes[nd.id] is not nd for nd in reachable):
        bad("node registry differs from the reachable nodes")
    for nd in reachable:
        for i, pg in enumerate(nd.pages):
            if pg in page_loc:
                bad(f"page {pg} held by two nodes")
            page_loc[pg] = (nd, i)
        if nd.checkpoint is not None:
            if nd.checkpoint in slot_owner:
                bad(f"slot {nd.checkpoint} is the checkpoint of two nodes")
            slot_owner[nd.checkpoint] = nd
            if nd.depth % cache.checkpoint_interval:
                bad(f"{nd!r}: checkpoint at depth {nd.depth}, not a multiple of {cache.checkpoint_interval}")
        if nd.kv_lock < 0 or nd.ckpt_lock < 0:
            bad(f"{nd!r}: negative ref count")
        if nd.ckpt_lock and nd.checkpoint is None:
            bad(f"{nd!r}: checkpoint pinned but absent")
        if nd.is_leaf and nd.checkpoint is None and not nd.kv_lock and not (nd.kv_only and cache.decay_keeps_kv):
            bad(f"{nd!r}: unlocked tombstone leaf")
        if nd.kv_only and nd.checkpoint is not None:
            bad(f"{nd!r}: a KV-only leaf holds a checkpoint")
    if {k: (v[0].id, v[1]) for k, v in cache._page_loc.items()} != {k: (v[0].id, v[1]) for k, v in page_loc.items()}:
        bad("page -> node map is stale")
    if {k: v.id for k, v in cache._slot_owner.items()} != {k: v.id for k, v in slot_owner.items()}:
        bad("slot -> node map is stale")
    if cache._doomed_pages or cache._doomed_slots:
        bad("frees left pending after a call returned")

    # Ref counts equal what the live locks account for.
    kv, pins = Counter(), Counter()
    for lk in cache._locks:
        if lk.released or not lk.node.alive and lk.node is not root:
            bad(f"{lk!r}: live lock on a released lock or dead node")
        if lk.pinned:
            pins[lk.node.id] += 1
        nd = lk.node
        while nd is not root:
            kv[nd.id] += 1
            nd = nd.parent
    for nd in reachable:
        if nd.kv_lock != kv[nd.id] or nd.ckpt_lock != pins[nd.id]:
            bad(f"{nd!r}: ref counts differ from the live locks (kv {kv[nd.id]}, pins {pins[nd.id]})")

    # Caps.
    if cache.max_checkpoints is not None and len(slot_owner) > cache.max_checkpoints:
        bad(f"{len(slot_owner)} checkpoints > global cap {cache.max_checkpoints}")
    if cache.max_checkpoints_per_path is not None:
        for nd in reachable:
            if nd.is_leaf:
                n, a = 0, nd
                while a is not root:
                    n += a.checkpoint is not None and not (len(a.children) >= 2 or a.planted)  # branch points do not count
                    a = a.parent
                if n > cache.max_checkpoints_per_path:
                    bad(f"{n} checkpoints on the path to {nd!r} > cap {cache.max_checkpoints_per_path}")

    if table is not None:
        _check_table(cache, table, page_loc, slot_owner, bad)
    if problems:
        raise CacheInvariantError("hybrid radix cache invariants violated:\n  " + "\n  ".join(problems))


def _check_table(cache, table, tree_pages, tree_slots, bad) -> None:
    p = cache.page_size
    seen_pages, seen_slots = set(), set()
    expected_owner = {}
    for req in table.requests():
        if not req.live or req.lock not in cache._locks:
            bad(f"request {req.rid!r}: not live or its lock is not held")
        if req.lock.pinned:
            bad(f"request {req.rid!r}: still pins a checkpoint after admission")
        first = req.prefix_len // p
        for i, pg in enumerate(req.own_pages):
            if pg in tree_pages or pg in seen_pages:
                bad(f"request {req.rid!r}: own page {pg} is also held by the tree or another request")
            seen_pages.add(pg)
            expected_owner[pg] = (req.rid, first + i)
        held = req.slots.held()
        if len(held) > req.slots.max_slots:
            bad(f"request {req.rid!r}: {len(held)} transient slots > {req.slots.max_slots}")
        for s in held:
            if s in tree_slots or s in seen_slots:
                bad(f"request {req.rid!r}: slot {s} is also held by the tree or another request")
            seen_slots.add(s)
    if {k: (v[0].rid, v[1]) for k, v in table._page_owner.items()} != expected_owner:
        bad("request page -> owner map is stale")
