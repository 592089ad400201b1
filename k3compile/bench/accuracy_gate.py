"""The ladder's accuracy gate: each rung's logits against the rung before it, same inputs, same state.

For one batch size, every runner (eager model_def, then the rungs in ladder order) starts from the same
pool contents and decodes `steps` tokens teacher-forced on one token sequence: eager's greedy path
from the bench's input tokens. So rung k and rung k-1 see identical inputs and identical starting
state at every step, and any difference is what rung k's pass changed (its own rounding, or a bug).

Per rung, against the previous rung (the last one that ran) and against eager:
  rel_err          max over steps of ||a - b||_F / ||b||_F over the batch's logits (b = the reference)
  token_agreement  fraction of (step, request) where argmax(a) == argmax(b) (greedy-token agreement)
A rung is flagged when rel_err (vs the previous rung) exceeds the tolerance of the bench dtype.

Tolerances (normwise, logits, after up to `steps` teacher-forced steps):
- fp32: 1e-4. The passes reorder fp32 sums at most (passes/verify.py measures ~3e-7 per step on
  k3-tiny); the margin covers a few decode steps of drift through the recurrent state and GPU kernels
  that block reductions differently.
- bf16: 2e-2. A fused kernel keeps in fp32 what the unfused graph rounded to bf16 (or the reverse),
  so a pass changes the rounding of a few intermediates per layer. One bf16 rounding is a relative
  error of at most 2^-9 (RMS ~1.1e-3); k independently rounded intermediates in each of L layers add
  in quadrature into the residual stream: sqrt(L k) x 1.1e-3 = 1.3e-2 for L = 27, k = 5, so 2e-2
  leaves room for a fused layer that rounds differently at ~10 points, while a real bug (a wrong
  column block, a dropped bias, a wrong expert, a stale state slot) moves logits by O(0.1-1).
  passes/verify.py's 1e-2 is for one step's max-norm on CPU, where P1-P4 are bit-identical.
- fp16: 5e-3, the bf16 argument with fp16's 8x smaller unit roundoff, floored for accumulated drift.
Known limit: with random weights, a rounding-level change can flip a near-tied routing choice
(an expert) and move the logits by more than the tolerance; greedy agreement says whether the
flagged difference changes tokens. Agreement is reported, not gated: random-weight logits have
near-ties that any rounding change may flip.
"""
from __future__ import annotations

from typing import Callable

import torch

GATE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
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


def run_gate(runners: dict[str, Callable], order: list[str], reference: str, first_ids: list[int], start_pos: int,
             steps: int, batch_at: Callable, restore: Callable, tolerance: float) -> dict[str, dict]:
    """{runner name: comparison} for every name in `order` (the reference's own entry has the token path).

    runners: name -> fn(ForwardBatch) -> logits [B, vocab]; `reference` (eager) runs greedily and sets the
    token sequence; batch_at(ids, position) builds the decode batch of those tokens at that position;
    restore() resets the pools. A runner that raises gets {"error": ...} and is skipped as a reference."""
    if steps < 1:
        raise ValueError(f"the accuracy gate needs >= 1 decode step, got {steps}")
    restore()
    ids, feeds, ref_logits = list(first_ids), [], []
    for s in range(steps):
        feeds.append(ids)
        out = runners[reference](batch_at(ids, start_pos + s)).float().clone()
        ref_logits.append(out)
        ids = out.argmax(-1).tolist()
    result = {reference: {"tokens": feeds, "steps": steps, "start_position": start_pos}}
    prev_name, prev_logits = reference, ref_logits
    for name in order:
        restore()
        try:
            logits = [runners[name](batch_at(feeds[s], start_pos + s)).float().clone() for s in range(steps)]
        except Exception as e:  # a broken rung must not hide the others' numbers
            result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        vs_prev, vs_ref = _compare(logits, prev_logits), _compare(logits, ref_logits)
        result[name] = {"vs": prev_name, **vs_prev, "rel_err_vs_eager": vs_ref["rel_err"],
                        "token_agreement_vs_eager": vs_ref["token_agreement"], "tolerance": tolerance,
                        "ok": vs_prev["rel_err"] <= tolerance}
        prev_name, prev_logits = name, logits
    restore()
    return result
