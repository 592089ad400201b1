"""The contract between speculative-decoding drafters and the runtime (issue 13).

A proposer turns each running request's committed history into a block of `gamma` draft tokens
after its anchor (the last committed token), with the distribution each was drawn from and a
confidence per position. The runtime verifies the block with the target (`verify` step), keeps the
accepted prefix (lossless: greedy match or rejection sampling), commits it and tells the proposer.

    block = proposer.propose([DraftRequest(rid, token_ids, temperature, features), ...])
    ... verify, accept ...
    proposer.observe(rid, committed_token_ids, committed_features, start)   # after each commit
    proposer.release(rid)                                           # request finished / aborted

`features` are the target's hidden features for positions the proposer has not seen yet: one row
per position, the layers and stream named by the proposer's `feature_layers` (the target step
emits them when asked; empty tuple = the proposer needs none). The proposer owns any per-request
cache of them; the runtime passes each computed position's features once, in position order, with
`start` the position of the first row (positions a cached prefix skipped have none; a recomputation
after preemption passes them again from an earlier start). Proposers without `feature_layers` are
called without `start` and get features None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass
class DraftRequest:
    rid: str
    token_ids: list[int]  # prompt + committed output; the last one is the anchor
    temperature: float  # 0 = greedy: drafts are argmax and verification is exact match
    features: torch.Tensor | None = None  # [T, F] target features of positions not yet passed


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [B, gamma] int64, the proposed tokens after each anchor
    probs: torch.Tensor | None  # [B, gamma, V] fp32 draft distribution of each position (None: one-hot)
    confidence: torch.Tensor  # [B, gamma] fp32, P(position i accepted | positions < i accepted)
    # BENCHMARKS ONLY (runtime/spec/controlled.py, forced mode): [B, gamma] bool coin flips that decide which
    # drafts of greedy rows are accepted instead of the target (outputs are then NOT the target's); None: verify
    forced: torch.Tensor | None = None

    def __post_init__(self):
        b, g = self.tokens.shape
        if self.confidence.shape != (b, g):
            raise ValueError(f"confidence {tuple(self.confidence.shape)} does not match tokens {(b, g)}")
        if self.forced is not None and self.forced.shape != (b, g):
            raise ValueError(f"forced {tuple(self.forced.shape)} does not match tokens {(b, g)}")
        if self.probs is not None and self.probs.shape[:2] != (b, g):
            raise ValueError(f"probs {tuple(self.probs.shape)} does not match tokens {(b, g)}")


class Proposer(Protocol):
    gamma: int
    feature_layers: tuple[int, ...]

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBlock: ...

    def observe(self, rid: str, token_ids: list[int], features: torch.Tensor | None, start: int | None = None) -> None: ...

    def release(self, rid: str) -> None: ...
