"""P9 all-reduce + residual add + RMSNorm: a sublayer's `k3::all_reduce` feeding P7's fused residual add +
AttnRes read + RMSNorm becomes one collective op, `k3::all_reduce_attn_res_norm` (kernels/all_reduce_norm.py).

Matched, after P7 (without P7's nodes there is nothing to match), in two shapes:

    delta = k3.all_reduce(partial, role)            only user: the node below
    h, p  = k3.attn_res_norm(bank, x, delta, query, weight, res_eps, norm_eps, pdl)
 -> h, p  = k3.all_reduce_attn_res_norm(bank, x, partial, query, weight, res_eps, norm_eps, role, pdl)

and, at a K3 AttnRes block boundary, where P7 folded the zero-filled partial sum (p = 0 + d: delta None,
the all-reduced sublayer output is P7's x):

    s     = k3.all_reduce(partial, role)            only user: the node below
    h, p  = k3.attn_res_norm(bank, s, None, query, weight, res_eps, norm_eps, pdl)
 -> h, p  = k3.all_reduce_attn_res_norm(bank, None, partial, query, weight, res_eps, norm_eps, role, pdl)

and the same for P7's `k3.attn_res_norm_f32` (three outputs: h, p and h's fp32 copy), which becomes
`k3.all_reduce_attn_res_norm_f32`. The collective reduces `partial` in place (no staging copy), so it must
be a fresh result read by nothing but the all-reduce: a GEMM's or op's output, not a view, a graph input
or a weight.

Counts per captured step of a rank graph (decode and prefill alike): every sublayer whose output is
one all-reduce: the L attention mixers (KDA and MLA o_proj), the dense MLP layers, and MoE layers
without a latent space (their routed + shared partial sums are reduced together). A latent MoE's
output is up(norm(all_reduce(u))) + all_reduce(shared), not one all-reduce, and is left alone; a
whole-model (single) graph has no all-reduce and gives 0.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from torch.fx import Node

from .graph_utils import is_call, is_contiguous
from .kernels import all_reduce_norm as _kernel  # noqa: F401  (registers the fused op)
from .registry import PassConfig, register_pass

ALL_REDUCE = torch.ops.k3.all_reduce.default
# P7's node -> the collective op that replaces it (same outputs)
FUSED = {torch.ops.k3.attn_res_norm.default: torch.ops.k3.all_reduce_attn_res_norm.default,
         torch.ops.k3.attn_res_norm_f32.default: torch.ops.k3.all_reduce_attn_res_norm_f32.default}


def _owned_partial(reduce: Node) -> Node | None:
    """The all-reduce's input when the collective may overwrite it: a fresh, contiguous op result whose only
    reader is this all-reduce."""
    partial = reduce.args[0]
    if not isinstance(partial, Node) or partial.op != "call_function" or set(partial.users) != {reduce}:
        return None
    t = partial.target
    if isinstance(t, torch._ops.OpOverload) and (t.is_view or t._schema.is_mutable):
        return None
    val = partial.meta.get("val")
    if not isinstance(val, torch.Tensor) or not is_contiguous(val):
        return None
    return partial


@register_pass("p09_all_reduce_norm", PassConfig)
def all_reduce_norm(gm: GraphModule, config: PassConfig) -> int:
    """all-reduce + residual add + RMSNorm (P7's node) -> one k3.all_reduce_attn_res_norm collective."""
    matches = 0
    for node in [n for n in gm.graph.nodes if is_call(n, *FUSED)]:
        if node.kwargs:
            continue
        bank, x, delta, query, weight, res_eps, norm_eps, *pdl = node.args
        if delta is None:  # block boundary: p is the all-reduced sum itself
            reduce, x = x, None
        else:
            reduce = delta
        if not is_call(reduce, ALL_REDUCE) or len(reduce.users) != 1:
            continue
        partial = _owned_partial(reduce)
        if partial is None:
            continue
        role = reduce.args[1]
        node.target = FUSED[node.target]  # same outputs and fake values: the getitem users stay as they are
        node.args = (bank, x, partial, query, weight, res_eps, norm_eps, role, *pdl)
        gm.graph.erase_node(reduce)
        matches += 1
    return matches
