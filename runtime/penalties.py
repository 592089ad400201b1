"""Presence / frequency / repetition penalties and logit bias, applied to a whole batch of logits
rows at once: a few tensor ops per batch, never a Python loop over the vocabulary.

Token counts come from the requests' token lists, padded into one [R, L] tensor and scattered
into [R, V] counts on the logits' device (vLLM's approach before it kept counts on the device).
"""
from __future__ import annotations

import torch

from .sampling import SamplingParams


def token_counts(seqs: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[R, V] int32: how often each token occurs in each sequence."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.int32, device=device)
    if width:
        padded = torch.full((len(seqs), width), vocab, dtype=torch.int64)  # pad goes to the spare column
        for i, s in enumerate(seqs):
            if s:
                padded[i, : len(s)] = torch.as_tensor(s, dtype=torch.int64)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                    outputs: list[list[int]]) -> None:
    """In place on logits [R, V] (fp32), rows whose request asks for a penalty."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    sub = logits[rows]
    counts = token_counts([outputs[i] for i in rows], vocab, dev)
    f32 = dict(dtype=torch.float32, device=dev)
    rep = torch.tensor([params[i].repetition_penalty for i in rows], **f32)[:, None]
    if bool((rep != 1.0).any()):
        seen = (counts > 0) | (token_counts([prompts[i] for i in rows], vocab, dev) > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], **f32)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], **f32)[:, None]
    sub = sub - freq * counts - pres * (counts > 0)
    logits[rows] = sub


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place: one indexed add for every (row, token, bias) of the batch."""
    r, t, b = [], [], []
    for i, p in enumerate(params):
        for tok, bias in p.logit_bias:
            r.append(i)
            t.append(tok)
            b.append(bias)
    if not r:
        return
    dev = logits.device
    logits.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                      torch.tensor(b, dtype=logits.dtype, device=dev), accumulate=True)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: tokens whose bit is 0 in `bitmask` [len(rows), ceil(V/32)] int32 become -inf
    (the packed layout llguidance and xgrammar fill)."""
    if not rows:
        return
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device)[:, :, None] >> bits) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
