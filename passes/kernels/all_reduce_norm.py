"""`k3::all_reduce_attn_res_norm` (+ `_f32`): all-reduce of a sublayer's partial output, residual add, AttnRes
read and RMSNorm as one collective op (P9). On CPU, and wherever no fused kernel is available, each is
the composite: the k3::all_reduce (torch.distributed), then k3::attn_res_norm (or its _f32 variant, which
also returns h's fp32 copy). One node in the graph keeps the collective and the norm that waits on it
together, which is what a fused one-shot all-reduce kernel (TensorRT-LLM's RESIDUAL_RMS_NORM, FlashInfer's
allreduce_fusion) needs in order to replace them.
"""
from __future__ import annotations

import torch

from k3compile.model_def.parallel import comm  # noqa: F401  (registers torch.ops.k3.all_reduce)

from . import attn_res_norm as _arn  # registers torch.ops.k3.attn_res_norm(_f32)


@torch.library.custom_op("k3::all_reduce_attn_res_norm", mutates_args=())
def all_reduce_attn_res_norm(bank: list[torch.Tensor], x: torch.Tensor, partial: torch.Tensor,
                             query: torch.Tensor | None, norm_weight: torch.Tensor, res_eps: float, norm_eps: float,
                             role: str, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, p): p = x + Σ_ranks partial; h = RMSNorm(AttnRes read of bank + [p]) (just RMSNorm(p) without a bank)."""
    delta = torch.ops.k3.all_reduce(partial, role)
    return torch.ops.k3.attn_res_norm(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl)


@all_reduce_attn_res_norm.register_fake
def _(bank, x, partial, query, norm_weight, res_eps, norm_eps, role, pdl=False):
    return _arn._attn_res_norm_fake(bank, x, partial, query, norm_weight, res_eps, norm_eps)


@torch.library.custom_op("k3::all_reduce_attn_res_norm_f32", mutates_args=())
def all_reduce_attn_res_norm_f32(bank: list[torch.Tensor], x: torch.Tensor, partial: torch.Tensor,
                                 query: torch.Tensor | None, norm_weight: torch.Tensor, res_eps: float,
                                 norm_eps: float, role: str,
                                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """all_reduce_attn_res_norm plus h's fp32 copy (P7's attn_res_norm_f32 after the all-reduce)."""
    delta = torch.ops.k3.all_reduce(partial, role)
    return torch.ops.k3.attn_res_norm_f32(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl)


@all_reduce_attn_res_norm_f32.register_fake
def _(bank, x, partial, query, norm_weight, res_eps, norm_eps, role, pdl=False):
    return _arn._attn_res_norm_f32_fake(bank, x, partial, query, norm_weight, res_eps, norm_eps)
