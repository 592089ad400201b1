"""bench cache-pressure: the trace generator's shapes, a tiny replay through the real engine, and
the goal evaluation."""
import argparse

import pytest

import k3compile
from k3compile.bench.cache import parse_policy
from k3compile.bench.cache_pressure import _relate, goals, register, render_markdown, run_one
from k3compile.bench.cache_replay import StandInModel
from k3compile.bench.cache_traces import PRESETS, Req, Root, TraceSpec, count, make_trace


def walk(roots):
    stack = [(r.req, r.req.user) for r in roots]
    while stack:
        req, prompt = stack.pop()
        yield req, prompt
        stack.extend((c, None) for c in req.children)


def test_traces_are_seeded_and_shaped():
    a = make_trace(TraceSpec(mix=PRESETS["mixed"], roots=30, seed=3))
    b = make_trace(TraceSpec(mix=PRESETS["mixed"], roots=30, seed=3))
    c = make_trace(TraceSpec(mix=PRESETS["mixed"], roots=30, seed=4))
    assert [(r.arrival, r.req.user) for r in a] == [(r.arrival, r.req.user) for r in b]
    assert [r.req.user for r in a] != [r.req.user for r in c]
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    kinds = {r.kind for r in a}
    assert kinds == {"chat", "agent", "tot", "oneoff"}
    spec = TraceSpec()
    agents = [r.req.user for r in a if r.kind == "agent"]
    for r in a:
        if r.kind == "agent":  # every agent task starts with one of the shared tool prefixes and loops
            assert len(r.req.user) >= spec.tool_prefix_len[2] and r.req.children
            assert sum(u[:spec.tool_prefix_len[2]] == r.req.user[:spec.tool_prefix_len[2]] for u in agents) >= 2
        if r.kind == "tot":  # a fork: siblings share the lead-in
            kids = r.req.children
            assert len(kids) >= 2 and all(k.user[:spec.branch_lead] == kids[0].user[:spec.branch_lead] for k in kids)
    oneoffs = [r.req.user for r in a if r.kind == "oneoff" and "repeat" not in r.req.tags]
    for r in a:
        if "repeat" in r.req.tags:
            assert r.req.user in oneoffs
    assert count(a) > len(a)


def test_lengths_follow_their_distributions():
    """Log-normal lengths: the median near the spec's, clipped to [lo, hi]; ranges and ints as given."""
    import random
    import statistics

    from k3compile.bench.cache_traces import draw_length

    rng = random.Random(0)
    xs = [draw_length(rng, (300.0, 1.0, 16, 4000)) for _ in range(4000)]
    assert 16 <= min(xs) and max(xs) <= 4000 and 270 <= statistics.median(xs) <= 330
    assert max(xs) > 3 * statistics.median(xs)  # heavy tail
    assert {draw_length(rng, (3, 5)) for _ in range(200)} == {3, 4, 5} and draw_length(rng, 7) == 7


def test_trace_spec_rejects_bad_input():
    with pytest.raises(ValueError, match="mix"):
        make_trace(TraceSpec(mix=(("video", 1.0),)))
    with pytest.raises(ValueError, match="agent_steps"):
        make_trace(TraceSpec(agent_steps=(3, 1)))
    with pytest.raises(ValueError, match="tool_result"):
        make_trace(TraceSpec(tool_result=(300.0, 1.0, 50, 10)))


def pressure_args(*extra):
    parser = argparse.ArgumentParser().add_subparsers()
    return register(parser).parse_args(list(extra))


@pytest.mark.parametrize("forward", ["cost", "model"])
def test_tiny_replay_hits_and_keeps_outputs(forward):
    model = k3compile.load_model("k3-tiny") if forward == "model" else StandInModel()
    spec = TraceSpec(mix=(("agent", 1.0), ("oneoff", 1.0)), roots=3, duration=10.0, tool_prefix_len=64,
                     task_len=(8, 16), agent_steps=(2, 3), tool_result=(4, 8), agent_answer=(2, 4),
                     oneoff_len=(20, 40), oneoff_answer=(2, 4), seed=5)
    roots = make_trace(spec)
    args = pressure_args("--forward", forward, "--chunk-size", "64", "--track-interval", "64")
    group = []
    for name in ("none", "valued"):
        res = run_one(args, model, parse_policy(name), roots, 8 << 20)
        res.update(trace="agent", seed=5)
        group.append(res)
    rows = _relate(group)
    none, valued = rows
    assert none["hit_rate"] == 0 and valued["outputs_match"] and valued["requests"] == count(roots)
    assert 0 < valued["hit_rate"] <= valued["kv_only_bound"]
    assert valued["prefill_tokens_saved"] == valued["hit_tokens"] > 0  # no retraction at this budget
    assert valued["ttft_mean_s"] > 0 and valued["ttft_mean_steps"] >= 1
    md = render_markdown({"args": vars(args) | {"roots": 3, "duration": 10.0}, "rows": rows, "goals": goals(rows)})
    assert "| agent | 5 | 8192 KiB" in md and "| valued |" in md


STEM = list(range(1, 65))  # 64 tokens: four pages


def constructed_trace():
    """Three agent roots over one 64-token stem, one after the other; a 100-token one-off and its
    exact repeat; a tree-of-thought fork whose three branches share a 30-token lead-in."""
    a = [Root(10.0 * k, "agent", Req(f"a{k}", STEM + [100 + 10 * k + j for j in range(20)], 4)) for k in range(3)]
    p = [200 + (j % 50) for j in range(100)]
    one = [Root(40.0, "oneoff", Req("p", p, 4)), Root(50.0, "oneoff", Req("p.repeat", list(p), 4, tags=("repeat",)))]
    lead = [300 + j for j in range(30)]
    problem = Req("t", [370 + j for j in range(90)], 6)
    problem.children = [Req(f"t.{b}", lead + [460 + 15 * b + j for j in range(10)], 4, think=0.5 * b) for b in range(3)]
    return a + one + [Root(60.0, "tot", problem)]


@pytest.mark.parametrize("policy", ["sparse", "valued"])
def test_repeats_and_shared_stems_hit_exactly(policy):
    """At the engine's default chunk (256) and page size 16, generous memory: the second root on a
    stem plants the branch point at 64 (it cannot hit: the first stored its state past the stem),
    the third restores there; the repeat restores at the prompt tail (99 -> 96 tokens); the first
    branch restores the problem's tail state, the second plants the branch point at the lead-in's
    end, and the third restores there."""
    args = pressure_args()
    res = run_one(args, StandInModel(), parse_policy(policy), constructed_trace(), 64 << 20)
    cached = res["_cached"]
    assert [cached[f"a{k}"] for k in range(3)] == [0, 0, 64]
    assert cached["p"] == 0 and cached["p.repeat"] == 96
    # t: 90-token prompt, tail state at 80; a branch is t's 96 tokens + 30 lead-in + 10 of its own, so
    # the branches part after 126 tokens: the branch point is at 112
    assert cached["t"] == 0 and cached["t.0"] == 80 and cached["t.1"] == 80 and cached["t.2"] == 112
    assert res["repeats_hit"] == res["repeats"] == 1


def test_goals_compare_with_end_and_every_chunk():
    base = dict(trace="tot", seed=1, budget_bytes=1 << 20, kv_only_bound=0.8, repeats=2, repeats_hit=2, stems=1,
                stems_hit=1)
    rows = [dict(base, policy="end", hit_rate=0.6, bytes_vs_every_chunk=0.2),
            dict(base, policy="valued", hit_rate=0.76, fraction_of_bound=0.95, bytes_vs_every_chunk=0.2),
            dict(base, policy="valued", hit_rate=0.9, fraction_of_bound=1.0, bytes_vs_every_chunk=0.1,
                 budget_bytes=2 << 20)]
    generous, g = goals(rows)  # every budget, generous first
    assert generous["budget_bytes"] == 2 << 20 and generous["points_above_end"] is None and not generous["met"]
    assert g["budget_bytes"] == 1 << 20 and g["met"] and abs(g["points_above_end"] - 0.2) < 1e-9
    rows[1] = dict(rows[1], repeats_hit=1)
    assert not goals(rows)[1]["met"]  # a repeat that missed fails the goal


def test_results_default_to_a_fresh_folder_not_traces(tmp_path, monkeypatch):
    """Without --out a run writes to a new bench_out/cache-pressure-<time>, never over the committed
    traces/cache_pressure (the example in the module doc names it explicitly)."""
    import os

    from k3compile.bench.cache_pressure import run

    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser().add_subparsers()
    args = register(parser).parse_args(["--traces", "agent", "--seeds", "1", "--budgets-kib", "8192",
                                        "--policies", "none", "--roots", "1", "--duration", "1"])
    assert args.out is None
    assert run(args) == 0
    (out,) = os.listdir(tmp_path / "bench_out")
    assert out.startswith("cache-pressure-") and args.out == os.path.join("bench_out", out)
    assert (tmp_path / args.out / "cache_pressure.json").exists() and not (tmp_path / "traces").exists()


def test_merge_joins_runs_and_recomputes_goals(tmp_path):
    import json

    from k3compile.bench.cache_pressure import merge

    base = dict(seed=1, budget_bytes=1 << 20, kv_only_bound=0.8, repeats=0, repeats_hit=0, stems=0, stems_hit=0,
                requests=3, hit_rate=0.7, fraction_of_bound=0.875, prefill_tokens_saved=5, checkpoint_bytes_mean=1024,
                checkpoint_bytes_peak=2048, bytes_vs_every_chunk=0.2, ttft_mean_s=0.1, ttft_p90_s=0.2,
                ttft_mean_steps=1.0, retractions=0, outputs_match=True)
    args = vars(pressure_args()) | {"func": None}
    args.pop("func")
    for trace in ("agent", "tot"):
        (tmp_path / trace).mkdir()
        doc = {"rows": [dict(base, trace=trace, policy="valued")], "args": dict(args, traces=trace), "goals": []}
        (tmp_path / trace / "cache_pressure.json").write_text(json.dumps(doc))
    md = merge([str(tmp_path / "agent"), str(tmp_path / "tot")], str(tmp_path / "both"))
    doc = json.loads((tmp_path / "both" / "cache_pressure.json").read_text())
    assert [r["trace"] for r in doc["rows"]] == ["agent", "tot"] and doc["args"]["traces"] == "agent,tot"
    assert [(g["trace"], g["met"]) for g in doc["goals"]] == [("agent", False), ("tot", False)]  # 87.5% < 90%
    assert "| agent | 1 | 1024 KiB" in md and "| tot | 1 | 1024 KiB" in md
