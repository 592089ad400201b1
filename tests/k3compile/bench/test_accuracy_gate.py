"""The ladder's accuracy gate on stand-in runners (no model): teacher forcing on the reference's greedy path,
each runner compared with the one before it, flags over tolerance, broken runners skipped as references."""
import pytest
import torch

from k3compile.bench.accuracy_gate import GATE_TOLERANCE, rel_err, run_gate

VOCAB, B = 7, 3


class Pools:
    """A fake pool state: restore() resets it; a runner that forgets to start from it would drift."""
    def __init__(self):
        self.state = 0.0
        self.restores = 0

    def restore(self):
        self.state = 0.0
        self.restores += 1


def runner(pools, seen, scale=1.0, shift=0.0):
    """logits depend on the input ids, the position and the (mutating) state, like a decode step."""
    def run(batch):
        ids, pos = batch
        seen.append((tuple(ids), pos))
        pools.state += 1.0
        x = torch.tensor(ids, dtype=torch.float32)[:, None] + torch.arange(VOCAB) * 0.5 + pos + pools.state
        return (torch.sin(x * 1.3) * scale + shift)
    return run


def test_rel_err_is_normwise():
    b = torch.tensor([3.0, 4.0])
    assert rel_err(b, b) == 0.0
    assert rel_err(torch.tensor([3.0, 4.5]), b) == pytest.approx(0.5 / 5)
    assert rel_err(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rel_err(torch.ones(2), torch.zeros(2)) == float("inf")


def test_teacher_forced_chain_and_flags():
    pools, seen = Pools(), {n: [] for n in ("eager", "r0", "r1", "r2", "r3")}
    runners = {"eager": runner(pools, seen["eager"]), "r0": runner(pools, seen["r0"]),
               "r1": runner(pools, seen["r1"], scale=1.001),  # a 1e-3 change: over fp32's tolerance
               "r2": runner(pools, seen["r2"], scale=1.001)}  # same as r1: within tolerance vs r1

    def broken(batch):
        raise RuntimeError("kernel exploded\nsecond line")
    runners["r3"] = broken
    tol = GATE_TOLERANCE[torch.float32]
    res = run_gate(runners, ["r0", "r1", "r3", "r2"], "eager", [1, 2, 3], start_pos=10, steps=3,
                   batch_at=lambda ids, pos: (list(ids), pos), restore=pools.restore, tolerance=tol)
    # every runner saw exactly eager's inputs: same tokens, positions 10, 11, 12
    assert [p for _, p in seen["eager"]] == [10, 11, 12]
    for n in ("r0", "r1", "r2"):
        assert seen[n] == seen["eager"], n
    feeds = res["eager"]["tokens"]
    assert feeds[0] == [1, 2, 3] and len(feeds) == 3 and all(len(f) == B for f in feeds)
    # the reference's greedy path: each next input is the argmax of the previous logits
    assert pools.restores == 1 + 4 + 1  # before eager, before each runner, after
    assert res["r0"]["vs"] == "eager" and res["r0"]["rel_err"] == 0.0 and res["r0"]["ok"]
    assert res["r0"]["token_agreement"] == 1.0 and len(res["r0"]["rel_err_per_step"]) == 3
    assert res["r1"]["vs"] == "r0" and res["r1"]["rel_err"] == pytest.approx(1e-3, rel=1e-3) and not res["r1"]["ok"]
    assert res["r1"]["token_agreement"] == 1.0  # a uniform scale keeps every argmax
    assert "kernel exploded" in res["r3"]["error"] and "second line" not in res["r3"]["error"]
    # r3 failed, so r2 is compared with r1 (the last runner that ran): identical, so within tolerance
    assert res["r2"]["vs"] == "r1" and res["r2"]["rel_err"] == 0.0 and res["r2"]["ok"]
    assert res["r2"]["rel_err_vs_eager"] == pytest.approx(1e-3, rel=1e-3)


def test_agreement_counts_changed_argmax():
    pools, seen = Pools(), []
    base = runner(pools, seen)

    def flipped(batch):  # reverses the vocabulary order: the argmax moves for every request
        return base(batch).flip(-1)
    res = run_gate({"eager": base, "x": flipped}, ["x"], "eager", [0, 1, 2], 0, 2,
                   lambda ids, pos: (ids, pos), pools.restore, 1e-2)
    assert res["x"]["token_agreement"] < 1.0 and not res["x"]["ok"]


def test_needs_a_step():
    with pytest.raises(ValueError, match=">= 1 decode step"):
        run_gate({"eager": None}, [], "eager", [1], 0, 0, None, lambda: None, 1e-2)


def test_tolerances_order_with_precision():
    assert GATE_TOLERANCE[torch.float32] < GATE_TOLERANCE[torch.float16] < GATE_TOLERANCE[torch.bfloat16] <= 2e-2


def test_probes_compare_with_the_reference_and_calibrate_the_tolerance():
    """Probes run against the reference (not chained); calibrated, the tolerance is max(floor, 2 x the rounding
    probe's error) and judges the rungs and the probes alike."""
    from k3compile.bench.accuracy_gate import CALIBRATION_MARGIN, CALIBRATION_PROBE

    pools, seen = Pools(), []
    runners = {"eager": runner(pools, seen), "r0": runner(pools, seen, scale=1.004)}
    probes = {CALIBRATION_PROBE: runner(pools, seen, scale=1.003), "probe:bug": runner(pools, seen, scale=1.5)}
    args = (["r0"], "eager", [1, 2, 3], 0, 2, lambda ids, pos: (list(ids), pos), pools.restore)
    res = run_gate(runners, *args, 1e-4, probes, calibrate=True)
    assert res[CALIBRATION_PROBE]["vs"] == res["probe:bug"]["vs"] == "eager"
    assert res[CALIBRATION_PROBE]["rel_err"] == pytest.approx(3e-3, rel=1e-3)
    tol = res["eager"]["tolerance"]
    assert tol == pytest.approx(CALIBRATION_MARGIN * 3e-3, rel=1e-3) and res["eager"]["tolerance_floor"] == 1e-4
    assert res["r0"]["ok"] and res[CALIBRATION_PROBE]["ok"] and not res["probe:bug"]["ok"]
    # uncalibrated: the floor judges (r0's 4e-3 is over 1e-4); a floor above 2 x the probe stays the floor
    assert not run_gate(runners, *args, 1e-4, probes)["r0"]["ok"]
    assert run_gate(runners, *args, 0.1, probes, calibrate=True)["eager"]["tolerance"] == 0.1
