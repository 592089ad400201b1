"""P9 all-reduce + residual add + RMSNorm: a sublayer's `k3::all_reduce` feeding P7's fused residual add +
AttnRes read + RMSNorm becomes one collective op, `k3::all_reduce_attn_res_norm` (kernels/all_reduce_norm.py).

Matched, after P7 (without P7's nodes there is nothing to match):

    delta = k3.all_reduce(partial, role)            only user: the node below
    h, p  = k3.attn_res_norm(bank, x, delta, query, weight, res_eps, norm_eps, pdl)
 -> h, p  = k3.all_reduce_attn_res_norm(bank, x, partial, query, weight, res_eps, norm_eps, role, pdl)

and the same for P7's `k3.attn_res_norm_f32` (three outputs: h, p and h's fp32 copy), which becomes
`k3.all_reduce_attn_res_norm_f32`.

Counts per captured step of a rank graph (decode and prefill alike): every sublayer whose output is
one all-reduce: the L attention mixers (KDA and MLA o_proj), the dense MLP layers, and MoE layers
without a latent space (their routed + shared partial sums are reduced together). A latent MoE's
output is up(norm(all_reduce(u))) + all_reduce(shared), not one all-reduce, and is left alone; a
whole-model (single) graph has no all-reduce and gives 0.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from .graph_utils import is_call
from .kernels import all_reduce_norm as _kernel  # noqa: F401  (registers the fused op)
from .registry import PassConfig, register_pass

ALL_REDUCE = torch.ops.k3.all_reduce.default
# P7's node -> the collective op that replaces it (same outputs)
FUSED = {torch.ops.k3.attn_res_norm.default: torch.ops.k3.all_reduce_attn_res_norm.default,
         torch.ops.k3.attn_res_norm_f32.default: torch.ops.k3.all_reduce_attn_res_norm_f32.default}


@register_pass("p09_all_reduce_norm", PassConfig)
def all_reduce_norm(gm: GraphModule, config: PassConfig) -> int:
    """all-reduce + residual add + RMSNorm (P7's node) -> one k3.all_reduce_attn_res_norm collective."""
    matches = 0
    for node in [n for n in gm.graph.nodes if is_call(n, *FUSED)]:
        bank, x, delta, query, weight, res_eps, norm_eps, *pdl = node.args
        if not is_call(delta, ALL_REDUCE) or len(delta.users) != 1 or node.kwargs:
            continue
        partial, role = delta.args
        node.target = FUSED[node.target]  # same outputs and fake values: the getitem users stay as they are
        node.args = (bank, x, partial, query, weight, res_eps, norm_eps, role, *pdl)
        gm.graph.erase_node(delta)
        matches += 1
    return matches
