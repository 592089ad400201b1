"""bench cache-pressure: the trace generator's shapes, a tiny replay through the real engine, and
the goal evaluation."""
import argparse
from dataclasses import replace

import pytest

import k3compile
from k3compile.bench.cache import parse_policy
from k3compile.bench.cache_pressure import _relate, goals, register, render_markdown, run_one
from k3compile.bench.cache_replay import StandInModel, oracle_held
from k3compile.bench.cache_traces import PRESETS, Req, Root, TraceSpec, count, count_prompts, make_trace


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
    assert kinds == {"chat", "agent", "tot", "tot_fork", "oneoff"}
    spec = TraceSpec()
    agents = [r.req.user for r in a if r.kind == "agent"]
    for r in a:
        if r.kind == "agent":  # every agent task starts with one of the shared tool prefixes and loops
            assert len(r.req.user) >= spec.tool_prefix_len[2] and r.req.children
            assert sum(u[:spec.tool_prefix_len[2]] == r.req.user[:spec.tool_prefix_len[2]] for u in agents) >= 2
        if r.kind == "tot_fork":  # a fork: siblings share the lead-in
            kids = r.req.children
            assert len(kids) >= 2 and all(k.user[:spec.branch_lead] == kids[0].user[:spec.branch_lead] for k in kids)
    oneoffs = [r.req.user for r in a if r.kind == "oneoff" and "repeat" not in r.req.tags]
    for r in a:
        if "repeat" in r.req.tags:
            assert r.req.user in oneoffs
    assert count(a) > len(a)


TOT = TraceSpec(mix=(("tot", 1.0),), roots=3, duration=10.0, seed=7)


def tot_calls(root_req, first_group=None):
    """A prompted-ToT problem's calls in the order they are sent: (tid, prompt, answer length, samples).
    A call is one request with n samples, or (`tot_samples_as_requests`) n identical requests sent
    together (`first_group`: the problem's first call's requests, all roots)."""
    calls, group = [], first_group or [root_req]
    while group:
        assert all(g.user == group[0].user and g.max_new_tokens == group[0].max_new_tokens and g.standalone
                   for g in group)
        assert len(group) == 1 or all(g.n == 1 for g in group)  # n samples: one request or n, not both
        calls.append((group[0].tid.split("#")[0], group[0].user, group[0].max_new_tokens, len(group) * group[0].n))
        assert all(not g.children for g in group[:-1])  # the next call waits for the last sample
        group = group[-1].children
    return calls


def common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_prompted_tot_is_seeded_and_within_its_clips():
    a, b = make_trace(TOT), make_trace(TOT)
    assert [(r.arrival, [c[1] for c in tot_calls(r.req)]) for r in a] == \
        [(r.arrival, [c[1] for c in tot_calls(r.req)]) for r in b]
    assert [c[1] for c in tot_calls(make_trace(replace(TOT, seed=8))[0].req)] != [c[1] for c in tot_calls(a[0].req)]
    s = TOT
    for root in a:
        calls = tot_calls(root.req)
        first = calls[0][1]
        q = len(first) - s.tot_first_template - s.tot_gen_suffix
        assert s.tot_question[2] <= q <= s.tot_question[3]
        levels = {int(tid.split(".")[1][1:]) for tid, *_ in calls}
        assert levels == set(range(s.tot_depth_bfs))
        for level in levels:
            props = [c for c in calls if c[0].split(".")[1] == f"p{level}"]
            values = [c for c in calls if c[0].split(".")[1] == f"v{level}"]
            assert 1 <= len(props) <= (1 if level == 0 else s.tot_breadth)
            assert all(n == s.tot_gen_samples for *_, n in props)
            assert all(n == s.tot_value_samples and s.tot_value_answer[2] <= ans <= s.tot_value_answer[3]
                       for _, _, ans, n in values)
            # every propose call yields 1-8 candidates, each of which gets one value call
            assert len(props) * s.tot_proposals[0] <= len(values) <= len(props) * s.tot_proposals[1]
            for _, _, ans, _ in props:  # its answer: the proposals, each a step within the clip
                assert s.tot_step[2] <= ans <= s.tot_proposals[1] * s.tot_step[3]


def test_prompted_tot_sends_a_call_with_n_samples_as_one_request():
    """The reference client's get_values sends gpt(value_prompt, n=n_evaluate_sample): one request
    with n (default 3). `tot_value_samples` sets n; `tot_samples_as_requests` sends n separate
    requests instead, with the same prompts and draws."""
    for n in (3, 5):
        one = make_trace(replace(TOT, tot_value_samples=n))
        apart = make_trace(replace(TOT, tot_value_samples=n, tot_samples_as_requests=True))
        for (r, prompt) in walk(one):
            assert r.n == (n if ".v" in r.tid else TOT.tot_gen_samples) and "#" not in r.tid
        assert all(r.n == 1 for r, _ in walk(apart))
        calls_one = [tot_calls(r.req) for r in one]
        calls_apart = [tot_calls(None, [r.req for r in apart if r.req.tid.split("#")[0] == root.req.tid])
                       for root in one]
        assert calls_one == calls_apart and any(c[3] == n for calls in calls_one for c in calls)
        assert count(one) == count(apart) == sum(c[3] for calls in calls_one for c in calls)
        assert count_prompts(one) == sum(map(len, calls_one)) < count_prompts(apart) == count(apart)
        assert len(one) == TOT.roots  # the first call is one root, not n
    assert [tot_calls(r.req) for r in make_trace(TOT)] == [tot_calls(r.req) for r in make_trace(TOT)]


def test_prompted_tot_prompts_share_template_input_steps_and_part_before_the_suffix():
    """template + question + steps so far is shared; the suffix comes after the part where two
    prompts differ, so the state `end` keeps (after a request's answer) is never on a later prompt's path."""
    s = TOT
    roots = make_trace(s)
    per_problem = [tot_calls(r.req) for r in roots]
    for calls in per_problem:
        q = len(calls[0][1]) - s.tot_first_template - s.tot_gen_suffix
        head_v = s.tot_value_template + q + s.tot_steps_label  # template + question + label
        head_p = s.tot_next_template + q + s.tot_steps_label
        values = [(tid, p) for tid, p, _, _ in calls if ".v" in tid]
        props = [(tid, p) for tid, p, _, _ in calls if ".p" in tid and not tid.endswith(".p0.0")]
        assert len({tuple(p[:head_v]) for _, p in values}) == 1 and len({tuple(p[:head_p]) for _, p in props}) == 1
        assert len({tuple(p[-s.tot_value_suffix:]) for _, p in values}) == 1
        steps = lambda p, head, suffix: p[head:len(p) - suffix]  # noqa: E731
        for level in range(s.tot_depth_bfs):
            parents = [steps(p, head_p, s.tot_gen_suffix) for tid, p in props if f".p{level}." in tid] or [[]]
            mine = [steps(p, head_v, s.tot_value_suffix) for tid, p in values if f".v{level}." in tid]
            for st in mine:  # a candidate = a kept state's steps + one new step
                (parent,) = [x for x in parents if st[:len(x)] == x and len(st) > len(x)]
                assert s.tot_step[2] <= len(st) - len(parent) <= s.tot_step[3]
            for tid, p in values:
                if f".v{level}." not in tid:
                    continue
                for tid2, p2 in values:  # siblings: shared up to their parent's steps, apart before the suffix
                    if tid2 > tid and f".v{level}." in tid2:
                        n = common(p, p2)
                        assert head_v <= n < min(len(p), len(p2)) - s.tot_value_suffix
            if level + 1 < s.tot_depth_bfs:  # the next level extends candidates: part where the suffix begins
                kept = [steps(p, head_p, s.tot_gen_suffix) for tid, p in props if f".p{level + 1}." in tid]
                assert kept and all(k in mine for k in kept)
                for tid, p in values:
                    if f".v{level}." in tid and steps(p, head_v, s.tot_value_suffix) in kept:
                        child = next(p2 for t2, p2 in values if f".v{level + 1}." in t2
                                     and p2[:len(p) - s.tot_value_suffix] == p[:len(p) - s.tot_value_suffix])
                        assert common(p, child) == len(p) - s.tot_value_suffix  # (the draws part at once here)
    # the app's templates are the same for every problem; the questions differ
    a, b = per_problem[0], per_problem[1]
    assert a[0][1][:s.tot_first_template] == b[0][1][:s.tot_first_template] and a[0][1] != b[0][1]
    assert sum("stem" in r.req.tags for r in roots) == max(0, len(roots) - 2)


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


def test_prompted_tot_replays_standalone_prompts():
    """A prompted-ToT call's prompt is its own tokens (not the previous call's context + them): the
    engine sees exactly the generator's prompts. Prompts of ~300-400 tokens finish before their
    second 256-token boundary, so `end` keeps the state at 256 (inside the template + question);
    `valued` pays one miss per new prefix (the second request plants the branch point after the
    steps they share) and then restores there, past 256."""
    spec = replace(TOT, mix=(("tot", 1.0),), roots=1, tot_question=(8, 16), tot_depth_bfs=3, tot_breadth=3,
                   tot_proposals=(4, 6), tot_value_samples=2, tot_value_answer=(2, 4))
    roots = make_trace(spec)
    calls = [c for r in roots for c in tot_calls(r.req)]
    prompts = [p for _, p, _, _ in calls]  # a value call's 2 samples: one prompt, forked
    args = pressure_args()  # the engine's chunk (256): `end` keeps a request's newest boundary state
    group = []
    for name in ("none", "end", "valued"):
        res = run_one(args, StandInModel(), parse_policy(name), roots, 8 << 20)
        res.update(trace="tot", seed=spec.seed)
        group.append(res)
    none, end, valued = _relate(group)
    assert valued["requests"] == sum(n for *_, n in calls) and valued["prompts"] == len(prompts)
    assert valued["prompt_tokens"] == sum(map(len, prompts))
    assert valued["forked_requests"] == sum(n - 1 for *_, n in calls)  # every follower forked, none prefilled
    assert valued["outputs_match"] and end["outputs_match"]
    assert end["hit_rate"] < valued["hit_rate"] <= valued["kv_only_bound"]


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


def test_oracle_holds_each_hit_state_from_its_store_to_its_last_hit():
    # serial -> [store step, hit steps...]: stored in step 2 and last hit in step 7, it is in the
    # samples after steps 2..6 (5); one hit in its own store step costs nothing; never hit: nothing
    assert oracle_held({1: [2, 4, 7], 2: [3, 3], 3: [0]}, 10) == 5 / 10
    assert oracle_held({}, 0) == 0


@pytest.mark.parametrize("policy", ["sparse", "valued"])
def test_oracle_is_within_what_the_policy_held(policy):
    """The oracle keeps only the states the policy's lookups restored from, for as long as needed,
    on the clock of the `checkpoint_bytes_mean` column: never more than the policy held. On the
    constructed trace both restore from 4 states (the stem's branch point, the repeat's tail, the
    problem's tail, the branches' branch point)."""
    res = run_one(pressure_args(), StandInModel(), parse_policy(policy), constructed_trace(), 64 << 20)
    assert 0 < res["oracle_bytes_mean"] < res["checkpoint_bytes_mean"]
    assert res["checkpoints_hit"] == 4


def test_tail_min_new_skips_tails_of_mostly_known_prompts_and_keeps_repeats():
    """`tail_new=0.5`: a prompt tail is split and stored only when half the prompt lies past its KV
    match. The second and third agent roots on the stem know 64 of their 84 tokens (20 new: no
    tail) and the fork's branches most of theirs; the stem's branch point is planted as before,
    and the one-off (all new) keeps its tail, so its repeat still restores there."""
    plain = run_one(pressure_args(), StandInModel(), parse_policy("valued"), constructed_trace(), 64 << 20)
    strict = run_one(pressure_args(), StandInModel(), parse_policy("valued:tail_new=0.5"), constructed_trace(),
                     64 << 20)
    for res in (plain, strict):
        assert [res["_cached"][f"a{k}"] for k in range(3)] == [0, 0, 64] and res["_cached"]["p.repeat"] == 96
    assert strict["checkpoints_stored"] < plain["checkpoints_stored"]
    assert strict["_outputs"] == plain["_outputs"]


@pytest.mark.parametrize("policy", ["none", "valued"])
def test_replay_forks_a_request_with_n_samples_from_one_prefill(policy):
    """A 100-token prompt with n=3, then (after all 3 samples finished) the same prompt again with
    n=3, as the server submits them (add_request fork_rids). Each prompt is prefilled once and its 2
    followers fork from it; the hit rate and the KV-only bound count each prompt once: the second
    restores at the prompt tail (96 tokens: 99 page-aligned down) under `valued`, nothing under `none`."""
    p = [200 + (j % 50) for j in range(100)]
    first = Req("v", p, 4, n=3)
    first.children = [Req("w", list(p), 4, think=1.0, standalone=True, n=3)]
    res = run_one(pressure_args(), StandInModel(), parse_policy(policy), [Root(0.0, "tot", first)], 64 << 20)
    hit = 96 if policy == "valued" else 0
    assert (res["requests"], res["prompts"], res["forked_requests"]) == (6, 2, 4)
    assert (res["prompt_tokens"], res["hit_tokens"]) == (200, hit)
    assert res["prefill_tokens_computed"] == 100 + (100 - hit)  # no follower prefills
    assert res["kv_only_bound"] == 96 / 200 and res["fraction_of_bound"] == hit / 96
    out = res["_outputs"]
    assert out["v"] == out["v#1"] == out["v#2"] and len(out["w#2"]) == 4
    assert res["_cached"]["w#1"] == res["_cached"]["w"] == hit  # the engine reports the leader's hit
    # sent as 3 requests instead, the bound would credit 2 of them with the first one's prompt
    apart = [Root(0.0, "tot", Req(f"v#{k}", list(p), 4)) for k in range(3)]
    res = run_one(pressure_args(), StandInModel(), parse_policy(policy), apart, 64 << 20)
    assert (res["prompts"], res["forked_requests"], res["kv_only_bound"]) == (3, 0, 2 * 96 / 300)


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


def test_merge_rerun_keeps_unchanged_policies_and_relates_to_them(tmp_path):
    """A re-run of `none` and `valued` merged with an earlier report: end / every_chunk come from the
    earlier run, the earlier `valued` stays as `valued@old`, ratios and goals use the merged rows."""
    import json

    from k3compile.bench.cache_pressure import merge_rerun

    base = dict(trace="tot", seed=1, budget_bytes=1 << 20, kv_only_bound=0.8, repeats=1, repeats_hit=1, stems=1,
                stems_hit=1, requests=3, fraction_of_bound=0.5, checkpoint_bytes_peak=10, checkpoint_bytes_written=10,
                ttft_mean_s=0.1, ttft_p90_s=0.2, ttft_mean_steps=1.0, retractions=0, outputs_match=True)
    row = lambda policy, hit, computed, mean: dict(base, policy=policy, hit_rate=hit, prefill_tokens_computed=computed,  # noqa: E731
                                                   checkpoint_bytes_mean=mean)
    args = vars(pressure_args()) | {"func": None}
    args.pop("func")
    old = [row("none", 0.0, 100, 0), row("end", 0.5, 60, 40), row("every_chunk", 0.55, 55, 100),
           row("valued", 0.7, 40, 300), dict(row("end", 0.1, 1, 1), trace="agent")]
    new = [row("none", 0.0, 100, 0), row("valued", 0.76, 30, 20)]
    older = [row("end", 0.4, 70, 50)]  # an even earlier report's row for the same place: the first report wins
    for name, rows in (("old", old), ("new", new), ("older", older)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cache_pressure.json").write_text(json.dumps({"rows": rows, "args": args, "goals": []}))
    merge_rerun([str(tmp_path / "old"), str(tmp_path / "older")], [str(tmp_path / "new")], str(tmp_path / "out"), "old")
    doc = json.loads((tmp_path / "out" / "cache_pressure.json").read_text())
    got = {r["policy"]: r for r in doc["rows"]}
    # the agent group was not re-run; the earlier `none` stays too (a re-run of unchanged code: the same row)
    assert sorted(got) == ["end", "every_chunk", "none", "none@old", "valued", "valued@old"]
    assert got["valued"]["source"] == str(tmp_path / "new") and got["end"]["source"] == str(tmp_path / "old")
    assert got["valued"]["prefill_tokens_saved"] == 70 and got["valued"]["bytes_vs_every_chunk"] == 0.2
    assert got["valued@old"]["bytes_vs_every_chunk"] == 3.0
    (g,) = doc["goals"]
    assert abs(g["points_above_end"] - (0.76 - 0.5) / 0.8) < 1e-9 and g["bytes_vs_every_chunk"] == 0.2
    # a tag per earlier report (reports from different sessions)
    merge_rerun([str(tmp_path / "old")], [str(tmp_path / "new")], str(tmp_path / "out2"), {str(tmp_path / "old"): "s8"})
    doc = json.loads((tmp_path / "out2" / "cache_pressure.json").read_text())
    assert "valued@s8" in {r["policy"] for r in doc["rows"]}


def test_merge_rerun_renames_only_where_a_policy_was_re_run(tmp_path):
    """`end` re-run on one budget only: its earlier row there becomes `end@old`, elsewhere it stays `end`
    (session 11 re-ran end / every_chunk on agent and tot_fork, not on tot)."""
    import json

    from k3compile.bench.cache_pressure import merge_rerun

    base = dict(trace="tot", seed=1, kv_only_bound=0.8, repeats=0, repeats_hit=0, stems=0, stems_hit=0, requests=3,
                fraction_of_bound=0.5, checkpoint_bytes_peak=10, checkpoint_bytes_written=10, ttft_mean_s=0.1,
                ttft_p90_s=0.2, ttft_mean_steps=1.0, retractions=0, outputs_match=True, prefill_tokens_computed=1,
                checkpoint_bytes_mean=1, hit_rate=0.5)
    args = vars(pressure_args()) | {"func": None}
    args.pop("func")
    old = [dict(base, policy=p, budget_bytes=b) for p in ("end", "valued") for b in (1 << 20, 2 << 20)]
    new = [dict(base, policy=p, budget_bytes=b) for p, b in (("valued", 1 << 20), ("valued", 2 << 20), ("end", 1 << 20))]
    for name, rows in (("old", old), ("new", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cache_pressure.json").write_text(json.dumps({"rows": rows, "args": args, "goals": []}))
    merge_rerun([str(tmp_path / "old")], [str(tmp_path / "new")], str(tmp_path / "out"), "old")
    doc = json.loads((tmp_path / "out" / "cache_pressure.json").read_text())
    at = lambda b: sorted(r["policy"] for r in doc["rows"] if r["budget_bytes"] == b)  # noqa: E731
    assert at(1 << 20) == ["end", "end@old", "valued", "valued@old"]
    assert at(2 << 20) == ["end", "valued", "valued@old"]


def test_goals_side_by_side_lists_each_policys_cell_where_all_have_one(tmp_path):
    """Session 12's comparison table: one line per (cell, policy), only cells every policy has a row in, each
    policy's goals against the same `end` and `every_chunk`."""
    import json

    from k3compile.bench.cache_pressure import goals_side_by_side

    base = dict(trace="tot", seed=1, budget_bytes=1 << 20, kv_only_bound=0.8, repeats=1, repeats_hit=1, stems=0,
                stems_hit=0)
    rows = [dict(base, policy="end", hit_rate=0.5, bytes_vs_every_chunk=0.5),
            dict(base, policy="valued", hit_rate=0.76, fraction_of_bound=0.95, bytes_vs_every_chunk=0.8),
            dict(base, policy="valued:x", hit_rate=0.74, fraction_of_bound=0.925, bytes_vs_every_chunk=0.2),
            dict(base, policy="valued", hit_rate=0.7, fraction_of_bound=0.875, bytes_vs_every_chunk=0.3,
                 budget_bytes=2 << 20)]  # valued:x has no row at 2 MiB: that cell is left out
    (tmp_path / "cache_pressure.json").write_text(json.dumps({"rows": rows}))
    md = goals_side_by_side(str(tmp_path), {"old": "valued", "new": "valued:x"})
    lines = [ln for ln in md.splitlines() if ln.startswith("| tot")]
    assert len(lines) == 2 and "2048 KiB" not in md
    old, new = ([c.strip() for c in ln.split("|")] for ln in lines)
    assert old[4:7] == ["old", "95.0%", "32.5"] and old[-2] == "no"  # 80% of every_chunk's bytes
    assert new[4:8] == ["new", "92.5%", "30.0", "20.0%"] and new[-2] == "**yes**"
    assert (tmp_path / "goals_old_vs_new.md").read_text() == md
