"""The DSpark proposer: runs the block drafter (model_def/drafter.py) for a batch of requests.

Per request it keeps the drafter's context: the target features it was given (through `observe` or
`DraftRequest.features`), already projected by the drafter's `fc` + `hidden_norm` (D values per
position instead of len(feature_layers) * D), with their positions, trimmed to the drafter's
`context_window` most recent positions. Features arrive in position order, by default starting at
position 0 and each position once; the anchor (the last committed token) has none yet (the target has
not read it), so a request with features up to position k - 1 drafts from an anchor at position >= k.

`observe(..., start=s)` says the rows begin at position s: a request that hit a cached prefix gets
features from its first computed position on (the cached positions have none: the drafter reads fewer
context rows, verification keeps the output exact); a recomputation (s before the positions already
seen) replaces the rows from s on.
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
        self._pos: dict[str, torch.Tensor] = {}  # rid -> [<= window] their positions (increasing)
        self._seen: dict[str, int] = {}  # rid -> the position after the last row observed

    @classmethod
    def from_checkpoint(cls, path: str, target, gamma: int | None = None, seed: int = 0) -> "DSparkProposer":
        from k3compile.model_def.drafter_checkpoint import load_drafter
        return cls(load_drafter(path, target), gamma, seed)

    # ---- the contract ----
    @torch.no_grad()
    def observe(self, rid: str, token_ids: list[int], features: torch.Tensor | None,
                start: int | None = None) -> None:
        if features is not None and features.shape[0]:
            self._absorb(rid, features, start)

    def release(self, rid: str) -> None:
        self._rows.pop(rid, None)
        self._pos.pop(rid, None)
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
            ctx_pos[i, :n] = self._pos[r.rid]
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
    def _absorb(self, rid: str, features: torch.Tensor, start: int | None = None) -> None:
        device = self.drafter.fc.weight.device
        start = self._seen.get(rid, 0) if start is None else int(start)
        if start < 0:
            raise ValueError(f"request {rid}: features start at position {start}")
        new = self.drafter.project_features(features.to(device))
        pos = torch.arange(start, start + features.shape[0], device=device)
        old = self._rows.get(rid)
        if old is not None:
            keep = self._pos[rid] < start  # a recomputation replaces what it covers
            new, pos = torch.cat([old[keep], new]), torch.cat([self._pos[rid][keep], pos])
        self._rows[rid], self._pos[rid] = new[-self.window:], pos[-self.window:]
        self._seen[rid] = start + features.shape[0]
