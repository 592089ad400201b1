"""The ladder's accuracy gate: each rung's logits against the rung before it, same inputs, same state.

For one batch size, every runner (eager model_def, then the rungs in ladder order) starts from the same
pool contents and decodes `steps` tokens teacher-forced on one token sequence: eager's greedy path
from the bench's input tokens. So rung k and rung k-1 see identical inputs and identical starting
state at every step, and any difference is what rung k's pass changed (its own rounding, or a bug).

Per rung, against the previous rung (the last one that ran) and against eager:
  rel_err          max over steps of ||a - b||_F / ||b||_F over the batch's logits (b = the reference)
  token_agreement  fraction of (step, request) where argmax(a) == argmax(b) (greedy-token agreement)
A rung is flagged when rel_err (vs the previous rung) exceeds the tolerance (below).

Two routing modes (the ladder runs both; k3compile/bench/pinned_routing.py):
  pinned  every router's top-k fixed to a seeded, input-independent set through its selection-only
          correction bias: the verdict. Routing is the step's one discontinuity: on random weights a
          rounding-sized change flips near-tied experts, and the flips, amplified over the MoE layers,
          moved the H200 48B ladder's logits by 0.2-0.5 for passes whose kernels are right. Pinned, the
          step is a smooth function of its rounding, so error stays proportional to it.
  free    the model's own routing (what serving does): reported, judged against the same tolerance,
          not gated (a near-tied expert or argmax flip is not a bug).

Tolerance (normwise, logits, after up to `steps` teacher-forced steps) = max(floor, CALIBRATION_MARGIN x
the rounding probe's error), the probe measured in the same run, pinned, at the same shape and batch:
- the floor, GATE_TOLERANCE per dtype. fp32: 1e-4 (the passes reorder fp32 sums at most; passes/verify.py
  measures ~3e-7 per step on k3-tiny; a few steps of drift through the recurrent state and GPU blockings).
  bf16: 2e-2: one bf16 rounding is a relative error of at most 2^-9 (RMS ~1.1e-3); k independently
  rounded intermediates in each of L layers add in quadrature: sqrt(L k) x 1.1e-3 = 1.3e-2 for L = 27,
  k = 5. fp16: 5e-3, the same argument with fp16's 8x smaller unit roundoff, floored for drift.
- the calibration (gate_probes.reordered_gemms): eager with EVERY dense GEMM computed as a split-K sum
  whose halves are rounded to the compute dtype: a rounding-only change at more points than any one pass
  changes. The quadrature floor assumes each layer passes errors on without gain; random weights at the
  real shapes (std 0.02 ~ hidden^-1/2 at 2304: every projection keeps the norm) have gain. Measured on
  CPU (tiny presets with that gain: init std hidden^-1/2), rounding probe vs bugs in one MoE layer, rel err:
                                          rounding probe     drop_shared  wrong_expert  scale x1.01
    k3-tiny bf16, b8, 4 steps, pinned     9.7e-2             0.51         0.67          1.1e-2
                                  free    0.69 (agree 72%)   0.54         0.73          1.4e-2
    k3-tiny fp32, b8, 4 steps, pinned     3.2e-6             0.48         0.68          8.2e-3
    kimi-linear-tiny bf16, b8, pinned     3.8e-2             0.37         0.62          1.0e-2
                                  free    0.38 (agree 78%)   0.53         0.76          1.0e-2
    kimi-linear-tiny as 27 layers, 64 experts top-8 (the 48B's depth and fan-out), bf16, b4, 3 steps:
                                  pinned  8.0e-2             0.25         0.32          1.7e-2
                                  free    0.82 (agree 17%)   0.47         0.54          0.10
  Free, the rounding probe is as large as a bug: the H200 symptom. Pinned, it is 3-10x below the bugs.
  The fp32/bf16 ratio of the pinned probe (3.2e-6 / 9.7e-2 ~ 2^-24 / 2^-8 x 2) says pinned error is
  linear in the unit roundoff, ~50 u at these gains, not the ~5 u of the quadrature floor: a static bf16
  tolerance either flags correct passes or hides bugs; the probe measures the floor where the gate runs.
  CALIBRATION_MARGIN = 2: pinned error is a sum of many independent roundings, so a pass that changes
  rounding at no more points than the probe lands within about its error; 2x covers a pass that rounds
  worse (bf16 where the graph kept fp32) at as many points, and stays below the smallest structural bug
  measured (3x the probe, 27 layers). The tests (tests/k3compile/bench/test_pinned_routing.py) hold a
  rounding change other than the probe (split at K/3) within it and these bugs over it, both presets, bf16
  and fp32. What a bf16 gate cannot see: a 1% scale of one layer (1e-2, under the rounding floor); the
  fp32 gate catches it (8e-3 vs 1e-4). With 0.02 weights at hidden 64 (the presets' own init, what
  `bench ladder` on CPU runs) layers shrink their input and no one-layer bug reaches bf16 logits
  (drop_shared 1.5e-2, wrong_expert 6e-3 at k3-tiny): the probes' lines in the ladder's markdown say so.
"""
from __future__ import annotations

from typing import Callable

import torch

GATE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # the floors
CALIBRATION_MARGIN = 2.0
CALIBRATION_PROBE = "probe:reordered-gemms"
# the gate runs once per mode, the first is the verdict (k3compile/bench/pinned_routing.py)
GATE_MODES = ("pinned", "free")
DEFAULT_GATE_STEPS = 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, fp32); inf when b is all zeros and a is not."""
    a, b = a.float(), b.float()
    den = float(torch.linalg.vector_norm(b))
    num = float(torch.linalg.vector_norm(a - b))
    return num / den if den else (0.0 if num == 0 else float("inf"))


def _compare(logits: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    errs = [rel_err(a, b) for a, b in zip(logits, ref)]
    agree = [(a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(logits, ref)]
    return {"rel_err": max(errs), "rel_err_per_step": errs, "token_agreement": sum(agree) / len(agree)}


def calibrated_tolerance(floor: float, probe_rel_err: float | None) -> float:
    """max(floor, CALIBRATION_MARGIN x the rounding probe's error): see the module docstring."""
    return floor if probe_rel_err is None else max(floor, CALIBRATION_MARGIN * probe_rel_err)


def _run(fn, feeds, batch_at, start_pos) -> list[torch.Tensor]:
    return [fn(batch_at(ids, start_pos + s)).float().clone() for s, ids in enumerate(feeds)]


def run_gate(runners: dict[str, Callable], order: list[str], reference: str, first_ids: list[int], start_pos: int,
             steps: int, batch_at: Callable, restore: Callable, tolerance: float,
             probes: dict[str, Callable] | None = None, calibrate: bool = False,
             parents: dict[str, str] | None = None) -> dict[str, dict]:
    """{runner name: comparison} for every name in `order` and `probes` (the reference's own entry has the
    token path and the tolerance used).

    runners: name -> fn(ForwardBatch) -> logits [B, vocab]; `reference` (eager) runs greedily and sets the
    token sequence; batch_at(ids, position) builds the decode batch of those tokens at that position;
    restore() resets the pools. A runner that raises gets {"error": ...} and is skipped as a reference.
    probes (gate_probes.probe_runners): compared with the reference itself, not chained, and run first:
    with `calibrate`, the tolerance is calibrated_tolerance(tolerance, CALIBRATION_PROBE's error).
    parents: name -> the earlier runner in `order` it is compared with instead of the one just before it
    (bench ladder's variants: each against the last rung)."""
    if steps < 1:
        raise ValueError(f"the accuracy gate needs >= 1 decode step, got {steps}")
    restore()
    ids, feeds, ref_logits = list(first_ids), [], []
    for s in range(steps):
        feeds.append(ids)
        out = runners[reference](batch_at(ids, start_pos + s)).float().clone()
        ref_logits.append(out)
        ids = out.argmax(-1).tolist()
    probed = {}
    for name, fn in (probes or {}).items():
        restore()
        probed[name] = _compare(_run(fn, feeds, batch_at, start_pos), ref_logits)
    if calibrate and CALIBRATION_PROBE not in probed:
        raise ValueError(f"a calibrated gate needs the {CALIBRATION_PROBE!r} probe")
    tol = calibrated_tolerance(tolerance, probed[CALIBRATION_PROBE]["rel_err"] if calibrate else None)
    result = {reference: {"tokens": feeds, "steps": steps, "start_position": start_pos, "tolerance": tol,
                          "tolerance_floor": tolerance, "calibrated": calibrate}}
    prev_name, prev_logits = reference, ref_logits
    seen = {reference: ref_logits}
    for name in order:
        restore()
        try:
            logits = _run(runners[name], feeds, batch_at, start_pos)
        except Exception as e:  # a broken rung must not hide the others' numbers
            result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        seen[name] = logits
        parent = (parents or {}).get(name)
        if parent is not None and parent in seen:
            prev_name, prev_logits = parent, seen[parent]
        vs_prev, vs_ref = _compare(logits, prev_logits), _compare(logits, ref_logits)
        result[name] = {"vs": prev_name, **vs_prev, "rel_err_vs_eager": vs_ref["rel_err"],
                        "token_agreement_vs_eager": vs_ref["token_agreement"], "tolerance": tol,
                        "ok": vs_prev["rel_err"] <= tol}
        prev_name, prev_logits = name, logits
    for name, cmp in probed.items():
        result[name] = {"vs": reference, **cmp, "tolerance": tol, "ok": cmp["rel_err"] <= tol}
    restore()
    return result
