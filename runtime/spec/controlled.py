"""CONTROLLED-ACCEPTANCE proposer, for benchmarks only: not a drafter.

It knows each prompt's greedy continuation in advance (recorded from a plain, non-speculative greedy
run of the same target) and drafts the target's own next token with probability `p`, otherwise a
wrong one (that token + 1 mod vocab). Acceptance is therefore controlled: the chance the k-th draft
survives is p^k, which is what its confidence reports. It lets the runtime's speculation machinery
(verify, fold, planner) be measured at a chosen acceptance on a target whose weights are random, where
no trained drafter exists (issue 13: "a drafter with controlled acceptance, clearly labelled").
A history that left the recording (or a prompt it was not given) gets wrong drafts, confidence 0.

`forced=True` is for targets whose greedy tokens depend on the kernels that compute them: a random-weight
model's logits are nearly flat, so the verify step (other kernels than the decode step that recorded the
references) picks another argmax on most tokens, and acceptance collapses to 1 (seen on the H200 with
k3-mini-6b in bf16). Then the coin flips themselves decide: each draft is accepted with probability p
(given the earlier ones were) and committed as drafted, followed by the target's own token, so the
verify / fold / planner work is what a drafter of that acceptance would cost, but the output is NOT the
target's greedy output (no losslessness claim; benches say so).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .proposer import DraftBlock, DraftRequest

LABEL = "controlled-acceptance oracle (not a drafter)"
FORCED_LABEL = "controlled acceptance, forced by coin flips (not a drafter; outputs not the target's)"


@dataclass
class ControlledAcceptanceProposer:
    references: dict[tuple[int, ...], list[int]]  # prompt -> its greedy continuation from a plain run
    p: float
    vocab_size: int
    gamma: int = 4
    seed: int = 0
    forced: bool = False  # the coin flips decide acceptance (see the module docstring)
    feature_layers: tuple[int, ...] = ()
    _gen: torch.Generator = field(init=False)

    def __post_init__(self):
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"controlled acceptance p must be in [0, 1], got {self.p}")
        self._gen = torch.Generator().manual_seed(self.seed)
        self._full = {prompt: list(prompt) + list(cont) for prompt, cont in self.references.items()}
        self._seen: dict[str, list[int]] = {}  # rid -> the recording its history matched last

    def _truth(self, rid: str, ids: list[int]) -> list[int] | None:
        # the recording a request matched keeps matching while its history grows along it (a recording that did
        # not match a shorter history cannot match a longer one), so the scan over all of them runs once per
        # request, not per request per step (that was O(batch^2) host work inside the timed loop)
        full = self._seen.get(rid)
        if full is None or full[: len(ids)] != ids:
            full = next((f for prompt, f in self._full.items() if len(ids) >= len(prompt) and f[: len(ids)] == ids),
                        None)
            if full is None:
                return None
            self._seen[rid] = full
        return full[len(ids): len(ids) + self.gamma]

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBlock:
        b = len(requests)
        tokens = torch.zeros(b, self.gamma, dtype=torch.int64)
        conf = torch.zeros(b, self.gamma, dtype=torch.float32)
        hit = torch.rand(b, self.gamma, generator=self._gen) < self.p
        for i, r in enumerate(requests):
            truth = self._truth(r.rid, r.token_ids)
            if truth is None:
                tokens[i] = (r.token_ids[-1] + 1) % self.vocab_size
                continue
            truth = truth + [truth[-1] if truth else r.token_ids[-1]] * (self.gamma - len(truth))
            for j, t in enumerate(truth):
                tokens[i, j] = t if hit[i, j] else (t + 1) % self.vocab_size
            conf[i] = self.p  # conditional: each position, given the earlier ones, survives with p
        if self.forced:
            return DraftBlock(tokens, None, torch.full((b, self.gamma), self.p), forced=hit)
        return DraftBlock(tokens, None, conf)

    def observe(self, rid: str, token_ids: list[int], features: torch.Tensor | None) -> None:
        pass

    def release(self, rid: str) -> None:
        self._seen.pop(rid, None)
