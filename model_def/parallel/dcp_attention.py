"""MLA attention over one DCP rank's share of the KV (spec §6.2), and the exchange that completes it.

Under DCP of size M, rank d stores position p iff p mod M == d, at local row p // M of the request's
pages. `k3::mla_partial` attends every query (all query heads this rank computes) over the local
rows that are causally visible and returns the partial latent output with its log-sum-exp; a rank
that holds no visible row returns lse = -inf. `dcp_exchange` sends each DCP rank the partials of
its own output heads in one packed all-to-all and merges them exactly (lse_merge).

The reference has static shapes (no host sync): it serves both decode (one query per request) and
prefill chunks (queries at positions prefix .. seq_len-1), so it is CUDA-graph safe.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from ..ops.eager_dispatch import k3
from . import comm
from .lse_merge import merge_partials


def latent_partial(q_lat: torch.Tensor, kv_layer: torch.Tensor, page_table: torch.Tensor, cu_seqlens: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, dcp_rank: int, dcp_size: int):
    """q_lat [N, H, W]; kv_layer [P, page, W] (local rows); -> (o [N, H, r] fp32, lse [N, H] fp32)."""
    n = q_lat.shape[0]
    tok = torch.arange(n, device=q_lat.device)
    req = torch.searchsorted(cu_seqlens[1:].long(), tok, right=True)  # request of each packed token
    q_pos = seq_lens.long()[req] - (cu_seqlens[1:].long()[req] - tok)  # absolute position of each query
    rows = kv_layer[page_table.long()].flatten(1, 2)[req].to(q_lat.dtype)  # [N, L_local, W]
    row_pos = torch.arange(rows.shape[1], device=q_lat.device) * dcp_size + dcp_rank
    scores = torch.einsum("nhw,nlw->nhl", q_lat, rows).float() * scale
    scores = scores.masked_fill(row_pos[None, None, :] > q_pos[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    o = torch.einsum("nhl,nlr->nhr", probs, rows[..., :kv_lora_rank].float())
    return o, lse


@custom_op("k3::mla_partial", mutates_args=())
def mla_partial(q_lat: torch.Tensor, kv_pool: torch.Tensor, layer: int, page_table: torch.Tensor,
                cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, dcp_rank: int,
                dcp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA over this DCP rank's rows: (latent output [N, H, r] fp32, lse [N, H] fp32)."""
    return latent_partial(q_lat, kv_pool[:, layer], page_table, cu_seqlens, seq_lens, scale, kv_lora_rank,
                          dcp_rank, dcp_size)


@mla_partial.register_fake
def _(q_lat, kv_pool, layer, page_table, cu_seqlens, seq_lens, scale, kv_lora_rank, dcp_rank, dcp_size):
    n, h = q_lat.shape[:2]
    return (q_lat.new_empty(n, h, kv_lora_rank, dtype=torch.float32), q_lat.new_empty(n, h, dtype=torch.float32))


def dcp_exchange(o: torch.Tensor, lse: torch.Tensor, dcp_size: int) -> torch.Tensor:
    """o [N, Hq, D] partial outputs of this rank's query heads, lse [N, Hq] -> merged [N, Hq/M, D] (fp32)
    for this rank's own output heads: one packed all-to-all over the DCP group, then the LSE merge."""
    n, hq, d = o.shape
    packed = torch.cat([o.float(), lse.float().unsqueeze(-1)], -1)  # [N, Hq, D+1]
    packed = packed.view(n, dcp_size, hq // dcp_size, d + 1).transpose(0, 1).contiguous()  # chunk g -> rank g
    recv = k3.all_to_all(packed, "dcp")  # [M, N, Hq/M, D+1]: chunk g from DCP rank g
    merged, _ = merge_partials(recv[..., :d], recv[..., d])
    return merged
