"""From a step's logits to what the scheduler applies: one sampling pass for the whole batch.

Rows that sample are gathered into one [R, V] block; a request leading an n > 1 group adds one row
per follower that reuses its logits row (each follower draws with its own generator). Prefill rows
that score their prompt turn their extra logits rows into prompt logprobs. Structured-output masks
are filled here for the rows that need them unless the engine filled them while the forward ran
(`prepare_masks`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampler import TokenLogprobs, prompt_logprobs, sample_rows


@dataclass
class BatchSample:
    tokens: list[int | None]  # per batch row; None where the row samples nothing
    logprobs: list[TokenLogprobs | None]  # per batch row, where its request wants logprobs
    forks: dict[int, list[tuple[int, TokenLogprobs | None]]] = field(default_factory=dict)  # row -> followers' samples
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)  # row -> (first index, entries)


def _sampling_rows(batch) -> list[int]:
    return [i for i, r in enumerate(batch.rows)
            if r.samples and not r.req.finished and r.req.params.max_new_tokens > 0]


def prepare_masks(batch) -> None:
    """Fill the structured-output bitmask of every guided request that samples in `batch` (its
    matcher state is final once the previous batch was processed). Called while the forward runs."""
    for i in _sampling_rows(batch):
        req = batch.rows[i].req
        for r in [req, *req.followers]:
            if r.guide is not None:
                r.guide.fill_mask()


def sample_batch(batch, logits: torch.Tensor) -> BatchSample:
    n = len(batch.rows)
    out = BatchSample([None] * n, [None] * n)
    spans = batch.logit_spans or [(j, j + 1) for j in range(n)]
    for i, row in enumerate(batch.rows):
        a, b = spans[i]
        if b - a > 1 and not row.req.finished:
            req = row.req
            last = min(row.end, len(req.prompt_ids) - 1)  # positions scoring a prompt token
            nxt = req.prompt_ids[row.start + 1: last + 1]
            out.prompt_logprobs[i] = (row.start, prompt_logprobs(logits[a: a + len(nxt)], nxt,
                                                                 req.params.prompt_logprobs))
    rows = _sampling_rows(batch)
    if not rows:
        return out
    logit_idx, reqs, owner = [], [], []  # owner: (batch row, follower index or -1)
    for i in rows:
        req = batch.rows[i].req
        for j, r in enumerate([req, *req.followers]):
            logit_idx.append(spans[i][1] - 1)
            reqs.append(r)
            owner.append((i, j - 1))
    sub = logits[torch.tensor(logit_idx, device=logits.device)]
    params = [r.params for r in reqs]
    mask_rows = [k for k, r in enumerate(reqs) if r.guide is not None]
    bitmask = None
    if mask_rows:
        for k in mask_rows:
            reqs[k].guide.fill_mask()  # no-op when prepare_masks already did
        bitmask = torch.stack([reqs[k].guide.bitmask for k in mask_rows])
    tokens, lps = sample_rows(sub, params, [r.generator for r in reqs],
                              prompts=[r.prompt_ids for r in reqs] if any(p.penalized for p in params) else None,
                              outputs=[r.output_ids for r in reqs], mask_rows=mask_rows, bitmask=bitmask)
    for (i, j), tok, lp in zip(owner, tokens, lps):
        if j < 0:
            out.tokens[i], out.logprobs[i] = tok, lp
        else:
            out.forks.setdefault(i, []).append((tok, lp))
    return out
