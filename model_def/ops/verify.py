"""The `k3::` ops of the verify step (speculative decoding, ReplaySSM; spec §5.3).

A verify step runs gamma + 1 tokens per request (the anchor and the drafts) against the committed
KDA state without writing it. What lets the runtime keep only the accepted prefix afterwards is
stored in a per-request draft window (model_def/draft_window.py), one row per request of the batch
(row i = the batch's i-th request):

* `short_conv_verify`: the causal conv continues from the committed window (read only) and stores
  each position's conv *input* in `win_x`, so the window can later be rolled forward to exactly the
  accepted prefix.
* `kda_verify` (ReplaySSM): the recurrence runs from the committed state in a scratch copy (the pool
  is never written) and each position's raw inputs are stored: k after the conv and before the L2
  norm, v, the log-decay g after the gate activation and beta after the sigmoid. The fold
  (`draft_window.commit`) later replays the accepted prefix from these, with the decode step's math.
* `kda_verify_snapshot` (the baseline): the same recurrence, storing the whole state after every
  position instead (what SGLang's intermediate_ssm cache / vLLM's per-draft state pages hold).

Both KDA ops use `kda_math.kda_decode_step`, the step the decode op uses, so verify outputs equal the
outputs decode would give for the same inputs.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from . import kda_math


def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


@custom_op("k3::short_conv_verify", mutates_args=("win_x",))
def short_conv_verify(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, layer: int,
                      channel_offset: int, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                      win_x: torch.Tensor) -> torch.Tensor:
    """x [N, C] -> SiLU(causal conv) [N, C] from each request's committed window (not written);
    stores x at win_x[row, layer, position, channel_offset:+C]."""
    c = x.shape[1]
    out = torch.empty_like(x)
    for i, (s, e) in enumerate(_spans(cu_seqlens)):
        win = conv_pool[int(slots[i]), layer, channel_offset: channel_offset + c]
        out[s:e], _ = kda_math.short_conv(x[s:e], weight, win)
        win_x[i, layer, : e - s, channel_offset: channel_offset + c] = x[s:e].to(win_x.dtype)
    return out


@short_conv_verify.register_fake
def _(x, weight, conv_pool, layer, channel_offset, slots, cu_seqlens, win_x):
    return torch.empty_like(x)


def _recurrent_from_committed(q, k, v, g, beta, ssm_pool, layer, slots, cu_seqlens, on_step):
    """Run the decode step position by position, batched over the requests that still have tokens,
    from a scratch copy of each request's committed state. `on_step(rows, t, states)` sees the
    states after position t of the requests `rows`. Returns o [N, H, V] in v's dtype."""
    spans = _spans(cu_seqlens)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    states = ssm_pool[slots, layer].clone()  # [B, H, K, V]: the pool itself is only read
    qf = kda_math.l2norm(q.float()) * q.shape[-1] ** -0.5
    kf = kda_math.l2norm(k.float())
    longest = max((e - s for s, e in spans), default=0)
    for t in range(longest):
        rows = [i for i, (s, e) in enumerate(spans) if e - s > t]
        idx = torch.tensor([spans[i][0] + t for i in rows], device=v.device)
        sel = torch.tensor(rows, device=v.device)
        st = kda_math.kda_decode_step(states[sel], kf[idx], v[idx], g[idx], beta[idx])
        states[sel] = st
        out[idx] = kda_math.kda_read(st, qf[idx], v.dtype)
        on_step(rows, t, st)
    return out


@custom_op("k3::kda_verify", mutates_args=("win_k", "win_v", "win_g", "win_beta"))
def kda_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               ssm_pool: torch.Tensor, layer: int, slots: torch.Tensor, cu_seqlens: torch.Tensor,
               win_k: torch.Tensor, win_v: torch.Tensor, win_g: torch.Tensor, win_beta: torch.Tensor) -> torch.Tensor:
    """ReplaySSM verify: outputs from the committed state (not written); raw inputs into the window."""
    for i, (s, e) in enumerate(_spans(cu_seqlens)):
        n = e - s
        win_k[i, layer, :n] = k[s:e].to(win_k.dtype)
        win_v[i, layer, :n] = v[s:e].to(win_v.dtype)
        win_g[i, layer, :n] = g[s:e].float()
        win_beta[i, layer, :n] = beta[s:e].float()
    return _recurrent_from_committed(q, k, v, g, beta, ssm_pool, layer, slots, cu_seqlens, lambda *a: None)


@kda_verify.register_fake
def _(q, k, v, g, beta, ssm_pool, layer, slots, cu_seqlens, win_k, win_v, win_g, win_beta):
    return torch.empty_like(v)


@custom_op("k3::kda_verify_snapshot", mutates_args=("win_states",))
def kda_verify_snapshot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        ssm_pool: torch.Tensor, layer: int, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                        win_states: torch.Tensor) -> torch.Tensor:
    """Snapshot baseline: outputs from the committed state (not written); the state after every position
    into win_states[row, layer, position]."""
    def keep(rows, t, st):
        win_states[torch.tensor(rows, device=st.device), layer, t] = st

    return _recurrent_from_committed(q, k, v, g, beta, ssm_pool, layer, slots, cu_seqlens, keep)


@kda_verify_snapshot.register_fake
def _(q, k, v, g, beta, ssm_pool, layer, slots, cu_seqlens, win_states):
    return torch.empty_like(v)
