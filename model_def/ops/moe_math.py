"""Routed-expert compute reference: SiLU-GLU or SiTU-GLU experts with late routing weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def glu_act(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float, linear_beta: float) -> torch.Tensor:
    """silu: silu(g) * u.  situ (K3, spec §4.3): beta tanh(g/beta) sigmoid(g) * beta' tanh(u/beta'), in fp32."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "situ":
        g, u = gate.float(), up.float()
        h = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
        return h.to(gate.dtype)
    raise ValueError(f"unknown activation {act!r}")


def moe_experts_loop(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta):
    """Loop over the experts that were hit (host-side; the exact reference). x [N, D]; w13 [E, 2I, D]; w2 [E, D, I]."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        h = x[tok] @ w13[e].t()
        h = glu_act(h[:, :inter], h[:, inter:], act, beta, linear_beta)
        y = h @ w2[e].t()
        out.index_add_(0, tok, (y * topk_weights[tok, slot, None].to(y.dtype)).float())
    return out.to(x.dtype)


def moe_experts_gather(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta):
    """Static-shape variant (no host sync, CUDA-graph safe): gathers each (token, choice)'s expert weights.
    Memory grows with N*k*expert size, so it suits decode-sized batches only."""
    n, k = topk_ids.shape
    inter = w2.shape[2]
    xs = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, 1, -1)
    ids = topk_ids.reshape(-1)
    h = torch.bmm(xs, w13[ids].transpose(1, 2))  # [n*k, 1, 2I]
    h = glu_act(h[..., :inter], h[..., inter:], act, beta, linear_beta)
    y = torch.bmm(h, w2[ids].transpose(1, 2)).view(n, k, -1)  # [n, k, D]
    return (y.float() * topk_weights.unsqueeze(-1).float()).sum(1).to(x.dtype)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float,
          num_expert_group: int = 1, topk_group: int = 1):
    """noaux_tc routing (spec §2.4): select on sigmoid(z) + bias, weight by the unbiased sigmoid(z).

    logits [T, E] (fp32). Returns (weights [T, k] fp32, ids [T, k] int64). Group limiting keeps the
    `topk_group` groups whose top-2 biased scores sum highest; with one group it is a no-op.
    """
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    if num_expert_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, num_expert_group, e // num_expert_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(e // num_expert_group, 1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:  # transformers renormalizes even at k = 1 (DeepSeek skips it there); we follow transformers
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def moe_experts_grouped(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta):
    """Sort (token, choice) pairs by expert and run two grouped GEMMs (torch._grouped_mm, CUDA sm90, bf16).
    Static shapes and no host sync, so it is CUDA-graph safe; each routed expert's weights are read once."""
    n, k = topk_ids.shape
    inter = w2.shape[2]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    token_of = order // k
    # per-expert counts without bincount: bincount reads its max back to the host (breaks CUDA graphs)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=flat.device)
    offs = counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    h = torch._grouped_mm(x[token_of], w13.transpose(1, 2), offs=offs)  # [n*k, 2I]
    h = glu_act(h[:, :inter], h[:, inter:], act, beta, linear_beta)
    y = torch._grouped_mm(h.contiguous(), w2.transpose(1, 2), offs=offs)  # [n*k, D]
    y = y.float() * topk_weights.reshape(-1)[order].unsqueeze(-1).float()
    return torch.zeros(n, w2.shape[1], dtype=torch.float32, device=x.device).index_add_(0, token_of, y).to(x.dtype)


# ---- the expert GEMMs without the finalize (pass P12 moves the weighted sum into the collective's staging)

def expert_rows_loop(x, topk_ids, w13, w2, act, beta, linear_beta):
    """Every (token, choice)'s expert output, unweighted: (rows [N*k, D] with row t*k + s = token t's choice s,
    slot_rows [N, k] = that row index). The host-loop reference of moe_experts_loop without the weighted sum."""
    n, k = topk_ids.shape
    rows = x.new_zeros(n * k, w2.shape[1])
    inter = w2.shape[2]
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        h = x[tok] @ w13[e].t()
        rows[tok * k + slot] = glu_act(h[:, :inter], h[:, inter:], act, beta, linear_beta) @ w2[e].t()
    return rows, torch.arange(n * k, device=x.device).view(n, k)


def expert_rows_gather(x, topk_ids, w13, w2, act, beta, linear_beta):
    """moe_experts_gather without the weighted sum (static shapes, decode-sized batches): identity layout."""
    n, k = topk_ids.shape
    inter = w2.shape[2]
    ids = topk_ids.reshape(-1)
    h = torch.bmm(x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, 1, -1), w13[ids].transpose(1, 2))
    h = glu_act(h[..., :inter], h[..., inter:], act, beta, linear_beta)
    rows = torch.bmm(h, w2[ids].transpose(1, 2)).view(n * k, -1)
    return rows, torch.arange(n * k, device=x.device).view(n, k)


def expert_rows_grouped(x, topk_ids, w13, w2, act, beta, linear_beta):
    """The grouped-GEMM path (torch._grouped_mm, CUDA sm90, bf16) without its scatter: rows stay in expert
    order, and slot_rows [N, k] says where each (token, choice) landed (TensorRT-LLM's
    expanded_idx_to_permuted_idx), so the finalize reads them in place."""
    n, k = topk_ids.shape
    inter = w2.shape[2]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=flat.device)
    offs = counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    h = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs)  # [n*k, 2I]
    h = glu_act(h[:, :inter], h[:, inter:], act, beta, linear_beta)
    rows = torch._grouped_mm(h.contiguous(), w2.transpose(1, 2), offs=offs)  # [n*k, D], expert order
    slot_rows = torch.empty_like(order).scatter_(0, order, torch.arange(n * k, device=flat.device))
    return rows, slot_rows.view(n, k)


def finalize(rows, slot_rows, topk_weights, shared=None):
    """Σ_s w[t, s] · rows[slot_rows[t, s]] per token (products in rows' dtype, summed in fp32, as
    moe_experts_loop), cast to rows' dtype, then + the shared experts' output (added in that dtype)."""
    n, k = slot_rows.shape
    y = rows[slot_rows.reshape(-1)].view(n, k, rows.shape[1])
    out = (y * topk_weights.to(y.dtype).unsqueeze(-1)).float().sum(1).to(rows.dtype)
    return out if shared is None else out + shared
