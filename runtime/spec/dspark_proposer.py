"""The DSpark proposer: runs the block drafter (model_def/drafter.py) for a batch of requests.

Per request it keeps the drafter's context: the target features it was given (through `observe` or
`DraftRequest.features`), already projected by the drafter's `fc` + `hidden_norm` (D values per
position instead of len(feature_layers) * D) and trimmed to the drafter's `context_window` most recent
positions. Features arrive in position order, each position once, starting at position 0; the anchor
(the last committed token) has none yet (the target has not read it), so a request with k feature rows
drafts from an anchor at position >= k.
"""
from __future__ import annotations

from typing import Sequence

import torch

from k3compile.model_def.drafter import K3DSparkDrafter

from .proposer import DraftBlock, DraftRequest


class DSparkProposer:
    def __init__(self, drafter: K3DSparkDrafter, gamma: int | None = None, seed: int = 0):
        cfg = drafter.config
        self.gamma = cfg.block_size if gamma is None else gamma
        if not 1 <= self.gamma <= cfg.block_size:
            raise ValueError(f"gamma must be in 1..{cfg.block_size} (the drafter's block_size), got {self.gamma}")
        self.drafter = drafter
        self.feature_layers = cfg.target_layer_ids
        self.window = cfg.context_window
        device = drafter.fc.weight.device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._rows: dict[str, torch.Tensor] = {}  # rid -> [<= window, D] projected context rows
        self._seen: dict[str, int] = {}  # rid -> positions observed so far

    @classmethod
    def from_checkpoint(cls, path: str, target, gamma: int | None = None, seed: int = 0) -> "DSparkProposer":
        from k3compile.model_def.drafter_checkpoint import load_drafter
        return cls(load_drafter(path, target), gamma, seed)

    # ---- the contract ----
    @torch.no_grad()
    def observe(self, rid: str, token_ids: list[int], features: torch.Tensor | None) -> None:
        if features is not None and features.shape[0]:
            self._absorb(rid, features)

    def release(self, rid: str) -> None:
        self._rows.pop(rid, None)
        self._seen.pop(rid, None)

    @torch.no_grad()
    def propose(self, requests: Sequence[DraftRequest]) -> DraftBlock:
        if not requests:
            raise ValueError("propose() needs at least one request")
        for r in requests:
            if not r.token_ids:
                raise ValueError(f"request {r.rid}: no tokens (the anchor is the last committed token)")
            if r.features is not None and r.features.shape[0]:
                self._absorb(r.rid, r.features)
            if self._seen.get(r.rid, 0) > len(r.token_ids) - 1:
                raise ValueError(f"request {r.rid}: features for {self._seen[r.rid]} positions but only "
                                 f"{len(r.token_ids) - 1} committed tokens before the anchor")
        device = self.drafter.fc.weight.device
        rows = [self._rows.get(r.rid) for r in requests]
        width = max((0 if x is None else x.shape[0]) for x in rows)
        b, d = len(requests), self.drafter.config.hidden_size
        ctx = torch.zeros(b, width, d, dtype=self.drafter.fc.weight.dtype, device=device)
        ctx_pos = torch.zeros(b, width, dtype=torch.long, device=device)
        visible = torch.zeros(b, 1, width, dtype=torch.bool, device=device)
        for i, (r, x) in enumerate(zip(requests, rows)):
            if x is None:
                continue
            n = x.shape[0]
            ctx[i, :n] = x
            ctx_pos[i, :n] = torch.arange(self._seen[r.rid] - n, self._seen[r.rid], device=device)
            visible[i, 0, :n] = True
        anchors = torch.tensor([r.token_ids[-1] for r in requests], dtype=torch.long, device=device)
        anchor_pos = torch.tensor([len(r.token_ids) - 1 for r in requests], dtype=torch.long, device=device)
        temps = torch.tensor([float(r.temperature) for r in requests], device=device)
        tokens, probs, conf = self.drafter.draft(ctx, ctx_pos, visible, anchors, anchor_pos, self.gamma, temps,
                                                 self.generator)
        if bool((temps <= 0).all()):
            probs = None  # greedy drafts are one-hot: the contract's None
        return DraftBlock(tokens, probs, conf)

    # ---- per-request context ----
    def _absorb(self, rid: str, features: torch.Tensor) -> None:
        new = self.drafter.project_features(features.to(self.drafter.fc.weight.device))
        old = self._rows.get(rid)
        rows = new if old is None else torch.cat([old, new])
        self._rows[rid] = rows[-self.window:]
        self._seen[rid] = self._seen.get(rid, 0) + features.shape[0]
