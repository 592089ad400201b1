"""Block Attention Residuals read (spec §3.2): a softmax mixture over the bank rows and the partial sum.

a(rows; w, γ) = Σ_j π_j r_j with π = softmax_j(Σ_d r_j[d] / rms(r_j) · γ[d] · w[d]); fp32 on raw rows.
`*_res_proj` (Linear D -> 1, weight w) and `*_res_norm` (RMSNorm weight γ) keep the checkpoint names.
"""
from __future__ import annotations

import torch


def attn_res_read(rows: list[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    if len(rows) == 1:  # softmax over one source is exactly 1
        return rows[0]
    r = torch.stack(rows, 0).float()  # [S, N, D]
    query = (proj_weight.float().view(-1) * norm_weight.float())  # γ ⊙ w collapses to one D-vector
    logits = (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * query).sum(-1)  # [S, N]
    pi = logits.softmax(0)
    return (pi.unsqueeze(-1) * r).sum(0).to(rows[0].dtype)
