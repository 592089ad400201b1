"""k3compile bench cache: policy parsing, the KV-only bound, the stand-in forward, and a small
end-to-end run through the real model (files written, identical outputs across policies, the bound
bounds)."""
import json

import pytest

from k3compile.bench.cache import parse_policy, split_policies
from k3compile.bench.cache_replay import byte_ratio_spec, kv_only_bound, kv_only_lru, stand_in_token
from k3compile.cli import main


def test_kv_only_bound_counts_page_aligned_prefixes():
    page = 4
    a = list(range(10))
    events = [("submit", "a", a),
              ("submit", "b", a[:9] + [99]),  # shares 9 tokens with a's prompt: 8 page-aligned
              ("finish", "a", a + [50, 51]),  # a's KV: prompt + output less its last token
              ("submit", "c", a + [50, 7, 7])]  # shares a + [50] = 11 tokens: 8 page-aligned
    got = kv_only_bound(events, page)
    assert got["hit_tokens"] == 0 + 8 + 8 and got["prompt_tokens"] == 10 + 10 + 13


def test_kv_only_lru_at_equal_pages():
    """Unlimited pages: the bound. Capped: the least recently used leaf page goes first."""
    page = 4
    a, x = list(range(8)), list(range(100, 108))
    events = [("submit", "a", a + [9]), ("submit", "x", x + [9]), ("submit", "b", a[:4] + [7, 7, 7, 7, 7]),
              ("submit", "c", a + [9]), ("submit", "x2", x + [9])]
    assert kv_only_lru(events, page, 10 ** 6) == kv_only_bound(events, page)
    got = kv_only_lru(events, page, 2)
    # 2 pages: x evicts a; b misses (x holds both) and evicts x; c hits b's copy of a[:4]; x2 misses
    assert got["hit_tokens"] == 4 and got["prompt_tokens"] == 9 * 5
    # 4 pages: b hits a[:4] and evicts a's second page (the LRU leaf); c hits a[:4] and evicts x's
    # second page; x2 hits x's first page
    assert kv_only_lru(events, page, 4)["hit_tokens"] == 4 + 4 + 4


def test_policy_parsing():
    p = parse_policy("sparse:per_path=3,handover=0")
    assert p.max_checkpoints_per_path == 3 and not p.donate_handover and p.branch_points
    assert parse_policy("every_chunk:per_path=0").max_checkpoints_per_path is None
    assert parse_policy("valued:total=0.25,weight=2").max_checkpoints == 0.25
    assert parse_policy("valued:total=8").max_checkpoints == 8
    assert split_policies("none,end,sparse:per_path=2,handover=0;every_chunk") == [
        "none", "end", "sparse:per_path=2,handover=0", "every_chunk"]
    with pytest.raises(ValueError, match="keys"):
        parse_policy("sparse:cap=2")
    with pytest.raises(ValueError, match="unknown cache policy"):
        parse_policy("lru")


def test_stand_in_token_depends_on_the_context_only():
    a = [5, 6, 7, 8, 9]
    assert stand_in_token(a) == stand_in_token(list(a))
    assert {stand_in_token(a + [t]) for t in range(8)} != {stand_in_token(a)}
    assert all(0 <= stand_in_token(list(range(n))) < 256 for n in range(1, 40))


def test_byte_ratio_spec_matches_the_real_models():
    from k3compile.model_def.cache import CacheSpec
    from k3compile.model_def.config import get_preset
    from k3compile.runtime.memory.capacity_sim import k3_spec

    import torch

    base = CacheSpec.from_config(get_preset("k3-tiny"), dtype=torch.float32)
    assert byte_ratio_spec(base, "tiny", 16) == base
    for name, real in (("k3", k3_spec(8, "k3")), ("k3-mini", k3_spec(1, "k3-mini-6b"))):
        spec = byte_ratio_spec(base, name, 16)
        want, got = real.slot_bytes / real.page_bytes(16), spec.slot_bytes / spec.page_bytes(16)
        assert abs(got - want) / want < 0.02 and spec.page_bytes(16) == base.page_bytes(16)
    with pytest.raises(ValueError, match="byte ratio"):
        byte_ratio_spec(base, "k4", 16)


def test_bench_cache_end_to_end(tmp_path):
    rc = main(["bench", "cache", "--roots", "1", "--duration", "5", "--policies", "none,end,sparse",
               "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "cache_pressure.json").read_text())
    md = (tmp_path / "cache_pressure.md").read_text()
    rows = {r["policy"]: r for r in doc["rows"]}
    assert set(rows) == {"none", "end", "sparse"} and "| sparse |" in md and "forward `model`" in md
    assert all(r["outputs_match"] for r in rows.values())
    assert rows["none"]["hit_rate"] == 0 and rows["none"]["checkpoint_bytes_peak"] == 0
    for r in rows.values():
        assert r["hit_rate"] <= r["kv_only_bound"]
        assert r["prefill_tokens_saved"] == r["hit_tokens"] and r["retractions"] == 0  # nothing retracted
    assert doc["environment"]["torch"]
