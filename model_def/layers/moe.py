"""Feed-forward blocks: the dense GLU MLP (layer 0), and the MoE with optional latent space (spec §2.4, §4).

Kimi Linear: full-width experts, one shared expert, scaling 2.446.
K3 Stable LatentMoE: route on full-width x; experts run on z = down(x) (latent); u = Σ w_e E_e(z);
y = up(RMSNorm(u)) + shared(x). Expert weights are stored stacked ([E, 2I, D] gate|up and
[E, D, I] down); checkpoint I/O maps them to the per-expert `experts.{i}.w1/w3/w2` names.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops import library as k3ops  # noqa: F401
from ..ops.moe_math import glu_act, route
from ..ops.eager_dispatch import k3
from ..parallel import comm  # noqa: F401  (registers torch.ops.k3.all_reduce)
from .common import RMSNorm, linear


class GLUMLP(nn.Module):
    """With a shard: gate/up column-parallel, down row-parallel; the output is this rank's partial sum."""

    def __init__(self, d: int, inter: int, cfg, shard=None):
        super().__init__()
        if shard is not None:
            inter = len(shard.block(inter))
        self.gate_proj, self.up_proj, self.down_proj = linear(d, inter), linear(d, inter), linear(inter, d)
        self.act, self.beta, self.linear_beta = cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_act(self.gate_proj(x), self.up_proj(x), self.act, self.beta, self.linear_beta))


class Router(nn.Module):
    def __init__(self, d: int, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        self.top_k, self.renorm, self.scaling = cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor
        self.groups, self.topk_group = cfg.num_expert_group, cfg.topk_group

    def forward(self, x: torch.Tensor):
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        return route(logits, self.e_score_correction_bias, self.top_k, self.renorm, self.scaling, self.groups,
                     self.topk_group)


class Experts(nn.Module):
    """Stacked routed experts: w13 [E, 2I, W] (rows [0, I) w1 = gate, [I, 2I) w3 = up), w2 [E, W, I].

    With cfg.expert_quant == "mxfp4" they are kept as the checkpoint ships them (ops/mxfp4.py): uint8
    codes `w13_packed` [E, 2I, W/2] / `w2_packed` [E, W, I/2] and E8M0 scales `w13_scale` [E, 2I, W/32] /
    `w2_scale` [E, W, I/32]; the reference dequantizes them on the fly."""

    def __init__(self, width: int, cfg, shard=None):
        super().__init__()
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        if shard is not None:  # EP: a block of whole experts; TP: every expert's intermediate slice
            e = len(shard.expert_block(e))
            i = i if shard.expert_mode == "ep" else len(shard.block(i))
        self.mxfp4 = cfg.expert_quant == "mxfp4"
        if self.mxfp4:
            def u8(*shape):
                return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)
            self.w13_packed, self.w13_scale = u8(e, 2 * i, width // 2), u8(e, 2 * i, width // 32)
            self.w2_packed, self.w2_scale = u8(e, width, i // 2), u8(e, width, i // 32)
        else:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, width))
            self.w2 = nn.Parameter(torch.empty(e, width, i))
        self.act, self.beta, self.linear_beta = cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, z, topk_weights, topk_ids):
        if self.mxfp4:
            return k3.moe_experts_mxfp4(z, topk_ids, topk_weights, self.w13_packed, self.w13_scale,
                                        self.w2_packed, self.w2_scale, self.act, self.beta,
                                        self.linear_beta)
        return k3.moe_experts(z, topk_ids, topk_weights, self.w13, self.w2, self.act, self.beta, self.linear_beta)


class MoE(nn.Module):
    """With a shard: the router, latent down/up projections and latent norm are replicated; routed
    experts (EP or TP) and shared experts give partial sums that are all-reduced: the latent sum u
    before its norm, the full-width output after (one all-reduce when there is no latent space)."""

    def __init__(self, cfg, shard=None):
        super().__init__()
        d = cfg.hidden_size
        width = cfg.latent_size or d
        self.shard = shard
        self.expert_range = None
        if shard is not None and shard.expert_mode == "ep":
            blk = shard.expert_block(cfg.num_experts)
            self.expert_range = (blk.start, len(blk))
        self.gate = Router(d, cfg)
        self.experts = Experts(width, cfg, shard)
        if cfg.num_shared_experts:
            self.shared_experts = GLUMLP(d, cfg.moe_intermediate_size * cfg.num_shared_experts, cfg, shard)
        if cfg.latent_size is not None:
            self.routed_expert_down_proj = linear(d, width)
            self.routed_expert_up_proj = linear(width, d)
            if cfg.latent_norm:
                self.routed_expert_norm = RMSNorm(width, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.expert_range is not None:  # EP: choices of other ranks' experts weigh nothing here
            lo, n = self.expert_range
            mine = (ids >= lo) & (ids < lo + n)
            weights = weights * mine
            ids = torch.where(mine, ids - lo, torch.zeros_like(ids))
        latent = hasattr(self, "routed_expert_down_proj")
        u = self.experts(self.routed_expert_down_proj(x) if latent else x, weights, ids)
        if self.shard is None:
            if hasattr(self, "routed_expert_norm"):
                u = self.routed_expert_norm(u)
            y = self.routed_expert_up_proj(u) if latent else u
            if hasattr(self, "shared_experts"):
                y = y + self.shared_experts(x)
            return y
        if not latent:
            y = u + self.shared_experts(x) if hasattr(self, "shared_experts") else u
            return k3.all_reduce(y, "world")
        u = k3.all_reduce(u, "world")
        if hasattr(self, "routed_expert_norm"):
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u)
        if hasattr(self, "shared_experts"):
            y = y + k3.all_reduce(self.shared_experts(x), "world")
        return y
