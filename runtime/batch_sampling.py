"""From a step's logits to what the scheduler applies: one sampling pass for the whole batch.

Rows that sample are gathered into one [R, V] block; a request leading an n > 1 group adds one row
per follower that reuses its logits row (each follower draws with its own generator). Prefill rows
that score their prompt turn their extra logits rows into prompt logprobs. Structured-output masks
are filled here for the rows that need them unless the engine filled them before (`prepare_masks`).

`sample_batch` launches the pass and returns at once (PendingSample): the tokens stay on the
device for the next batch's input ids, and only ids (and asked-for logprobs) come to the host,
asynchronously, when `result()` is read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampler import NON_FINITE, DeviceSample, TokenLogprobs, prompt_logprobs, sample_rows_async, to_device


@dataclass
class BatchSample:
    tokens: list[int | None]  # per batch row; None where the row samples nothing
    logprobs: list[TokenLogprobs | None]  # per batch row, where its request wants logprobs
    forks: dict[int, list[tuple[int, TokenLogprobs | None]]] = field(default_factory=dict)  # row -> followers' samples
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)  # row -> (first index, entries)


def _sampling_rows(batch) -> list[int]:
    return [i for i, r in enumerate(batch.rows)
            if r.samples and not r.req.finished and r.req.params.max_new_tokens > 0]


def _group(row) -> list:
    """The requests that draw from this row: the request, and its n > 1 followers only on the row
    that gives its first token (its prompt's last chunk). With overlap, a decode row can be built
    before that first token is processed; its followers must not draw there."""
    req = row.req
    return [req, *req.followers] if row.end == req.prefill_target else [req]


def prepare_masks(batch) -> None:
    """Fill the structured-output bitmask of every guided request that samples in `batch` (its
    matcher state is final once the previous batch was processed)."""
    for i in _sampling_rows(batch):
        for r in _group(batch.rows[i]):
            if r.guide is not None:
                r.guide.fill_mask()


def needs_host(batch) -> bool:
    """Whether sampling this batch reads per-request state that the batch before it changes (the
    output so far for penalties, the matcher state for masks): then that batch must be processed
    before this one is launched."""
    return any(r.req.guide is not None or r.req.params.penalized for r in batch.rows)


def forks_after(batch) -> bool:
    """Whether processing `batch` forks n > 1 followers from a leader's working state: the next
    batch (which advances that state) must then wait until they are forked."""
    return any(r.req.followers and r.end == r.req.prefill_target for r in batch.rows)


class PendingSample:
    """A batch's sampling pass in flight on the device. `token_index[i]`: where batch row i's token
    is in `tokens` (the device tensor the next batch's placeholders read). `result()` waits for the
    host copy: (BatchSample, {row: why} for rows whose logits were non-finite)."""

    def __init__(self, n: int, draw: DeviceSample | None, owner: list, prompt_lps: dict):
        self.n, self.draw, self.owner, self.prompt_lps = n, draw, owner, prompt_lps
        self.tokens = draw.tokens if draw is not None else None
        self.token_index = {i: k for k, (i, j) in enumerate(owner) if j < 0}

    def result(self) -> tuple[BatchSample, dict[int, str]]:
        out = BatchSample([None] * self.n, [None] * self.n, prompt_logprobs=self.prompt_lps)
        errors = {}
        if self.draw is None:
            return out, errors
        tokens, lps, bad = self.draw.result()
        for (i, j), tok, lp, b in zip(self.owner, tokens, lps, bad):
            if b:
                errors[i] = f"sampling failed: {NON_FINITE}"
            elif j < 0:
                out.tokens[i], out.logprobs[i] = tok, lp
            else:
                out.forks.setdefault(i, []).append((tok, lp))
        for i in errors:
            out.tokens[i], out.logprobs[i] = None, None
            out.forks.pop(i, None)
        return out, errors


def sample_batch(batch, logits: torch.Tensor) -> PendingSample:
    n = len(batch.rows)
    spans = batch.logit_spans or [(j, j + 1) for j in range(n)]
    prompt_lps = {}
    for i, row in enumerate(batch.rows):
        a, b = spans[i]
        if b - a > 1 and not row.req.finished:
            req = row.req
            last = min(row.end, len(req.prompt_ids) - 1)  # positions scoring a prompt token
            nxt = req.prompt_ids[row.start + 1: last + 1]
            prompt_lps[i] = (row.start, prompt_logprobs(logits[a: a + len(nxt)], nxt, req.params.prompt_logprobs))
    rows = _sampling_rows(batch)
    if not rows:
        return PendingSample(n, None, [], prompt_lps)
    logit_idx, reqs, owner = [], [], []  # owner: (batch row, follower index or -1)
    for i in rows:
        for j, r in enumerate(_group(batch.rows[i])):
            logit_idx.append(spans[i][1] - 1)
            reqs.append(r)
            owner.append((i, j - 1))
    sub = logits[to_device(logit_idx, torch.int64, logits.device)]
    params = [r.params for r in reqs]
    mask_rows = [k for k, r in enumerate(reqs) if r.guide is not None]
    bitmask = None
    if mask_rows:
        for k in mask_rows:
            reqs[k].guide.fill_mask()  # no-op when prepare_masks already did
        bitmask = torch.stack([reqs[k].guide.bitmask for k in mask_rows])
    draw = sample_rows_async(sub, params, [r.generator for r in reqs],
                             prompts=[r.prompt_ids for r in reqs] if any(p.penalized for p in params) else None,
                             outputs=[r.output_ids for r in reqs], mask_rows=mask_rows, bitmask=bitmask)
    return PendingSample(n, draw, owner, prompt_lps)
