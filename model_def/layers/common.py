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
    """The tensors of one step that layers read (unpacked from ForwardBatch + CacheTensors).

    mode "train" is the differentiable forward for training: whole sequences cut by `cu_seqlens`, each
    from an empty state, no pools (the other fields are None) and only autograd-friendly torch math."""
    mode: str  # "prefill" | "decode" | "verify" | "verify_snapshot" | "train"
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None
    out_cache_loc: torch.Tensor | None = None
    ssm: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    kv: torch.Tensor | None = None
    window: tuple = ()  # verify modes: the draft window's tensors (draft_window.DraftWindow.tensors())

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of each sequence along the packed token axis."""
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))


def per_sequence(fn, spans: list[tuple[int, int]], *xs: torch.Tensor) -> torch.Tensor:
    """Apply a per-sequence fn (token axis first, independent along axis 1: channels or heads) to
    packed inputs. Equal-length sequences are stacked along axis 1 so fn runs once for the batch."""
    lengths = {e - s for s, e in spans}
    if len(lengths) == 1:
        n, t = len(spans), lengths.pop()
        folded = [x.unflatten(0, (n, t)).transpose(0, 1).flatten(1, 2) for x in xs]  # [T, n*C, ...]
        out = fn(*folded)
        return out.unflatten(1, (n, -1)).transpose(0, 1).flatten(0, 1)
    return torch.cat([fn(*(x[s:e] for x in xs)) for s, e in spans])
