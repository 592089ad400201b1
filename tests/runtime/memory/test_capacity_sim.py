"""Capacity simulation: hand-checked small runs, determinism, and unified vs split on a K3-sized case."""
from __future__ import annotations

import pytest
import torch

from k3compile.model_def.cache import CacheSpec
from k3compile.model_def.config import get_preset
from k3compile.runtime.memory.capacity_sim import (
    DEFAULT_STATE_FRACTION, METRICS, Arrival, compare_allocators, k3_spec, long_contexts, run_capacity_benchmark,
    phased_mix, short_chats, shifting_mix, simulate)
from k3compile.runtime.memory.pools import SplitPools
from k3compile.runtime.memory.unified import UnifiedArena

TINY = CacheSpec.from_config(get_preset("k3-tiny"), dtype=torch.float32)


def test_default_split_is_sglang_default_ratio():
    assert DEFAULT_STATE_FRACTION == pytest.approx(0.9 / 1.9)


def test_single_request_by_hand():
    mem = SplitPools(TINY, num_slots=4, num_pages=10, page_size=4)
    r = simulate(mem, [Arrival(0, prompt_len=10, output_len=5)])
    # 3 pages at admission, a 4th when the KV reaches 13 tokens (step 3); done at step 5
    assert r["output_tokens"] == 5 and r["prefill_tokens"] == 10 and r["makespan"] == 5
    assert r["max_concurrent"] == 1 and r["retractions"] == 0 and r["peak_kv_tokens"] == 14
    assert r["tokens_before_first_retraction"] == 15
    assert mem.num_used_slots() == mem.num_used_pages() == 0


def test_retraction_by_hand():
    # 6 usable pages of 4 tokens; A = 8 prompt + 12 output, B = 4 + 10, both admitted at step 0
    mem = SplitPools(TINY, num_slots=3, num_pages=7, page_size=4)
    r = simulate(mem, [Arrival(0, 8, 12), Arrival(0, 4, 10)], reserve_ratio=0.0)
    # step 5: A takes the last page, B then needs one and is itself the newest, so it is retracted
    # after 4 tokens; it is readmitted when A finishes at step 12, re-prefills 8 tokens, 6 to go
    assert r["retractions"] == 1 and r["first_retraction_step"] == 5
    assert r["tokens_before_first_retraction"] == 8 + 4 + 4 + 4
    assert r["prefill_tokens"] == 8 + 4 + 8 and r["output_tokens"] == 22
    assert r["makespan"] == 18 and r["max_concurrent"] == 2 and r["peak_kv_tokens"] == 20
    assert mem.num_used_slots() == mem.num_used_pages() == 0


def test_reservation_shrinks_as_requests_grow():
    # A reserves pages for half its 16 output tokens (3 pages in all); by step 10 it holds 4, so
    # nothing is reserved any more and C (1 page + 1 to grow) fits into the 2 free pages at once
    mem = SplitPools(TINY, num_slots=3, num_pages=7, page_size=4)
    r = simulate(mem, [Arrival(0, 4, 16), Arrival(10, 4, 2)], reserve_ratio=0.5)
    assert r["makespan"] == 16 and r["max_concurrent"] == 2 and r["retractions"] == 0
    assert r["peak_kv_tokens"] == 20
    # with the whole output reserved, C has to wait for A to finish
    r = simulate(SplitPools(TINY, num_slots=3, num_pages=7, page_size=4),
                 [Arrival(0, 4, 16), Arrival(10, 4, 2)], reserve_ratio=1.0)
    assert r["makespan"] == 18 and r["max_concurrent"] == 1
    # A finishes without using the page reserved for its last token (which needs no KV); that
    # reservation is returned, so B can take all 6 pages
    r = simulate(SplitPools(TINY, num_slots=3, num_pages=7, page_size=4),
                 [Arrival(0, 4, 5), Arrival(10, 20, 4)], reserve_ratio=1.0)
    assert r["rejected"] == 0 and r["makespan"] == 14


def test_request_that_never_fits_is_rejected_not_looped():
    mem = SplitPools(TINY, num_slots=3, num_pages=4, page_size=4)
    r = simulate(mem, [Arrival(0, 100, 5), Arrival(1, 4, 3)])
    assert r["rejected"] == 1 and r["finished"] == 1 and r["makespan"] is None


def test_unified_relocations_keep_owners_right_and_memory_drains():
    """Many frees in the middle of both bands: the simulation's owner tables follow every move
    (a wrong index would make a later free fail), and everything is returned at the end."""
    arr = shifting_mix(5, n=120, per_step=3.0, short=((8, 64), (4, 40)), long=((200, 600), (10, 60)),
                       long_share_end=0.3)
    results = []
    for device in ("cpu", "meta"):  # real bytes and pure bookkeeping behave the same
        mem = UnifiedArena.from_budget(TINY, 40 * TINY.slot_bytes, page_size=8, device=device)
        results.append(simulate(mem, arr))
        assert mem.num_used_slots() == mem.num_used_pages() == 0
    assert results[0] == results[1]
    c = results[0]["compaction"]
    assert c["slot"]["moves"] > 0 and c["page"]["moves"] > 0
    assert results[0]["finished"] == 120 and results[0]["output_tokens"] == sum(a.output_len for a in arr)


def test_workloads_are_deterministic_per_seed():
    assert short_chats(3, n=50) == short_chats(3, n=50) != short_chats(4, n=50)
    assert long_contexts(3, n=5) == long_contexts(3, n=5)
    mix = shifting_mix(3, n=400, long_share_end=0.5)
    assert [a.step for a in mix] == sorted(a.step for a in mix)
    longs = [a.prompt_len >= 32_768 for a in mix]
    assert sum(longs[:200]) < sum(longs[200:])  # the mix shifts toward long contexts
    phased = [a.prompt_len >= 32_768 for a in phased_mix(3, n=400, phases=4, long_share=0.5)]
    quarters = [sum(phased[i * 100:(i + 1) * 100]) for i in range(4)]
    assert quarters[0] == quarters[2] == 0 and quarters[1] > 20 and quarters[3] > 20  # back and forth


def test_k3_mini_byte_ratio():
    mini = k3_spec(1, "k3-mini-6b")
    assert mini.slot_bytes > 1000 * mini.kv_bytes_per_token  # a state slot outweighs 1000+ tokens of KV
    assert mini.kv_bytes_per_token < k3_spec().kv_bytes_per_token


K3_CASES = {
    "short": short_chats(3, n=300, prompt=(64, 1024), output=(32, 256)),
    "long": long_contexts(3, n=10, per_step=0.5, prompt=(8192, 32768), output=(64, 512)),
    "mix": shifting_mix(3, n=300, short=((64, 1024), (32, 256)), long=((8192, 32768), (64, 512)),
                        long_share_end=0.2),
}


def test_unified_matches_every_split_at_k3_sizes():
    """4 GiB at K3's TP-8 sizes (56 MB per state slot, 27 KB of KV per token), on the meta device."""
    spec = k3_spec()
    out = run_capacity_benchmark(spec, 4 << 30, 64, workloads=K3_CASES)
    best_vs_default = 0.0
    for name, r in out["workloads"].items():
        u = r["unified"]
        assert u["rejected"] == 0 and u["makespan"] is not None, name
        assert len(r["sweep"]) >= 19
        for split in r["sweep"]:
            assert u["max_concurrent"] >= split["max_concurrent"], (name, split["state_fraction"])
            assert u["peak_kv_tokens"] >= 0.98 * split["peak_kv_tokens"], (name, split["state_fraction"])
            if split["makespan"] is not None:
                assert u["makespan"] <= 1.02 * split["makespan"], (name, split["state_fraction"])
        for m in ("max_concurrent", "peak_kv_tokens", "makespan"):
            assert r["unified_vs_best"][m] >= 0.98, (name, m)
        best_vs_default = max(best_vs_default, r["unified_vs_default"]["max_concurrent"])
        assert set(r["split_best"]) == set(METRICS)
    assert best_vs_default >= 1.5
    assert out == run_capacity_benchmark(spec, 4 << 30, 64, workloads=K3_CASES)  # deterministic


def test_bad_input_is_named():
    mem = SplitPools(TINY, num_slots=3, num_pages=8, page_size=4)
    with pytest.raises(ValueError, match="reserve ratio"):
        simulate(mem, [], reserve_ratio=1.5)
    with pytest.raises(ValueError, match="lengths >= 1"):
        simulate(mem, [Arrival(0, 4, 0)])
    mem.alloc_slot()
    with pytest.raises(ValueError, match="fresh"):
        simulate(mem, [])
    with pytest.raises(ValueError, match="default state fraction"):
        compare_allocators(TINY, 4 * TINY.slot_bytes, 4, [], default_fraction=0.01)
