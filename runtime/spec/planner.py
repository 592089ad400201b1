"""Per-step verify planner (issue 13, item 6; DSpark's hardware- and load-aware scheduling).

Each request drafts gamma tokens with confidences c_j = P(draft j accepted | drafts < j were); the
survival of draft j is s_j = c_1 ... c_j, so verifying a request's first l drafts yields 1 + s_1 + ...
+ s_l tokens in expectation (the 1: the target's own token, always). The step's cost is the measured
T(B, N) at N verify tokens in all (cost_profile.py).

"trim": drafts are taken greedily by survival (within a request survival never grows, so this keeps
prefixes) and the plan keeps the prefix of that order with the best expected tokens per millisecond
E_k / T(B, B + k) -- that is, a draft is kept while its expected value, with everything kept before it,
covers the marginal cost it adds at the current load; searching the whole order (not stopping at the
first loss) lets a plan step over one riser of the cost staircase onto the next flat shelf when the
drafts beyond it pay for it. Early exit: when the whole block costs no more than `flat_tolerance` above
the step without drafts (small batches sit on the staircase's first shelf), everything is kept.
Decode instead: when the profile also holds the plain decode step's time, no plan (not even the verify of
the anchors alone) is taken unless its expected tokens per ms beat decode's B / T_decode(B); otherwise the
plan says `decode` and the runtime runs a plain decode step (a verify step whose kernels are slower than
decode's, as on the H200 today, then never makes speculation a loss).
"all": every draft is verified (the verify-all baseline). Either way verification of what is kept is
unchanged, so output stays lossless.

`padded`: verify steps run padded to (batch, tokens per request) buckets (CUDA graphs), so a step
costs T(B, B * (longest kept + 1)) whatever the others keep; otherwise (varlen) T(B, total tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cost_profile import CostProfile

PLANS = ("all", "trim")


@dataclass
class Plan:
    keep: list[int]  # drafts verified per request
    expected_tokens: float  # sum over requests of 1 + survivals kept
    step_ms: float | None  # T(B, N) from the profile (None without one)
    early_exit: bool = False
    decode: bool = False  # no verify pays: run the plain decode step instead


@dataclass
class Planner:
    mode: str = "all"
    profile: CostProfile | None = None
    flat_tolerance: float = 0.02  # early exit: full block within 2% of the no-draft step
    padded: bool = False

    def __post_init__(self):
        if self.mode not in PLANS:
            raise ValueError(f"planner mode must be one of {PLANS}, got {self.mode!r}")
        if self.mode == "trim" and self.profile is None:
            raise ValueError("the trim planner needs a cost profile (k3compile profile verify)")

    def plan(self, confidence: torch.Tensor, limits: list[int]) -> Plan:
        """confidence [B, gamma]; limits[i]: at most this many drafts for request i (context, max tokens)."""
        b, gamma = confidence.shape
        if len(limits) != b:
            raise ValueError(f"planner: {b} requests but {len(limits)} limits")
        limits = [max(0, min(gamma, int(x))) for x in limits]
        surv = confidence.float().clamp(0, 1).cumprod(-1)

        def cost(drafts: int, longest: int) -> float | None:
            if self.profile is None:
                return None
            return self.profile.step_time(b, b * (longest + 1) if self.padded else b + drafts)

        full, longest = sum(limits), max(limits, default=0)
        exp_all = b + sum(float(surv[i, :limits[i]].sum()) for i in range(b))
        if self.mode == "all":
            return Plan(limits, exp_all, cost(full, longest))
        decode_ms = self.profile.decode_time(b)

        def unless_decode_pays_more(plan: Plan) -> Plan:
            if decode_ms is not None and plan.expected_tokens / plan.step_ms <= b / decode_ms:
                return Plan([0] * b, float(b), decode_ms, decode=True)
            return plan

        if full == 0:
            return unless_decode_pays_more(Plan(limits, exp_all, cost(0, 0)))
        if cost(full, longest) <= cost(0, 0) * (1 + self.flat_tolerance):
            return unless_decode_pays_more(Plan(limits, exp_all, cost(full, longest), early_exit=True))
        # greedy order by survival; ties by position so a request's drafts stay in order
        cand = sorted(((float(surv[i, j]), j, i) for i in range(b) for j in range(limits[i])),
                      key=lambda x: (-x[0], x[1]))
        best_k, best_rate, e, top = 0, b / cost(0, 0), float(b), 0
        for k, (s, j, _) in enumerate(cand, start=1):
            e, top = e + s, max(top, j + 1)
            rate = e / cost(k, top)
            if rate > best_rate:
                best_k, best_rate = k, rate
        keep = [0] * b
        exp = float(b)
        for s, _, i in cand[:best_k]:
            keep[i] += 1
            exp += s
        return unless_decode_pays_more(Plan(keep, exp, cost(best_k, max(keep))))
