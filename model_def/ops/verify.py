"""The `k3::` ops of the verify step (speculative decoding, ReplaySSM; spec §5.3).

A verify step runs the same number n of tokens for every request (gamma + 1, or fewer when the
planner trims every request; the executor pads shorter ones), the anchor and the drafts, (the anchor and the drafts) against the committed
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


def _per_request(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B*n, ...] -> [B, n, ...]: a verify step has the same number of tokens for every request (the
    executor pads), so nothing is read back from the device (the op can sit in a CUDA graph)."""
    b = slots.shape[0]
    return x.view(b, x.shape[0] // b, *x.shape[1:])


def conv_from_window(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, layer: int,
                     channel_offset: int, slots: torch.Tensor) -> torch.Tensor:
    """x [B*n, C] -> SiLU(causal conv) [B*n, C] continuing each request's committed window (only read)."""
    c = x.shape[1]
    xs = _per_request(x, slots)  # [B, n, C]
    win = conv_pool[slots, layer, channel_offset: channel_offset + c]  # [B, C, W-1]
    full = torch.cat([win.to(x.dtype).transpose(1, 2), xs], 1)  # [B, W-1+n, C]
    width = weight.shape[-1]
    frames = full.float().unfold(1, width, 1)  # [B, n, C, W]
    return torch.nn.functional.silu((frames * weight.float()).sum(-1)).to(x.dtype).flatten(0, 1)


@custom_op("k3::short_conv_verify", mutates_args=("win_x",))
def short_conv_verify(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, layer: int,
                      channel_offset: int, slots: torch.Tensor, win_x: torch.Tensor) -> torch.Tensor:
    """x [B*n, C] -> SiLU(causal conv) [B*n, C] from each request's committed window (not written);
    stores x at win_x[row, layer, position, channel_offset:+C]."""
    xs = _per_request(x, slots)  # [B, n, C]
    b, n, c = xs.shape
    win_x[:b, layer, :n, channel_offset: channel_offset + c] = xs.to(win_x.dtype)
    return conv_from_window(x, weight, conv_pool, layer, channel_offset, slots)


@short_conv_verify.register_fake
def _(x, weight, conv_pool, layer, channel_offset, slots, win_x):
    return torch.empty_like(x)


def _recurrent_from_committed(q, k, v, g, beta, ssm_pool, layer, slots, on_step):
    """Run the decode step position by position for all B requests at once, from a scratch copy of each
    committed state. `on_step(t, states)` sees the states after position t. Returns o [B*n, H, V]."""
    q, k, v, g, beta = (_per_request(t, slots) for t in (q, k, v, g, beta))
    states = ssm_pool[slots, layer].clone()  # [B, H, K, V]: the pool itself is only read
    qf = kda_math.l2norm(q.float()) * q.shape[-1] ** -0.5
    kf = kda_math.l2norm(k.float())
    outs = []
    for t in range(q.shape[1]):
        states = kda_math.kda_decode_step(states, kf[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(kda_math.kda_read(states, qf[:, t], v.dtype))
        on_step(t, states)
    return torch.stack(outs, 1).flatten(0, 1)


def store_window_inputs(k, v, g, beta, layer: int, slots, win_k, win_v, win_g, win_beta) -> None:
    """The ReplaySSM window's rows of one layer: k [B*n, H, K] (after the conv), v, g (after the gate
    activation), beta [B*n, H] (after the sigmoid) at win_*[row, layer, position]."""
    b = slots.shape[0]
    n = k.shape[0] // b
    win_k[:b, layer, :n] = _per_request(k, slots).to(win_k.dtype)
    win_v[:b, layer, :n] = _per_request(v, slots).to(win_v.dtype)
    win_g[:b, layer, :n] = _per_request(g, slots).float()
    win_beta[:b, layer, :n] = _per_request(beta, slots).float()


@custom_op("k3::kda_verify", mutates_args=("win_k", "win_v", "win_g", "win_beta"))
def kda_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               ssm_pool: torch.Tensor, layer: int, slots: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
               win_g: torch.Tensor, win_beta: torch.Tensor) -> torch.Tensor:
    """ReplaySSM verify: outputs from the committed state (not written); raw inputs into the window."""
    store_window_inputs(k, v, g, beta, layer, slots, win_k, win_v, win_g, win_beta)
    return _recurrent_from_committed(q, k, v, g, beta, ssm_pool, layer, slots, lambda t, st: None)


@kda_verify.register_fake
def _(q, k, v, g, beta, ssm_pool, layer, slots, win_k, win_v, win_g, win_beta):
    return torch.empty_like(v)


@custom_op("k3::kda_verify_snapshot", mutates_args=("win_states",))
def kda_verify_snapshot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        ssm_pool: torch.Tensor, layer: int, slots: torch.Tensor,
                        win_states: torch.Tensor) -> torch.Tensor:
    """Snapshot baseline: outputs from the committed state (not written); the state after every position
    into win_states[row, layer, position]."""
    b = slots.shape[0]

    def keep(t, st):
        win_states[:b, layer, t] = st

    return _recurrent_from_committed(q, k, v, g, beta, ssm_pool, layer, slots, keep)


@kda_verify_snapshot.register_fake
def _(q, k, v, g, beta, ssm_pool, layer, slots, win_states):
    return torch.empty_like(v)
