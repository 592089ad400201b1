"""Gated NoPE-MLA attention reference math over paged latent KV (pure torch).

A cache row is [c ; k_r]: the RMS-normed latent c (kv_lora_rank) and the shared, never-rotated
"rope" slot k_r. Prefill expands c through kv_b_proj into per-head keys/values; decode uses the
absorbed form (queries mapped into latent space), which reads only the 576-wide rows.
"""
from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def mla_expanded(q: torch.Tensor, rows: torch.Tensor, kv_b_weight: torch.Tensor, kv_lora_rank: int,
                 nope_dim: int, scale: float, prefix_len: int) -> torch.Tensor:
    """Causal attention of T new queries (absolute positions prefix_len..) over `rows` [L, W].

    q [T, H, nope+rope]; kv_b_weight [H*(nope+v), r]. Returns [T, H, v] in q's dtype; softmax in fp32.
    """
    prefix = torch.tensor([prefix_len], device=q.device)
    return mla_expanded_batch(q.unsqueeze(0), rows.unsqueeze(0), kv_b_weight, kv_lora_rank, nope_dim, scale,
                              prefix)[0]


def mla_expanded_batch(q: torch.Tensor, rows: torch.Tensor, kv_b_weight: torch.Tensor, kv_lora_rank: int,
                       nope_dim: int, scale: float, prefix: torch.Tensor) -> torch.Tensor:
    """`mla_expanded` for G requests with T new queries each: q [G, T, H, nope+rope], rows [G, L, W] (a
    request's rows past its own context are never attended: query t of request g sees rows <= prefix[g] + t),
    prefix [G] int. Returns [G, T, H, v]."""
    G, T, H, _ = q.shape
    L = rows.shape[1]
    c, k_r = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]
    kv = (c @ kv_b_weight.t()).unflatten(-1, (H, -1))  # [G, L, H, nope+v]
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    scores = torch.einsum("gthd,glhd->ghtl", q[..., :nope_dim], k_nope)
    scores = scores + torch.einsum("gthd,gld->ghtl", q[..., nope_dim:], k_r)
    scores = scores.float() * scale
    probs = scores.masked_fill(~_causal_from(prefix, T, L).unsqueeze(1), float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("ghtl,glhd->gthd", probs, v)


def _causal_from(prefix: torch.Tensor, T: int, L: int) -> torch.Tensor:
    """[G, T, L] bool: query t of request g (absolute position prefix[g] + t) may read row l."""
    qpos = torch.arange(T, device=prefix.device) + prefix.view(-1, 1)
    return torch.arange(L, device=prefix.device).view(1, 1, L) <= qpos.unsqueeze(-1)


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


def mla_expanded_sdpa_batch(q: torch.Tensor, rows: torch.Tensor, kv_b_weight: torch.Tensor, kv_lora_rank: int,
                            nope_dim: int, scale: float, prefix: torch.Tensor) -> torch.Tensor:
    """`mla_expanded_batch` through one F.scaled_dot_product_attention call for the G requests."""
    G, T, H, _ = q.shape
    L = rows.shape[1]
    c, k_r = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]
    kv = (c @ kv_b_weight.t()).unflatten(-1, (H, -1))
    k = torch.cat([kv[..., :nope_dim], k_r.unsqueeze(2).expand(G, L, H, k_r.shape[-1])], -1)
    v = kv[..., nope_dim:]
    # query t sits at absolute position prefix + t: causal aligned to the bottom-right corner
    allowed = _causal_from(prefix, T, L).unsqueeze(1)  # [G, 1, T, L]
    with sdpa_kernel(MLA_PREFILL_SDPA_BACKENDS):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), attn_mask=allowed, scale=scale)
    return o.transpose(1, 2)


# SDPA backends the MLA prefill may use: every one but cuDNN's. On an H200 (torch 2.11) SDPA picked cuDNN for
# these masked calls, and cuDNN builds an execution graph for every new (batch, T, L) shape: ~12 ms a call on
# the host (89 ms in the warm-up), and serving sees a new shape with nearly every prompt
# (traces/h200_s11/call1/diag_serve.txt: 152 calls = 1.9 s of a 2.6 s round of 16 short prompts).
MLA_PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# Largest number of elements one batched call of `mla_prefill_packed` may expand (the per-head keys and values
# of its requests' contexts, or their scores): bounds the memory of a group of long contexts.
MLA_GROUP_ELEMENTS = 1 << 26


def mla_prefill_packed(q: torch.Tensor, kv_layer: torch.Tensor, kv_b_weight: torch.Tensor, page_table: torch.Tensor,
                       cu: list[int], seq: list[int], scale: float, kv_lora_rank: int, nope_dim: int,
                       attend=mla_expanded_batch) -> torch.Tensor:
    """MLA prefill over packed requests (q [N, H, nope+rope]; cu, seq: host lists of cu_seqlens and seq_lens):
    requests with the same number of new tokens run as one batched `attend` call (their contexts padded to the
    longest; the causal mask hides the padding), split only where a call would exceed MLA_GROUP_ELEMENTS. So
    a step issues one call per distinct chunk length, not one per request. Returns [N, H, v]."""
    H = q.shape[1]
    per_head = kv_b_weight.shape[0] // H
    out = q.new_empty(q.shape[0], H, per_head - nope_dim)
    page, dev = kv_layer.shape[1], q.device
    groups: dict[int, list[int]] = {}
    for i in range(len(seq)):
        groups.setdefault(cu[i + 1] - cu[i], []).append(i)
    for t, members in groups.items():
        members.sort(key=lambda i: -seq[i])  # longest contexts first: each call pads to its first member
        k = 0
        while k < len(members):
            lmax = seq[members[k]]
            fit = max(1, MLA_GROUP_ELEMENTS // (lmax * H * max(per_head + q.shape[2], t)))
            part = members[k:k + fit]
            k += fit
            idx = torch.tensor(part, dtype=torch.int64, device=dev)
            tok = (torch.tensor([cu[i] for i in part], dtype=torch.int64, device=dev).unsqueeze(1)
                   + torch.arange(t, device=dev)).flatten()
            n_pages = -(-lmax // page)
            ctx = kv_layer[page_table[idx, :n_pages].long()].flatten(1, 2)[:, :lmax]  # [G, lmax, W]
            if seq[part[-1]] < lmax:  # rows past a shorter context: zeros, so no garbage (NaN x 0) leaks in
                lens = torch.tensor([seq[i] for i in part], device=dev)
                ctx = ctx.masked_fill((torch.arange(lmax, device=dev) >= lens.unsqueeze(1)).unsqueeze(-1), 0)
            prefix = torch.tensor([seq[i] - t for i in part], dtype=torch.int64, device=dev)
            o = attend(q[tok].unflatten(0, (len(part), t)), ctx.to(q.dtype), kv_b_weight, kv_lora_rank, nope_dim,
                       scale, prefix)
            out[tok] = o.flatten(0, 1).to(out.dtype)
    return out
