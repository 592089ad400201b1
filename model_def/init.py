"""Deterministic random initialization for presets (same seed, same device type -> same weights)."""
from __future__ import annotations

import torch
from torch import nn

from .layers.kda import KDAMixer
from .ops import mxfp4


@torch.no_grad()
def init_random(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Linear / expert weights ~ N(0, std) (MXFP4 experts: that, quantized); norms ~ 1 + N(0, 0.1); AttnRes pseudo-queries ~ N(0, D^-1/2)
    (non-zero so random models exercise the softmax); router bias ~ N(0, 0.05); KDA gate parameters as
    fla initializes them. Parameters are visited in name order with one generator on their device."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in sorted(params.items()):
        if name.endswith("_res_proj.weight"):
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        elif "norm" in name:
            p.normal_(1.0, 0.1, generator=gen)
        elif p.dtype == torch.uint8:  # MXFP4 experts: N(0, std) weights, quantized (codes fill *_scale too)
            if name.endswith("_packed"):
                dense = torch.empty(*p.shape[:-1], 2 * p.shape[-1], device=device).normal_(0.0, std, generator=gen)
                packed, scale = mxfp4.quantize(dense)
                p.copy_(packed)
                params[name[: -len("_packed")] + "_scale"].copy_(scale)
        elif "conv1d" in name:
            bound = p.shape[-1] ** -0.5
            p.uniform_(-bound, bound, generator=gen)
        else:
            p.normal_(0.0, std, generator=gen)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.05, generator=gen)
    cpu_gen = torch.Generator().manual_seed(seed + 1)
    for m in model.modules():
        if isinstance(m, KDAMixer):
            m.init_special(cpu_gen)
