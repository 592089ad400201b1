"""Small shared pieces: RMSNorm, gated RMSNorm, the per-step view of batch + pools that layers read."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalizes in fp32, casts back, then scales (the Hugging Face kimi_linear order)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm(o) * w * sigmoid(gate), all in fp32 (fla's FusedRMSNormGated, activation sigmoid)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (xf * torch.sigmoid(gate.float())).to(x.dtype)


def linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


@dataclass
class StepInputs:
    """The tensors of one step that layers read (unpacked from ForwardBatch + CacheTensors)."""
    mode: str  # "prefill" | "decode" | "verify" | "verify_snapshot"
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    state_slots: torch.Tensor
    out_cache_loc: torch.Tensor
    ssm: torch.Tensor
    conv: torch.Tensor
    kv: torch.Tensor
    window: tuple = ()  # verify modes: the draft window's tensors (draft_window.DraftWindow.tensors())
