"""P13 latent up-projection: the replicated GEMM becomes a column-parallel GEMM completed by a collective.

In a rank graph of a latent MoE (K3), every rank holds the whole latent up-projection W_up [D, L] and
computes y = RMSNorm(all_reduce(u)) @ W_up^T in full. After P13 rank r keeps only its rows block
W_up[r*D/W:(r+1)*D/W] (an engine stores 1/W of the weight), computes its columns of y, and the ranks
complete y with a collective:

    y = addmm(all_reduce(s), norm_u, t(W_up))      s: the shared experts' partial sum (P11 folds the add)
 -> y = all_reduce(s + pad(mm(norm_u, t(W_up_block))))   no new collective: the padded column blocks
                                                        ride in the shared experts' all-reduce
    y = mm(norm_u, t(W_up))  [+ bias]                without such an all-reduce (no shared experts, no P11)
 -> y = all_gather(mm(norm_u, t(W_up_block)), columns) [+ bias]

Matched structurally: an mm/addmm whose activation is the RMSNorm of a k3.all_reduce or of P12's
k3.moe_finalize_all_reduce (the latent sum;
a residual-stream norm reads add(residual, ...) instead). Counts: one per MoE layer with a latent
space in a rank graph of world > 1 (k3-tiny: 8); whole-model graphs and Kimi-Linear-style MoE: 0.
The rank comes from the graph (capture records it in gm.meta["k3"]["shard"]).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from k3compile.model_def.parallel import comm  # noqa: F401  (registers k3.all_reduce / all_gather)

from .graph_utils import add_constant, attr_tensor, drop_unused_constants, fake_mode_of, is_call, replace_uses, \
    set_meta_val
from .kernels import moe_finalize  # noqa: F401  (registers P12's k3.moe_finalize_all_reduce)
from .patterns import NoMatch, match_rms_norm
from .registry import PassConfig, register_pass

aten = torch.ops.aten
ALL_REDUCE = torch.ops.k3.all_reduce.default
ALL_GATHER = torch.ops.k3.all_gather.default
# the all-reduced latent sum: a plain all-reduce, or P12's finalize + all-reduce
REDUCED_LATENT = (ALL_REDUCE, torch.ops.k3.moe_finalize_all_reduce.default)


def _match(node: Node):
    """(mat1, weight get_attr, bias or None) of a GEMM by the whole up-projection of an all-reduced latent."""
    if is_call(node, aten.addmm.default) and len(node.args) == 3 and not node.kwargs:
        bias, mat1, mat2 = node.args
    elif is_call(node, aten.mm.default) and not node.kwargs:
        bias, (mat1, mat2) = None, node.args
    else:
        raise NoMatch
    if not (is_call(mat2, aten.t.default) and mat2.args[0].op == "get_attr" and len(mat2.users) == 1):
        raise NoMatch
    x, _, _, _ = match_rms_norm(mat1)
    if not is_call(x, *REDUCED_LATENT):
        raise NoMatch
    return mat1, mat2.args[0], bias


@register_pass("p13_latent_up_column", PassConfig)
def latent_up_column(gm: GraphModule, config: PassConfig) -> int:
    """latent up-projection: replicated GEMM -> column-parallel GEMM + collective (rank graphs only)."""
    shard = gm.meta.get("k3", {}).get("shard")
    if not shard or shard["world"] < 2:
        return 0
    rank, world = shard["rank"], shard["world"]
    g, fake_mode, matches, dead = gm.graph, None, 0, []
    for node in [n for n in g.nodes if is_call(n, aten.mm.default, aten.addmm.default)]:
        try:
            mat1, w_node, bias = _match(node)
        except NoMatch:
            continue
        w = attr_tensor(gm, w_node)
        d = w.shape[0]
        if d % world:
            continue
        n = d // world
        fake_mode = fake_mode or fake_mode_of(gm)
        block = add_constant(gm, f"{w_node.target}_cols{rank}of{world}", w[rank * n:(rank + 1) * n].contiguous(),
                             node, fake_mode)
        fold = bias is not None and is_call(bias, ALL_REDUCE) and len(bias.users) == 1
        with g.inserting_before(node):
            new = [g.call_function(aten.t.default, (block,))]
            new.append(g.call_function(aten.mm.default, (mat1, new[0])))
            if fold:  # y's column block, zero elsewhere, summed into the shared experts' all-reduce
                partial, role = bias.args
                new.append(g.call_function(aten.constant_pad_nd.default, (new[-1], [rank * n, d - (rank + 1) * n], 0.0)))
                new.append(g.call_function(aten.add.Tensor, (partial, new[-1])))
                new.append(g.call_function(ALL_REDUCE, (new[-1], role)))
            else:
                new.append(g.call_function(ALL_GATHER, (new[-1], "world", world, -1)))
                if bias is not None:
                    new.append(g.call_function(aten.add.Tensor, (bias, new[-1])))
        for x in new:
            set_meta_val(x, fake_mode)
        old_t = node.args[-1]
        replace_uses(node, new[-1], fake_mode)
        g.erase_node(node)
        g.erase_node(old_t)
        if fold:
            g.erase_node(bias)
        if not w_node.users:
            dead.append(w_node.target)
            g.erase_node(w_node)
        matches += 1
    drop_unused_constants(gm, dead)
    return matches
