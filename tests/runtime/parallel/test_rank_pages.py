"""The two things that let one batch-metadata object drive every rank, checked without processes:
token pages -> a DCP rank's rows (the locations a sharded ForwardBatch would carry), and rank 0's
recorded pool operations replayed on a twin pool (byte-identical pools, compaction included)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheSpec
from k3compile.model_def.config import get_preset
from k3compile.runtime.inflight_memory import InFlightMemory
from k3compile.runtime.memory.factory import make_memory
from k3compile.runtime.parallel.mirror import replay_ops
from k3compile.runtime.parallel.rank_provider import local_cache_loc


@settings(max_examples=60, deadline=None)
@given(dcp=st.sampled_from([1, 2, 4]), rows=st.sampled_from([1, 2, 4]),
       reqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=4))
def test_token_page_locations_become_the_ranks_rows(dcp, rows, reqs):
    page = rows * dcp  # tokens per runtime page
    prefix = [p for p, _ in reqs]
    tokens = [[7] * n for _, n in reqs]
    npages = [-(-(p + n) // page) for p, n in reqs]
    table = [list(range(1 + sum(npages[:i]), 1 + sum(npages[:i + 1]))) for i in range(len(reqs))]
    mode = "prefill"
    logical = ForwardBatch.build(mode, tokens, prefix, table, list(range(1, len(reqs) + 1)), page)
    for d in range(dcp):
        want = ForwardBatch.build(mode, tokens, prefix, table, list(range(1, len(reqs) + 1)), rows,
                                  kv_shard=(d, dcp)).out_cache_loc
        assert torch.equal(local_cache_loc(logical.out_cache_loc, page, d, dcp), want)


def test_dcp_pages_hold_the_ranks_rows_only():
    cfg = get_preset("k3-tiny")
    whole, dcp2 = CacheSpec.from_config(cfg, torch.float32), CacheSpec.from_config(cfg, torch.float32, 2, 2)
    assert dcp2.page_rows(8) == 4 and dcp2.page_bytes(8) == whole.page_bytes(4)
    assert dcp2.slot_bytes < whole.slot_bytes  # KDA heads split two ways
    mem = make_memory(dcp2, 1 << 20, 8, unified=False)
    assert mem.tensors.kv.shape[2] == 4 and mem.tensors.page_size == 8
    with pytest.raises(ValueError, match="page size 5 is not a multiple of the DCP size 2"):
        dcp2.page_rows(5)


OPS = st.lists(st.tuples(st.sampled_from(["slot", "pages", "free_slot", "free_pages", "copy", "zero", "copy_pages", "write"]),
                         st.integers(0, 10**6)), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(unified=st.booleans(), ops=OPS)
def test_replayed_pool_operations_keep_the_twin_identical(unified, ops):
    spec = CacheSpec.from_config(get_preset("k3-tiny"), torch.float32)
    budget = 12 * spec.slot_bytes
    rank0 = InFlightMemory(make_memory(spec, budget, 4, unified))
    rank0.ops = []
    twin = make_memory(spec, budget, 4, unified)
    slots, pages = [], []

    def moved(kind, old, new):  # rank 0's owners follow relocations, as the tree and the table do
        held = slots if kind == "slot" else pages
        held[held.index(old)] = new
    rank0.add_relocation_listener(moved)

    def buffers(m):  # bits (a unified arena's page view also sees slot bytes, which may read as NaN)
        t = m.tensors
        return t.slot_rows.clone(), t.kv.view(torch.int32).clone()

    def step_writes(new_slots, new_pages, seed):  # a step: every rank writes the same rows at the same indices
        for mem in (rank0, twin):
            g = torch.Generator().manual_seed(seed)
            for s in new_slots:
                mem.tensors.slot_rows[s].copy_(torch.randint(0, 255, mem.tensors.slot_rows[s].shape, generator=g))
            for p in new_pages:
                mem.tensors.kv[p].copy_(torch.randn(mem.tensors.kv[p].shape, generator=g))

    for kind, x in ops:
        if kind == "slot" and rank0.can_fit(1, 0):
            slots.append(rank0.alloc_slot())
            step_writes(slots[-1:], [], x)  # every block gets bytes of its own
        elif kind == "pages" and rank0.can_fit(0, 2):
            pages.extend(rank0.alloc_pages(2))
            step_writes([], pages[-2:], x)
        elif kind == "free_slot" and slots:
            rank0.free_slot(slots.pop(x % len(slots)))  # may move others (unified compaction)
        elif kind == "free_pages" and pages:
            rank0.free_pages([pages.pop(x % len(pages))])
        elif kind == "copy" and len(slots) > 1:
            rank0.copy_slot(slots[x % len(slots)], slots[(x + 1) % len(slots)])
        elif kind == "zero" and slots:
            rank0.zero_slot(slots[x % len(slots)])
        elif kind == "copy_pages" and len(pages) > 1:
            rank0.copy_pages([pages[x % len(pages)]], [pages[(x + 1) % len(pages)]])
        elif kind == "write" and (slots or pages):  # one slot and one page get new bytes; the others keep theirs
            step_writes([slots[x % len(slots)]] if slots else [], [pages[x % len(pages)]] if pages else [], x)
        # what a step sees after the replay: both pools bit-identical
        replay_ops(twin, rank0.ops)
        rank0.ops = []
        a, b = buffers(rank0), buffers(twin)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"after {kind}"
