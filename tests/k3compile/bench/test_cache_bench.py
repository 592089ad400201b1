"""k3compile bench cache: the workload generator, the KV-only bound, policy parsing, and a small end-to-end
run through the real engine (files written, identical outputs across policies, the bound bounds)."""
import json

import pytest

from k3compile.bench.cache import parse_policy, split_policies
from k3compile.bench.cache_workload import WorkloadSpec, count_requests, kv_only_bound, make_workload
from k3compile.cli import main


def test_workload_is_deterministic_and_forks():
    spec = WorkloadSpec(sessions=6, systems=2, system_len=50, turns=3, fork_prob=1.0, branches=2, seed=3)
    a, b = make_workload(spec), make_workload(spec)
    assert [s.first.user for s in a] == [s.first.user for s in b]
    assert count_requests(a) == 6 * (1 + 2 + 4)  # every turn forks in two
    first = a[0].first
    x, y = first.children  # branches share their lead-in, then differ
    assert x.user[:24] == y.user[:24] and x.user != y.user
    assert a[0].system == a[2].system != a[1].system
    with pytest.raises(ValueError, match="user_len"):
        make_workload(WorkloadSpec(user_len=(5, 2)))


def test_kv_only_bound_counts_page_aligned_prefixes():
    page = 4
    a = list(range(10))
    events = [("submit", "a", a),
              ("submit", "b", a[:9] + [99]),  # shares 9 tokens with a's prompt: 8 page-aligned
              ("finish", "a", a + [50, 51]),  # a's KV: prompt + output less its last token
              ("submit", "c", a + [50, 7, 7])]  # shares a + [50] = 11 tokens: 8 page-aligned
    got = kv_only_bound(events, page)
    assert got["hit_tokens"] == 0 + 8 + 8 and got["prompt_tokens"] == 10 + 10 + 13


def test_policy_parsing():
    p = parse_policy("sparse:per_path=3,handover=0")
    assert p.max_checkpoints_per_path == 3 and not p.donate_handover and p.branch_points
    assert parse_policy("every_chunk:per_path=0").max_checkpoints_per_path is None
    assert split_policies("none,end,sparse:per_path=2,handover=0;every_chunk") == [
        "none", "end", "sparse:per_path=2,handover=0", "every_chunk"]
    with pytest.raises(ValueError, match="keys"):
        parse_policy("sparse:cap=2")
    with pytest.raises(ValueError, match="unknown cache policy"):
        parse_policy("lru")


def test_bench_cache_end_to_end(tmp_path):
    rc = main(["bench", "cache", "--sessions", "3", "--systems", "1", "--system-len", "40", "--turns", "2",
               "--user-len", "4,12", "--answer-len", "3,6", "--fork-prob", "1", "--branches", "2", "--stagger", "2",
               "--chunk-size", "16", "--track-interval", "16", "--policies", "none,end,every_chunk,sparse",
               "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "cache_k3-tiny.json").read_text())
    md = (tmp_path / "cache_k3-tiny.md").read_text()
    rows = {r["policy"]: r for r in doc["policies"]}
    assert set(rows) == {"none", "end", "every_chunk", "sparse"} and "| sparse |" in md
    assert all(r["outputs_match"] for r in rows.values())
    assert rows["none"]["hit_rate"] == 0 and rows["none"]["checkpoint_bytes_peak"] == 0
    bound = doc["kv_only_bound"]["hit_rate"]
    assert 0 < rows["sparse"]["hit_rate"] <= bound and rows["every_chunk"]["hit_rate"] <= bound
    assert rows["every_chunk"]["checkpoints_stored"] > rows["sparse"]["checkpoints_stored"]
    for r in rows.values():  # saved tokens are what the cache hit (nothing was retracted)
        assert r["prefill_tokens_saved"] == r["hit_tokens"] and r["retractions"] == 0
    assert "sparse" in doc["aims"] and doc["environment"]["torch"]
