"""Kimi Delta Attention mixer (spec §1): projections, short convs, gates, recurrence, gated norm.

Parameter names are the checkpoint's. Kimi Linear: softplus decay, low-rank output gate
(g_a_proj/g_b_proj). K3: lower-bounded decay, full-rank output gate (g_proj).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import library as k3ops  # noqa: F401  (registers torch.ops.k3.*)
from ..ops import kda_math
from ..ops.kda_math import kda_gate
from ..ops.eager_dispatch import k3
from ..parallel import comm  # noqa: F401  (registers torch.ops.k3.all_reduce)
from .common import GatedRMSNorm, StepInputs, linear, per_sequence


class KDAMixer(nn.Module):
    def __init__(self, cfg, pool_index: int, shard=None):
        super().__init__()
        d, h, hd = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        if shard is not None:  # tensor parallel by head: this rank's block of heads; o_proj row-parallel
            h = len(shard.block(h))
        self.shard = shard
        self.num_heads, self.head_dim, self.pool_index = h, hd, pool_index
        self.lower_bound = cfg.gate_lower_bound
        inner = h * hd
        self.q_proj, self.k_proj, self.v_proj = linear(d, inner), linear(d, inner), linear(d, inner)
        # depthwise causal convs; only their weights are used (by the k3 short-conv ops)
        conv = lambda: nn.Conv1d(inner, inner, cfg.conv_kernel_size, groups=inner, bias=False)  # noqa: E731
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(), conv(), conv()
        self.f_a_proj, self.f_b_proj = linear(d, hd), linear(hd, inner)
        self.dt_bias = nn.Parameter(torch.empty(inner))
        self.A_log = nn.Parameter(torch.empty(h))
        self.b_proj = linear(d, h)
        if cfg.kda_full_rank_gate:
            self.g_proj = linear(d, inner)
        else:
            self.g_a_proj, self.g_b_proj = linear(d, hd), linear(hd, inner)
        self.o_norm = GatedRMSNorm(hd, cfg.rms_norm_eps)
        self.o_proj = linear(inner, d)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))

    def _conv(self, x, conv: nn.Conv1d, stream: int, s: StepInputs):
        off = stream * self.num_heads * self.head_dim
        w = conv.weight.squeeze(1)
        if s.mode == "train":
            return per_sequence(lambda xs: _fresh_short_conv(xs, w), s.spans(), x)
        if s.mode == "decode":
            return k3.short_conv_decode(x, w, s.conv, self.pool_index, off, s.state_slots)
        if s.window:  # verify: conv from the committed window, inputs kept for the rollback
            return k3.short_conv_verify(x, w, s.conv, self.pool_index, off, s.state_slots, s.window[0])
        return k3.short_conv_prefill(x, w, s.conv, self.pool_index, off, s.state_slots, s.cu_seqlens, s.seq_lens)

    def forward(self, x: torch.Tensor, s: StepInputs) -> torch.Tensor:
        heads = (self.num_heads, self.head_dim)
        q = self._conv(self.q_proj(x), self.q_conv1d, 0, s).unflatten(-1, heads)
        k = self._conv(self.k_proj(x), self.k_conv1d, 1, s).unflatten(-1, heads)
        v = self._conv(self.v_proj(x), self.v_conv1d, 2, s).unflatten(-1, heads)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)), self.A_log, self.dt_bias, self.head_dim, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        if s.mode == "train":
            o = per_sequence(_fresh_kda, s.spans(), q, k, v, g, beta).to(v.dtype)
        elif s.mode == "decode":
            o = k3.kda_decode(q, k, v, g, beta, s.ssm, self.pool_index, s.state_slots)
        elif s.mode == "verify":  # ReplaySSM: the state is read, the raw inputs are kept
            o = k3.kda_verify(q, k, v, g, beta, s.ssm, self.pool_index, s.state_slots, *s.window[1:5])
        elif s.mode == "verify_snapshot":
            o = k3.kda_verify_snapshot(q, k, v, g, beta, s.ssm, self.pool_index, s.state_slots, s.window[1])
        else:
            o = k3.kda_prefill(q, k, v, g, beta, s.ssm, self.pool_index, s.state_slots, s.cu_seqlens, s.seq_lens)
        o = self.o_norm(o, self.output_gate(x).unflatten(-1, heads))
        y = self.o_proj(o.flatten(-2))
        return y if self.shard is None else k3.all_reduce(y, "world")

    @torch.no_grad()
    def init_special(self, gen: torch.Generator) -> None:
        """fla / transformers init for the gate parameters (spec §1.2)."""
        if self.lower_bound is None:
            self.A_log.copy_(torch.empty(self.A_log.shape).uniform_(1, 16, generator=gen).log())
        else:
            self.A_log.zero_()
        dt = torch.empty(self.dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        dt = dt.clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


# chunk length of the training forward: the chunked form's intra-chunk tensors grow with C^2 * K, and
# at training shapes (many short sequences stacked along heads) small chunks are fastest on CPU
TRAIN_CHUNK = 16


def _fresh_short_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Short conv of one sequence (or of sequences stacked along channels) from a zero window."""
    w = weight.repeat(x.shape[1] // weight.shape[0], 1)
    return kda_math.short_conv(x, w, x.new_zeros(w.shape[0], w.shape[1] - 1))[0]


def _fresh_kda(q, k, v, g, beta) -> torch.Tensor:
    """Chunked KDA of one sequence (or sequences stacked along heads) from a zero state (fp32 out)."""
    h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    zero = torch.zeros(h, dk, dv, dtype=torch.float32, device=q.device)
    return kda_math.kda_chunked(q, k, v, g, beta, zero, TRAIN_CHUNK)[0]
