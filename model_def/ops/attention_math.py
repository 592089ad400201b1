"""Gated NoPE-MLA attention reference math over paged latent KV (pure torch).

A cache row is [c ; k_r]: the RMS-normed latent c (kv_lora_rank) and the shared, never-rotated
"rope" slot k_r. Prefill expands c through kv_b_proj into per-head keys/values; decode uses the
absorbed form (queries mapped into latent space), which reads only the 576-wide rows.
"""
from __future__ import annotations

import torch


def gather_rows(kv_layer: torch.Tensor, page_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cache rows of one request: kv_layer [P, page, W], page_row [max_pages]."""
    page = kv_layer.shape[1]
    n_pages = (length + page - 1) // page
    return kv_layer[page_row[:n_pages].long()].flatten(0, 1)[:length]


def mla_expanded(q: torch.Tensor, rows: torch.Tensor, kv_b_weight: torch.Tensor, kv_lora_rank: int,
                 nope_dim: int, scale: float, prefix_len: int) -> torch.Tensor:
    """Causal attention of T new queries (absolute positions prefix_len..) over `rows` [L, W].

    q [T, H, nope+rope]; kv_b_weight [H*(nope+v), r]. Returns [T, H, v] in q's dtype; softmax in fp32.
    """
    T, H, _ = q.shape
    c, k_r = rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
    kv = (c @ kv_b_weight.t()).unflatten(-1, (H, -1))  # [L, H, nope+v]
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    scores = torch.einsum("thd,lhd->htl", q[..., :nope_dim], k_nope)
    scores = scores + torch.einsum("thd,ld->htl", q[..., nope_dim:], k_r)
    scores = scores.float() * scale
    L = rows.shape[0]
    qpos = torch.arange(T, device=q.device) + prefix_len
    mask = torch.arange(L, device=q.device)[None, :] > qpos[:, None]
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("htl,lhd->thd", probs, v)


def mla_decode_latent(q_lat: torch.Tensor, kv_layer: torch.Tensor, page_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed decode for B requests, static shapes (no host sync, CUDA-graph safe).

    q_lat [B, H, W] = [W_UK^T q_nope ; q_rope]; kv_layer [P, page, W]; page_table [B, max_pages].
    Returns the latent output [B, H, r] = softmax(q_lat . rows) @ c. Padded positions are masked.
    """
    B, max_pages = page_table.shape
    rows = kv_layer[page_table.long()].flatten(1, 2)  # [B, max_pages*page, W]
    scores = torch.einsum("bhw,blw->bhl", q_lat, rows).float() * scale
    pos = torch.arange(rows.shape[1], device=q_lat.device)
    scores = scores.masked_fill(pos[None, None, :] >= seq_lens[:, None, None], float("-inf"))
    probs = scores.softmax(-1).to(q_lat.dtype)
    return torch.einsum("bhl,blr->bhr", probs, rows[..., :kv_lora_rank])


def mla_expanded_sdpa(q: torch.Tensor, rows: torch.Tensor, kv_b_weight: torch.Tensor, kv_lora_rank: int,
                      nope_dim: int, scale: float, prefix_len: int) -> torch.Tensor:
    """`mla_expanded` through F.scaled_dot_product_attention (fused kernels on CUDA); same math."""
    T, H, _ = q.shape
    L = rows.shape[0]
    c, k_r = rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
    kv = (c @ kv_b_weight.t()).unflatten(-1, (H, -1))
    k = torch.cat([kv[..., :nope_dim], k_r.unsqueeze(1).expand(L, H, k_r.shape[-1])], -1)
    v = kv[..., nope_dim:]
    # query t sits at absolute position prefix_len + t: causal aligned to the bottom-right corner
    allowed = torch.arange(L, device=q.device)[None, :] <= (torch.arange(T, device=q.device) + prefix_len)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         attn_mask=allowed, scale=scale)
    return o.transpose(0, 1)
