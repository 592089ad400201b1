"""Prompt-lookup (n-gram) proposer: drafts by copying what followed the latest earlier occurrence of
the history's last n tokens (n from `max_n` down to `min_n`), as vLLM's / SGLang's n-gram drafters.

It needs no model and no features. Its confidence per position is calibrated online: the running
share of drafts at position j that were accepted given positions < j were (measured from what the
runtime commits), starting from `prior`. A history with no match drafts nothing useful: confidence 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .proposer import DraftBlock, DraftRequest


@dataclass
class _Calibration:
    accepted: list[float]
    tried: list[float]

    def rate(self, j: int) -> float:
        return self.accepted[j] / self.tried[j]


@dataclass
class NgramProposer:
    gamma: int = 4
    max_n: int = 4
    min_n: int = 1
    prior: float = 0.5  # initial conditional acceptance per position (counts as `prior_weight` observations)
    prior_weight: float = 4.0
    feature_layers: tuple[int, ...] = ()
    _last: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # rid -> (history length, drafts)
    _cal: _Calibration | None = None

    def __post_init__(self):
        if self.gamma < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram proposer: need gamma >= 1 and 1 <= min_n <= max_n, got gamma={self.gamma}, "
                             f"n in [{self.min_n}, {self.max_n}]")
        self._cal = _Calibration([self.prior * self.prior_weight] * self.gamma, [self.prior_weight] * self.gamma)

    def lookup(self, ids: list[int]) -> list[int] | None:
        """The up-to-gamma tokens after the latest earlier match of the longest suffix n-gram."""
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start: start + n] == tail:
                    nxt = ids[start + n: start + n + self.gamma]
                    if nxt:
                        return nxt
        return None

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBlock:
        b = len(requests)
        tokens = torch.zeros(b, self.gamma, dtype=torch.int64)
        conf = torch.zeros(b, self.gamma, dtype=torch.float32)
        for i, r in enumerate(requests):
            found = self.lookup(r.token_ids) or []
            drafts = found + [r.token_ids[-1]] * (self.gamma - len(found))
            tokens[i] = torch.tensor(drafts)
            conf[i, : len(found)] = torch.tensor([self._cal.rate(j) for j in range(len(found))])
            self._last[r.rid] = (len(r.token_ids), drafts[: len(found)])
        return DraftBlock(tokens, None, conf)

    def observe(self, rid: str, token_ids: list[int], features: torch.Tensor | None) -> None:
        """`token_ids`: the request's whole committed history; scores the last block's drafts."""
        last = self._last.pop(rid, None)
        if last is None:
            return
        n0, drafts = last
        new = token_ids[n0:]
        for j, d in enumerate(drafts):  # greedy: draft j is accepted iff it equals the j-th committed token
            if j >= len(new):
                break
            self._cal.tried[j] += 1
            if new[j] != d:
                break
            self._cal.accepted[j] += 1

    def release(self, rid: str) -> None:
        self._last.pop(rid, None)
