"""RequestTable: admission, donation and the finish / abort paths of running requests."""
from __future__ import annotations

import pytest

from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.cache.radix import HybridRadixCache
from k3compile.runtime.cache.request_table import RequestTable
from k3compile.runtime.memory.base import OutOfMemoryError

from .harness import forward, kv_matches, make_memory, state_matches

I = 4  # checkpoint interval (the scheduler's chunk size)
SYSTEM = tuple(range(1, 11))  # a 10-token shared prefix
A = SYSTEM + (20, 21, 22, 23, 24, 25)
B = SYSTEM + (30, 31, 32, 33, 34)


def setup(page_size=2, arena=False, num_slots=16, num_pages=64):
    mem = make_memory(page_size, num_slots=num_slots, num_pages=num_pages, arena=arena)
    cache = HybridRadixCache(mem, I)
    return mem, cache, RequestTable(cache)


def accounted(mem, cache, table):
    check_cache(cache, table)
    assert {pg for nd in cache.nodes() for pg in nd.pages} | {pg for r in table.requests() for pg in r.own_pages} \
        == mem.live_pages
    assert {nd.checkpoint for nd in cache.nodes() if nd.checkpoint is not None} | \
        {s for r in table.requests() for s in r.slots.held()} == mem.live_slots


def run(mem, table, req, tokens, start, end):
    table.ensure_pages(req, end)
    forward(mem, req.slots.working, table.page_table(req), tokens, start, end)


def serve(mem, table, rid, tokens, snapshot_at=()):
    """Admit, prefill to the end in chunks of I with snapshots where asked, donate the last, finish."""
    req = table.admit(rid, tokens[:-1])
    pos = req.prefix_len
    while pos < len(tokens):
        end = min(len(tokens), (pos // I + 1) * I)
        run(mem, table, req, tokens, pos, end)
        pos = end
        if pos in snapshot_at:
            table.snapshot(req, pos)
    result = table.finish(req, tokens)
    assert (result is None) == (not snapshot_at) and not req.live


@pytest.mark.parametrize("arena", [False, True])
def test_branch_point_flow_end_to_end(arena):
    mem, cache, table = setup(arena=arena)
    serve(mem, table, "a", A, snapshot_at={12})  # sparse: one checkpoint at 12
    accounted(mem, cache, table)
    b = table.admit("b", B[:-1])
    assert (b.hit.cached_len, b.hit.kv_match_len, b.hit.branch_point) == (0, 10, 8)
    assert state_matches(mem, b.slots.working, ())  # restored to the zero state
    run(mem, table, b, B, 0, 4)
    run(mem, table, b, B, 4, 8)  # the chunk ends exactly at the branch point
    table.snapshot(b, 8)
    own_before = list(b.own_pages)
    res = table.donate(b, B, 8)
    assert res.checkpoint_stored and res.length == 8 and b.prefix_len == 8
    assert res.freed_pages == own_before[:4] and b.own_pages == own_before[4:]  # duplicates went back
    assert table.page_table(b)[:4] == res.pages and kv_matches(mem, table.page_table(b), B, 8)
    assert b.slots.snapshot_positions() == []
    run(mem, table, b, B, 8, 12)
    run(mem, table, b, B, 12, len(B))
    assert kv_matches(mem, table.page_table(b), B, len(B)) and state_matches(mem, b.slots.working, B)
    accounted(mem, cache, table)
    table.release(b)
    # The next branch restores at the fork directly.
    c = table.admit("c", SYSTEM + (40, 41, 42))
    assert c.hit.cached_len == 8 and c.hit.branch_point is None and state_matches(mem, c.slots.working, SYSTEM[:8])
    table.release(c)
    accounted(mem, cache, table)


def test_abort_and_double_release():
    mem, cache, table = setup()
    serve(mem, table, "a", A, snapshot_at={8, 12})
    live_before = (set(mem.live_pages), set(mem.live_slots))
    r = table.admit("r", A + (7, 7, 7))
    run(mem, table, r, A + (7, 7, 7), r.prefix_len, len(A) + 3)
    table.snapshot(r, 16)
    table.release(r)  # abort mid-request: pages, working slot and snapshot all return
    assert (mem.live_pages, mem.live_slots) == live_before
    with pytest.raises(ValueError, match="already released"):
        table.release(r)
    with pytest.raises(ValueError, match="already released"):
        table.ensure_pages(r, 30)
    x = table.admit("x", A)
    with pytest.raises(ValueError, match="already admitted"):
        table.admit("x", A)
    table.release(x)
    accounted(mem, cache, table)


def test_admission_without_a_free_slot_holds_nothing():
    mem, cache, table = setup(num_slots=3)  # two usable slots
    serve(mem, table, "a", A, snapshot_at={12})  # one held by the tree
    table.admit("b", B)  # the other as b's working slot
    locks_before = len(cache._locks)
    with pytest.raises(OutOfMemoryError):
        table.admit("c", A)
    assert "c" not in table and len(cache._locks) == locks_before
    accounted(mem, cache, table)


def test_donate_validates_before_touching_anything():
    mem, cache, table = setup()
    r = table.admit("r", A)
    run(mem, table, r, A, 0, 8)
    table.snapshot(r, 4)
    with pytest.raises(ValueError, match="positive multiples"):
        table.snapshot(r, 6)
    with pytest.raises(KeyError):
        table.donate(r, A, 8)  # no snapshot at 8
    with pytest.raises(ValueError, match="cannot donate"):
        table.donate(r, A[:3], 4)
    res = table.donate(r, A, 4)
    assert res.checkpoint_stored and r.prefix_len == 4
    with pytest.raises(ValueError, match="inside the prefix"):
        table.donate(r, A, 0)
    table.snapshot(r, 8)
    wrong = A[:4][::-1] + A[4:]  # tokens that do not match the tree pages it reads: insert refuses
    with pytest.raises(ValueError, match="another position"):
        table.donate(r, wrong, 8)
    assert r.slots.snapshot_positions() == [8] and r.prefix_len == 4  # nothing moved
    accounted(mem, cache, table)
    table.donate(r, A, 8)
    table.release(r)
    accounted(mem, cache, table)


def test_donate_frees_superseded_snapshots():
    mem, cache, table = setup()
    r = table.admit("r", A)
    run(mem, table, r, A, 0, 12)
    for pos in (4, 8, 12):
        table.snapshot(r, pos)
    table.donate(r, A, 8)
    assert r.slots.snapshot_positions() == [12]  # 4 is superseded by 8 and freed
    accounted(mem, cache, table)
    table.release(r)
    accounted(mem, cache, table)


def test_relocated_own_pages_follow_the_request():
    mem, cache, table = setup()
    r = table.admit("r", A)
    run(mem, table, r, A, 0, 10)
    for pg in list(r.own_pages):
        mem.move("page", pg)
    mem.move("slot", r.slots.working)
    assert kv_matches(mem, table.page_table(r), A, 10) and state_matches(mem, r.slots.working, A[:10])
    accounted(mem, cache, table)
    table.release(r)
    assert not mem.live_pages and not mem.live_slots


def test_freeing_duplicates_while_the_arena_moves_another_requests_pages():
    mem, cache, table = setup(arena=True)
    serve(mem, table, "a", A, snapshot_at={12})
    r = table.admit("r", B[:-1])  # restores from nothing, recomputes [0, 8): duplicates of the tree's KV
    run(mem, table, r, B, 0, 8)
    x = table.admit("x", (50, 51, 52, 53, 54, 55))
    run(mem, table, x, (50, 51, 52, 53, 54, 55), 0, 6)  # x's pages sit at the end of the page band
    table.snapshot(r, 8)
    moves = mem.moves
    table.donate(r, B, 8)  # freeing r's duplicates compacts the arena: x's pages move into their indices
    assert mem.moves > moves
    accounted(mem, cache, table)  # x's pages are still x's, under their new indices
    for pg in list(x.own_pages):
        mem.move("page", pg)
    assert kv_matches(mem, table.page_table(x), (50, 51, 52, 53, 54, 55), 6)
    table.release(x)
    table.release(r)
    accounted(mem, cache, table)
