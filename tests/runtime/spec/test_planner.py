"""Trim planner: keeps prefixes within limits, maximizes expected tokens per ms on the profile."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.runtime.spec.cost_profile import CostProfile
from k3compile.runtime.spec.planner import Planner


def _profile(fn, batches=(1, 4, 16, 64), tokens=(1, 2, 3, 4, 5)):
    return CostProfile("test", "m", list(batches), list(tokens), [[fn(b, t) for t in tokens] for b in batches])


FLAT = _profile(lambda b, t: 10.0)
LINEAR = _profile(lambda b, t: 10.0 + b * t)  # every verify token costs 1 ms


def test_all_keeps_every_draft_up_to_limits():
    plan = Planner("all").plan(torch.full((3, 4), 0.1), [4, 2, 0])
    assert plan.keep == [4, 2, 0]


def test_flat_profile_exits_early_with_everything():
    plan = Planner("trim", FLAT).plan(torch.full((4, 4), 0.05), [4] * 4)
    assert plan.early_exit and plan.keep == [4] * 4


def test_trim_drops_unlikely_drafts_when_tokens_cost():
    conf = torch.tensor([[0.99, 0.99, 0.99, 0.99], [0.05, 0.9, 0.9, 0.9], [0.9, 0.1, 0.9, 0.9], [0.5] * 4])
    plan = Planner("trim", LINEAR).plan(conf, [4] * 4)
    assert plan.keep[0] == 4 and plan.keep[1] == 0 and plan.keep[2] <= 1
    # the plan beats verifying everything and nothing in expected tokens per ms
    all_plan = Planner("all", LINEAR).plan(conf, [4] * 4)
    rate = lambda p: p.expected_tokens / p.step_ms  # noqa: E731
    assert rate(plan) >= rate(all_plan) and rate(plan) >= 4 / LINEAR.step_time(4, 4)


def test_staircase_step_over_a_riser_onto_a_shelf():
    # one riser at 2 tokens per request, then flat: confident drafts pay for the riser together
    stair = _profile(lambda b, t: 10.0 if t < 2 else 14.0)
    plan = Planner("trim", stair).plan(torch.full((4, 4), 0.8), [4] * 4)
    assert plan.keep == [4] * 4
    plan = Planner("trim", stair).plan(torch.full((4, 4), 0.05), [4] * 4)
    assert plan.keep == [0] * 4


def test_trim_needs_a_profile():
    with pytest.raises(ValueError, match="cost profile"):
        Planner("trim")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(0, 1), min_size=4, max_size=4), min_size=1, max_size=6),
       st.lists(st.integers(0, 4), min_size=6, max_size=6))
def test_plan_is_within_limits_and_keeps_prefixes(conf, limits):
    b = len(conf)
    c = torch.tensor(conf)
    plan = Planner("trim", LINEAR).plan(c, limits[:b])
    assert all(0 <= k <= lim for k, lim in zip(plan.keep, limits[:b]))
    surv = c.cumprod(-1)
    want = b + sum(float(surv[i, :plan.keep[i]].sum()) for i in range(b))
    assert plan.expected_tokens == pytest.approx(want, rel=1e-5)


def test_profile_interpolates_and_round_trips(tmp_path):
    p = LINEAR
    assert p.step_time(4, 4 * 2.5) == pytest.approx(10 + 4 * 2.5)
    assert p.step_time(3, 3) == pytest.approx(p.step_time(4, 4))  # the batch-4 bucket, one token each
    path = tmp_path / "p.json"
    p.save(str(path))
    assert CostProfile.load(str(path)).step_ms == p.step_ms
    with pytest.raises(ValueError, match="step_ms"):
        CostProfile("d", "m", [1], [1, 2], [[1.0]])


def test_padded_steps_cost_the_longest_request():
    # padded (CUDA graphs): one confident request cannot make the whole batch pay for 4 more tokens each
    conf = torch.tensor([[0.9] * 4] + [[0.05] * 4] * 7)
    varlen = Planner("trim", LINEAR).plan(conf, [4] * 8)
    padded = Planner("trim", LINEAR, padded=True).plan(conf, [4] * 8)
    assert varlen.keep[0] == 4
    assert padded.step_ms == pytest.approx(LINEAR.step_time(8, 8 * (max(padded.keep) + 1)))
    assert padded.expected_tokens / padded.step_ms >= 8 / LINEAR.step_time(8, 8)


def _with_decode(profile, decode_ms):
    return CostProfile(profile.device, profile.model, profile.batch_sizes, profile.verify_tokens, profile.step_ms,
                       {"decode_ms": [decode_ms(b) for b in profile.batch_sizes]})


def test_trim_runs_decode_when_no_verify_pays():
    conf = torch.full((4, 4), 0.7)
    slow_verify = _with_decode(LINEAR, lambda b: 2.0)  # decode 2 ms; verifying the anchors alone costs 14
    plan = Planner("trim", slow_verify).plan(conf, [4] * 4)
    assert plan.decode and plan.keep == [0] * 4 and plan.step_ms == 2.0
    assert Planner("trim", slow_verify).plan(conf, [0] * 4).decode  # nothing to draft: decode too
    assert not Planner("all", slow_verify).plan(conf, [4] * 4).decode  # verify-all is the baseline: it never decides
    fast_verify = _with_decode(FLAT, lambda b: 9.9)  # the whole block for 1% more than decode: keep it all
    plan = Planner("trim", fast_verify).plan(conf, [4] * 4)
    assert not plan.decode and plan.keep == [4] * 4


def test_h200_profile_of_k3_mini_6b_decodes_at_every_measured_batch():
    """The H200 profile (traces/h200_s6): a verify step costs 2.9-3.7x a decode step even for the anchors alone,
    so at acceptance 0.7 no plan beats decoding."""
    from pathlib import Path
    prof = CostProfile.load(str(Path(__file__).parents[3] / "traces/h200_s6/NVIDIA-H200__k3-mini-6b.json"))
    for b in prof.batch_sizes:
        assert Planner("trim", prof).plan(torch.full((b, 4), 0.7), [4] * b).decode, b
