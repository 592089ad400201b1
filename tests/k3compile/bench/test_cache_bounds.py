"""bench/cache_bounds.py: the feasibility bounds against brute force on tiny synthetic traces (every
assignment of hit depths enumerated, holding intervals found by scanning the steps, an independent
LP solve), and on a tiny replay through the real engine (a real policy never beats them)."""
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from k3compile.bench.cache_bounds import (INF, hit_options, hit_upper_bound, min_state_bytes, min_state_curve,
                                          split_resources, tangent_bound, unified_resources)


@st.composite
def traces(draw, max_requests=4):
    """Events as cache_replay.replay writes them: submits (step eligible) and finishes (step produced),
    in order; a prompt may extend an earlier request's sequence (a follow-up) or share its start."""
    n = draw(st.integers(1, max_requests))
    page = draw(st.sampled_from([1, 2]))
    seqs, reqs = [], []
    sub = 0
    for j in range(n):
        sub += draw(st.integers(0, 2))
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            base = base[:draw(st.integers(0, len(base)))]
        else:
            base = []
        prompt = base + draw(st.lists(st.integers(0, 1), min_size=1, max_size=3))
        out = draw(st.lists(st.integers(0, 1), min_size=1, max_size=3))
        fin = max(sub + draw(st.integers(0, 3)), sub + len(out) - 1)
        # the steps that gave it a token: the last one finishes it; a hole of > 1 step may be a retraction
        ts = [fin] if len(out) == 1 else \
            sorted(draw(st.sets(st.integers(sub, fin - 1), min_size=len(out) - 1, max_size=len(out) - 1))) + [fin]
        reqs.append((f"r{j}", prompt, out, sub, fin, ts))
        seqs.append(prompt + out)
    ev = [((r[3], 0, j), ("submit", r[0], r[1])) for j, r in enumerate(reqs)]
    ev += [((r[4], 1, j), ("finish", r[0], r[1] + r[2])) for j, r in enumerate(reqs)]
    ev.sort(key=lambda e: e[0])
    return [e for _, e in ev], [k[0] for k, _ in ev], page, reqs


def token_steps(reqs):
    return {r[0]: r[5] for r in reqs}


def state_compute_steps(req, d):
    """Every step at which request `req` may compute the state after its first d tokens: the prompt's
    during its prefill (submission .. first token), an output position in the step that sampled the
    next token, and everything again before the first token after a hole (a retraction's re-prefill)."""
    _, prompt, _, sub, _, ts = req
    k0 = max(0, d - len(prompt))
    steps = set(range(sub, ts[0] + 1)) if k0 == 0 else {ts[k0]}
    for k in range(max(1, k0 + 1), len(ts)):
        if ts[k] - ts[k - 1] > 1:
            steps |= set(range(ts[k - 1] + 1, ts[k] + 1))
    return steps


def brute_options(reqs, events, page, what="state"):
    """Per prompt: {depth tokens: holding steps}, found by scanning back from the prompt's step for
    the latest step at which a request submitted before it (in event order) held that prefix's KV
    (while it ran) or computed its state (`state_compute_steps`)."""
    order = [rid for kind, rid, _ in events if kind == "submit"]
    out = []
    for i, rid in enumerate(order):
        prompt, use = next(r for r in reqs if r[0] == rid)[1], next(r for r in reqs if r[0] == rid)[3]
        before = [r for r in reqs if r[0] in order[:i]]
        opts = {0: 0}
        for d in range(page, len(prompt[:-1]) - len(prompt[:-1]) % page + 1, page):
            makers = [r for r in before if (r[1] + r[2])[:-1][:d] == prompt[:d]]
            if what == "kv":
                has = lambda s: any(r[3] <= s <= r[4] for r in makers)  # noqa: E731
            else:  # a state computed after the prompt came, while it waited, can still serve its lookup
                has = lambda s: any(s in state_compute_steps(r, d) or (s == use and max(state_compute_steps(r, d)) >= use)
                                    for r in makers)  # noqa: E731
            if not makers:
                break
            latest = next(s for s in range(use, -1, -1) if has(s))
            opts[d] = use - latest
        out.append(opts)
    return out


def test_hand_example():
    # a: [1,2,3,4] finishes at step 5 with output [9]; b at step 8 asks [1,2,3,4,7]; page 2
    events = [("submit", "a", [1, 2, 3, 4]), ("finish", "a", [1, 2, 3, 4, 9]), ("submit", "b", [1, 2, 3, 4, 7])]
    opts, total = hit_options(events, [0, 5, 8], 2, {"a": [5]})
    assert total == 9 and opts[0].created == [] and opts[1].created == [5, 5] and opts[1].use == 8
    assert opts[1].created_state == [5, 5]
    curve = min_state_curve(opts, 2)
    assert curve.max_gain == 4 and curve.at(4) == 3 and curve.at(2) == 1.5  # LP: half of the 4-token option
    assert min_state_bytes(opts, 2, 4, steps=10, slot_bytes=100) == 30.0
    # 2 pages needed for steps 5..7 and a state; 1 page of capacity allows nothing but a 0-depth hit
    assert hit_upper_bound(opts, 2, 9, split_resources(2, 1))["hit_tokens"] == pytest.approx(4)
    assert hit_upper_bound(opts, 2, 9, split_resources(0, 0))["hit_tokens"] == pytest.approx(0, abs=1e-6)


def test_running_request_is_free():
    # b arrives while a is still running: the state can be had the moment b looks (optimistic)
    events = [("submit", "a", [1, 2, 3]), ("submit", "b", [1, 2, 5]), ("finish", "a", [1, 2, 3, 4]),
              ("finish", "b", [1, 2, 5, 6])]
    opts, _ = hit_options(events, [0, 1, 4, 6], 1, {"a": [4], "b": [6]})
    assert opts[1].created == [1, 1] and opts[1].created_state == [1, 1]
    assert min_state_curve(opts, 1).at(2) == 0


def test_forked_samples_count_as_makers():
    # a leader with a second sample a#1; c extends the sample's output
    events = [("submit", "a", [1, 2]), ("finish", "a", [1, 2, 3]), ("finish", "a#1", [1, 2, 4, 5]),
              ("submit", "c", [1, 2, 4, 8])]
    opts, _ = hit_options(events, [0, 2, 4, 7], 1, {"a": [2], "a#1": [3, 4]})
    assert opts[1].created == [4, 4, 4]  # KV: in a#1's pages until it finished
    assert opts[1].created_state == [3, 3, 4]  # state: the prompt's by the first token, [1, 2, 4] when sampling 5


def test_state_exists_only_when_computed():
    # a: prompt [1, 2], decodes [3, 4, 5] in steps 2, 3, 4; b asks [1, 2, 3, 4, 9] at step 9 (page 1):
    # KV of every prefix was in a's pages up to step 4, but the state after [1, 2] only in step 2
    events = [("submit", "a", [1, 2]), ("finish", "a", [1, 2, 3, 4, 5]), ("submit", "b", [1, 2, 3, 4, 9])]
    opts, _ = hit_options(events, [0, 4, 9], 1, {"a": [2, 3, 4]})
    assert opts[1].created == [4, 4, 4, 4] and opts[1].created_state == [2, 2, 3, 4]
    assert min_state_curve(opts, 1).at(4) == 5  # the deepest is the cheapest: 9 - 4
    # a hole after the first token (a retraction?): everything before the second token may have been
    # recomputed by its step (6)
    opts, _ = hit_options(events, [0, 7, 9], 1, {"a": [2, 6, 7]})
    assert opts[1].created_state == [6, 6, 6, 7]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_options_match_brute_force(t):
    events, steps, page, reqs = t
    opts, _ = hit_options(events, steps, page, token_steps(reqs))
    for o, kv, state in zip(opts, brute_options(reqs, events, page, "kv"), brute_options(reqs, events, page)):
        assert {0: 0, **{(k + 1) * page: o.use - c for k, c in enumerate(o.created)}} == kv
        mine = {0: 0, **{(k + 1) * page: o.use - c for k, c in enumerate(o.created_state)}}
        assert mine.keys() == state.keys()
        # never longer than the truth (a relaxation); equal where no request had a hole in its steps
        assert all(mine[d] <= state[d] for d in mine)
        if all(all(b - a == 1 for a, b in zip(r[5], r[5][1:])) for r in reqs):
            assert mine == state


def mckp_lp(brute, target):
    """The multiple-choice knapsack's LP relaxation solved by scipy (independent of the greedy)."""
    xs = [(i, d, c) for i, opts in enumerate(brute) for d, c in opts.items()]
    cost = [c for _, _, c in xs]
    a_ub = [[-d for _, d, _ in xs]] + [[1.0 if i == j else 0.0 for j, _, _ in xs] for i in range(len(brute))]
    b_ub = [-target] + [1.0] * len(brute)
    r = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=(0, None), method="highs")
    return r.fun if r.status == 0 else INF


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.floats(0.0, 1.0))
def test_min_state_curve_is_the_lp_and_below_every_assignment(t, frac):
    events, steps, page, reqs = t
    opts, _ = hit_options(events, steps, page, token_steps(reqs))
    brute = [{0: 0, **{(k + 1) * page: o.use - c for k, c in enumerate(o.created_state)}} for o in opts]
    truth = brute_options(reqs, events, page)
    curve = min_state_curve(opts, page)
    target = frac * curve.max_gain
    exact = min((sum(o[d] for o, d in zip(truth, ch)) for ch in itertools.product(*[list(o) for o in truth])
                 if sum(ch) >= target - 1e-9), default=INF)
    lp = curve.at(target)
    assert lp <= exact + 1e-6  # the slack `exact` allows the target (1e-9 in gain) can be worth more in cost
    assert lp == pytest.approx(mckp_lp(brute, target), abs=1e-6)
    assert tangent_bound(curve.tangents(3), target) <= lp + 1e-9  # thinned: still a lower bound
    assert tangent_bound(curve.tangents(10 ** 6), target) == pytest.approx(lp, abs=1e-6)
    assert curve.at(curve.max_gain + 1) == INF


def brute_max_hits(kv_holds, state_holds, reqs, events, page, steps, resources, running):
    """Max hit tokens over every assignment whose held KV pages and states fit every step next to the
    running requests' (a hold made in step c and used in step u is surely there in steps c+1 .. u-1)."""
    order = [rid for kind, rid, _ in events if kind == "submit"]
    prompts = {r[0]: r for r in reqs}
    best = 0
    for ch in itertools.product(*[list(o) for o in state_holds]):
        kv, state = np.zeros(steps), np.zeros(steps)
        for rid, o, so, d in zip(order, kv_holds, state_holds, ch):
            use = prompts[rid][3]
            for dd in range(page, d + 1, page):  # page ending at dd: held over [use - o[dd], use)
                kv[use - o[dd] + 1:use] += 1
            if d:
                state[use - so[d] + 1:use] += 1
        kv, state = kv + running[0], state + running[1]
        if all(np.all(r.kv_weight * kv + r.state_weight * state <= r.capacity + 1e-9) for r in resources):
            best = max(best, sum(ch))
    return best


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.integers(0, 4), st.integers(0, 2), st.booleans(), st.data())
def test_hit_upper_bound_is_above_every_feasible_assignment(t, pages, slots, unified, data):
    events, steps, page, reqs = t
    opts, _ = hit_options(events, steps, page, token_steps(reqs))
    kv_holds, state_holds = brute_options(reqs, events, page, "kv"), brute_options(reqs, events, page)
    n_steps = max(steps) + 1
    res = unified_resources(pages * 2 + slots * 3, 2, 3) if unified else split_resources(pages, slots)
    run_kv = np.array(data.draw(st.lists(st.integers(0, pages), min_size=n_steps, max_size=n_steps)), float)
    run_st = np.array(data.draw(st.lists(st.integers(0, slots), min_size=n_steps, max_size=n_steps)), float)
    if unified:  # running requests within the arena
        run_st = np.minimum(run_st, np.floor((res[0].capacity - 2 * run_kv) / 3))
    ub = hit_upper_bound(opts, page, n_steps, res, iterations=60, running=(run_kv, run_st))
    assert not ub["running_over_capacity"]
    best = brute_max_hits(kv_holds, state_holds, reqs, events, page, n_steps, res, (run_kv, run_st))
    assert best <= ub["hit_tokens"] + 1e-6
    assert ub["hit_tokens"] <= ub["ceiling"] + 1e-9
    unlimited = hit_upper_bound(opts, page, n_steps, split_resources(10 ** 6, 10 ** 6), iterations=5)
    assert unlimited["hit_tokens"] == pytest.approx(ub["ceiling"])


@pytest.mark.parametrize("unified", [False, True])
def test_tiny_replay_never_beats_the_bounds(unified):
    """Real engine runs (stand-in forward, a small agent + one-off trace and a prompted-ToT one with
    forked samples): each run's hits fit under the budget bound, and its own hits cost at least the
    least bytes any policy needs for that many hit tokens (its exact oracle is above that)."""
    import argparse
    from dataclasses import replace

    from k3compile.bench.cache import parse_policy
    from k3compile.bench.cache_pressure import register, run_one
    from k3compile.bench.cache_replay import StandInModel
    from k3compile.bench.cache_traces import TraceSpec, make_trace

    parser = argparse.ArgumentParser().add_subparsers()
    args = register(parser).parse_args(["--chunk-size", "64", "--track-interval", "64"] + ["--unified"] * unified)
    agent = TraceSpec(mix=(("agent", 1.0), ("oneoff", 1.0)), roots=3, duration=10.0, tool_prefix_len=64,
                      task_len=(8, 16), agent_steps=(2, 3), tool_result=(4, 8), agent_answer=(2, 4),
                      oneoff_len=(20, 40), oneoff_answer=(2, 4), seed=5)
    tot = TraceSpec(mix=(("tot", 1.0),), roots=1, duration=10.0, seed=7, tot_question=(8, 16), tot_depth_bfs=2,
                    tot_breadth=2, tot_proposals=(3, 4), tot_value_samples=2, tot_value_answer=(2, 4))
    for spec in (agent, tot):
        roots = make_trace(spec)
        for name, budget in (("valued", 8 << 20), ("every_chunk", 8 << 20), ("valued", 1 << 20)):
            row = run_one(args, StandInModel(), parse_policy(name), roots, budget)
            assert row["hit_tokens"] > 0
            assert row["hit_tokens"] <= row["hit_ub_tokens"] + 1e-6 <= row["hit_ceiling_tokens"] + 1e-6
            least = tangent_bound(row["min_bytes_curve"], row["hit_tokens"]) * row["slot_bytes"] / row["engine_steps"]
            assert least <= row["oracle_bytes_mean"] + 1e-6 <= row["checkpoint_bytes_mean"] + 1e-6
            assert row["bounds_consistent"] and row["min_bytes_90"] >= 0
