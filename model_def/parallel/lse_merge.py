"""The exact merge of partial attention results by their log-sum-exps (spec §6.3).

Shard r attended over its own keys and returned o_r (softmax-weighted values over its keys) and
lse_r = log Σ_{j in S_r} exp(s_j) on the scaled scores (natural log). The full result is
o = Σ_r exp(lse_r - lse) o_r with lse = logsumexp_r lse_r. An empty shard has lse_r = -inf and
contributes nothing (whatever its o_r holds, NaN included); when every shard is empty the output
is 0 and the LSE is -inf. Everything runs in fp32.
"""
from __future__ import annotations

import torch


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o [R, ..., D], lse [R, ...] -> (o [..., D] fp32, lse [...] fp32), merged over the leading R axis."""
    if o.shape[:-1] != lse.shape:
        raise ValueError(f"partial outputs {tuple(o.shape)} and LSEs {tuple(lse.shape)} do not match")
    o, lse = o.float(), lse.float()
    m = lse.amax(0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # exp(-inf) = 0 for empty shards
    total = w.sum(0)
    contrib = torch.where(w.unsqueeze(-1) > 0, w.unsqueeze(-1) * o, torch.zeros_like(o)).sum(0)
    out = contrib / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    return out, m_safe + torch.log(total)


def merge_pair(o_a, lse_a, o_b, lse_b):
    """(o_a, lse_a) ⊕ (o_b, lse_b): FlashInfer's merge_state, associative."""
    return merge_partials(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]))
