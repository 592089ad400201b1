"""Kimi Delta Attention reference math (pure torch, fp32): gates, recurrent and chunked forms, short conv.

Shapes per sequence: q, k [T, H, K]; v [T, H, V]; g [T, H, K] (log-decay, < 0); beta [T, H];
state S [H, K, V] (fp32). Recurrence (spec §1.1): S <- Diag(exp g) S; S <- S + beta k (v - S^T k)^T;
o = S^T (q / |q| * K^-1/2) with k <- k / |k| (epsilon inside the sqrt, as fla does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int,
             lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay g [..., H, K] in fp32 from the raw forget projection f [..., H*K].

    softplus form (Kimi Linear): g = -exp(A_log[h]) * softplus(f + dt_bias)
    lower-bound form (K3):       g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))
    """
    x = (f.float() + dt_bias.float()).unflatten(-1, (-1, head_dim))
    a = a_log.float().exp().view(-1, 1)  # one value per head
    if lower_bound is None:
        # torch's softplus switches to identity above threshold 20, as fla and transformers do
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(a * x)


def kda_recurrent(q, k, v, g, beta, state: torch.Tensor, scale: float | None = None):
    """Token-by-token KDA. Returns (o [T, H, V] fp32, final state [H, K, V] fp32). Does not modify `state`."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = l2norm(q) * scale, l2norm(k)
    s = state.float().clone()
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    for t in range(q.shape[0]):
        s = s * g[t].exp().unsqueeze(-1)
        kv_mem = (s * k[t].unsqueeze(-1)).sum(-2)  # S^T k: [H, V]
        delta = (v[t] - kv_mem) * beta[t].unsqueeze(-1)
        s = s + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[t] = (s * q[t].unsqueeze(-1)).sum(-2)
    return out, s


def kda_decode_step(s: torch.Tensor, k_normed: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One recurrent step for a batch of states s [B, H, K, V] fp32; k_normed [B, H, K] fp32 (L2-normalized),
    v [B, H, V], g [B, H, K] log-decay, beta [B, H]. Returns the new states.

    The one definition of the step: the decode op, the verify op and the ReplaySSM fold all call it, so
    a state folded from stored inputs is bit-identical to the one decode writes from the same inputs.
    """
    s = s * g.float().exp().unsqueeze(-1)
    kv_mem = (s * k_normed.unsqueeze(-1)).sum(-2)  # S^T k: [B, H, V]
    delta = (v.float() - kv_mem) * beta.float().unsqueeze(-1)
    return s + k_normed.unsqueeze(-1) * delta.unsqueeze(-2)


def kda_read(s: torch.Tensor, q_scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """o = S^T q for a batch: s [B, H, K, V], q_scaled [B, H, K] fp32 -> [B, H, V] in `dtype`."""
    return (s * q_scaled.unsqueeze(-1)).sum(-2).to(dtype)


def kda_chunked(q, k, v, g, beta, state: torch.Tensor, chunk_size: int = 64, scale: float | None = None):
    """Chunkwise-parallel KDA (WY / UT transform, spec §1.3); equal to `kda_recurrent` up to fp32 rounding.

    Within a chunk with inclusive log-decay prefix sums G, delta = (I + M)^-1 Diag(beta) (V - (Γ⊙K) S),
    M[r, s] = beta_r Σ_i k_r[i] k_s[i] exp(G_r[i] - G_s[i]) for s < r. Ratios are always formed as
    exp(G_r - G_s) with s <= r, which is <= 1, so nothing overflows however strong the decay.
    """
    T = q.shape[0]
    pad = (-T) % chunk_size
    if pad:  # zero k, v, beta and g: padded steps leave the state untouched
        q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    out, s = kda_chunked_batch(*(t.unsqueeze(0) for t in (q, k, v, g, beta)), state.unsqueeze(0), chunk_size, scale)
    return out[0, :T], s[0]


def kda_chunked_batch(q, k, v, g, beta, state: torch.Tensor, chunk_size: int = 64, scale: float | None = None):
    """`kda_chunked` for B sequences at once: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] with T a
    multiple of chunk_size (zero-padded at the end of shorter sequences: zero k, v, beta and g leave the state
    exactly as it was), state [B, H, K, V]. Returns (o [B, T, H, V] fp32, final states [B, H, K, V] fp32)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = l2norm(q) * scale, l2norm(k)
    if q.shape[1] % chunk_size:
        raise ValueError(f"kda_chunked_batch takes whole chunks: {q.shape[1]} tokens, chunk {chunk_size}")
    # -> [B, H, n_chunks, C, ...]
    q, k, v, g = (t.transpose(1, 2).unflatten(2, (-1, chunk_size)) for t in (q, k, v, g))
    beta = beta.transpose(1, 2).unflatten(2, (-1, chunk_size))
    G = g.cumsum(-2)
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B, H, N, C(r), C(s), K] = G_r - G_s
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
    kk = torch.einsum("bhnri,bhnsi,bhnrsi->bhnrs", k, k, decay)
    strict = torch.ones_like(causal).tril(-1)
    M = kk * beta.unsqueeze(-1) * strict
    eye = torch.eye(chunk_size, device=q.device)
    A = torch.linalg.solve_triangular(eye + M, torch.diag_embed(beta), upper=False, unitriangular=True)
    W = A @ (G.exp() * k)  # [B, H, N, C, K]
    U = A @ v  # [B, H, N, C, V]
    qk = torch.einsum("bhnri,bhnsi,bhnrsi->bhnrs", q, k, decay) * causal  # inclusive of the diagonal
    s = state.float().clone()  # [B, H, K, V]
    out = torch.empty_like(U)
    for n in range(q.shape[2]):
        delta = U[:, :, n] - W[:, :, n] @ s
        out[:, :, n] = (q[:, :, n] * G[:, :, n].exp()) @ s + qk[:, :, n] @ delta
        g_last = G[:, :, n, -1:]  # [B, H, 1, K]
        s = s * g_last.transpose(-1, -2).exp() + (k[:, :, n] * (g_last - G[:, :, n]).exp()).transpose(-1, -2) @ delta
    return out.flatten(2, 3).transpose(1, 2), s


def sequence_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request each packed token belongs to ([N] int64), on the device, without a host sync."""
    cu = cu_seqlens.to(torch.int64)
    return torch.searchsorted(cu[1:], torch.arange(num_tokens, device=cu.device), right=True)


def short_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor):
    """Causal depthwise conv + SiLU over one sequence continuing from `window`.

    x [T, C] new inputs, weight [C, W], window [C, W-1] (the previous W-1 inputs, oldest first).
    Returns (y [T, C], new window [C, W-1]). Math in fp32, output in x's dtype.
    """
    full = torch.cat([window.to(x.dtype).t(), x], 0)  # [W-1+T, C]
    w = weight.float()
    width = w.shape[-1]
    frames = full.float().unfold(0, width, 1)  # [T, C, W]
    y = F.silu((frames * w).sum(-1))
    new_window = full[-(width - 1):].t() if width > 1 else window
    return y.to(x.dtype), new_window


def short_conv_layout(cu_seqlens: torch.Tensor, num_tokens: int, width: int) -> tuple[torch.Tensor, ...]:
    """The row indices `short_conv_packed` uses, which depend on the batch only (cu_seqlens, N, conv width), not on
    a layer: (token rows [N], window rows [B*(W-1)], frame rows [N, W], last rows [B, W-1]) in the extended layout
    where each sequence's W-1 window rows sit right before its tokens. A step computes them once for all its convs."""
    past = width - 1
    cu = cu_seqlens.to(torch.int64)
    dev, b = cu.device, cu.shape[0] - 1
    seq = sequence_ids(cu, num_tokens)
    tok_row = torch.arange(num_tokens, device=dev) + (seq + 1) * past  # token t's row in the extended layout
    win_row = (cu[:-1] + torch.arange(b, device=dev) * past).unsqueeze(1) + torch.arange(past, device=dev)  # [B, W-1]
    frames = tok_row.unsqueeze(1) - past + torch.arange(width, device=dev)  # [N, W]
    last = (cu[1:] + torch.arange(1, b + 1, device=dev) * past - past).unsqueeze(1) + torch.arange(past, device=dev)
    return tok_row, win_row.flatten(), frames, last


def short_conv_packed(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, cu_seqlens: torch.Tensor,
                      layout: tuple[torch.Tensor, ...] | None = None):
    """`short_conv` for B packed sequences at once, with no per-sequence loop and no host sync.

    x [N, C] packed new inputs cut by cu_seqlens [B+1]; windows [B, C, W-1] each sequence's previous
    inputs (oldest first). Returns (y [N, C], new windows [B, C, W-1]), the same math as `short_conv`
    per sequence: each sequence's window rows are laid out right before its tokens, and every token
    reads the W rows ending at itself (a sequence shorter than W-1 keeps part of its old window).
    `layout`: `short_conv_layout(cu_seqlens, N, W)` when the caller has it already (the same for every layer).
    """
    n, c = x.shape
    b, width = windows.shape[0], weight.shape[-1]
    past = width - 1
    if past == 0:
        return F.silu(x.float() * weight.float()[:, 0]).to(x.dtype), windows
    tok_row, win_rows, frame_rows, last = layout if layout is not None else short_conv_layout(cu_seqlens, n, width)
    ext = x.new_empty(n + b * past, c)
    ext[win_rows] = windows.to(x.dtype).transpose(1, 2).reshape(b * past, c)
    ext[tok_row] = x
    frames = ext[frame_rows]  # [N, W, C]
    y = F.silu((frames.transpose(1, 2).float() * weight.float()).sum(-1))
    return y.to(x.dtype), ext[last].transpose(1, 2)
