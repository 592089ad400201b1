"""P4 fused routing: the router's chain of small ops becomes one `k3::fused_route` node.

Matched (the ATen form of `model_def.ops.moe_math.route`), anchored on the final top-k:

    scores  = sigmoid(L)                    L: the router logits, fp32 (or _to_copy(L', fp32): absorbed)
    choice  = scores + bias                 bias: [E], usually the get_attr e_score_correction_bias
    [group limit: view(choice, [T, G, E/G]) -> topk(.., 2)[0] -> sum -> topk(.., topk_group)[1]
       -> zeros_like.scatter_ -> bool -> repeat over E/G -> ~ -> masked_fill(choice, .., -inf)]
    ids     = topk(choice, top_k)[1]
    weights = gather(scores, 1, ids)
    [renorm: weights / (weights.sum(-1, keepdim=True) + 1e-20)]
    [weights * scaling]

and replaced by `weights, ids = k3.fused_route(L, bias, top_k, renormalize, scaling, G, topk_group)`
(top_k from the topk node, G from the group view's shape, topk_group from the group top-k, the
flags and scaling from which tail ops are present and their constants). Users of `ids` (the expert
op) and of the final weights are rewired; the matched nodes are erased. A chain whose
intermediates are read elsewhere, whose sigmoid is not computed in fp32, or that deviates from the
form above in any way (other dims, other eps, other constants) is left alone.

Router GEMM absorbed (config `absorb_router_max_tokens` > 0, default 16): when L is the router's own
fp32 GEMM `mm(x, t(W))` read by nothing else (a bf16 model: x = _to_copy(h, fp32), which P7's norm
kernel later writes as a second output, and W the fp32 weight P3 folded; an fp32 model's router GEMM
is P1's merged MoE-front GEMM and stays), the node becomes
`k3.fused_route(x, bias, ..., W, absorb_max_tokens)` and the mm and t go: at batch <=
absorb_max_tokens one kernel computes the logits (fp32, as the graph's casts did) and routes; above
it the op runs the same cuBLAS GEMM and the routing kernel (the graph's batch is symbolic, so the
choice is the op's, per call; each captured CUDA graph holds one). On CPU the op is the exact
composition mm + route_reference, so an engine with P4 computes what one without it does.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import (erase_if_dead, erase_subgraph, fake_mode_of, is_call, known_equal, replace_uses, set_meta_val,
                          val_of)
from .kernels import routing  # noqa: F401  (registers torch.ops.k3.fused_route)
from .registry import PassConfig, PassConfigError, register_pass

aten = torch.ops.aten
_RENORM_EPS = routing.RENORM_EPS


@dataclass
class FusedRoutingConfig(PassConfig):
    # Absorb the router's fp32 GEMM into the node (its `router_weight` form) and compute the logits in the
    # routing kernel for batches up to this many tokens; above it the node runs cuBLAS + the routing kernel.
    # The FX graph has a symbolic batch, so the op decides per call (fixed per captured CUDA graph).
    # 0 = never absorb: the router GEMM stays in the graph as it is.
    absorb_router_max_tokens: int = 16

    def validate(self) -> None:
        if self.absorb_router_max_tokens < 0:
            raise PassConfigError(f"p04_fused_routing: absorb_router_max_tokens must be >= 0, "
                                  f"got {self.absorb_router_max_tokens}")


class _NoMatch(Exception):
    pass


def _need(cond: bool) -> None:
    if not cond:
        raise _NoMatch


def _topk_k(node: Node, dim_ok=(-1, 1)) -> int:
    """k of a `topk(x, k)` that selects the largest along the last dim, sorted."""
    _need(is_call(node, aten.topk.default))
    args = list(node.args) + [None] * (5 - len(node.args))
    kw = node.kwargs
    k = args[1]
    dim = kw.get("dim", args[2] if args[2] is not None else -1)
    largest = kw.get("largest", args[3] if args[3] is not None else True)
    _need(isinstance(k, int) and largest is True)
    _need(dim == -1 or dim == val_of(node.args[0]).dim() - 1)
    return k


def _getitem(node: Node, index: int) -> Node:
    """The single `operator.getitem(node, index)` user; other outputs must be unused."""
    hits = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
    others = [u for u in node.users if not (u.target is operator.getitem)]
    _need(len(hits) == 1 and not others)
    for u in node.users:
        if u.args[1] != index:
            _need(not u.users)
    return hits[0]


def _owned(node: Node, allowed: set) -> None:
    """Every user of `node` must be inside the pattern."""
    _need(all(u in allowed for u in node.users))


def _match_groups(masked: Node, choice: Node, nodes: set) -> tuple[int, int]:
    """Walk the group-limit chain back from `masked_fill(choice, ~mask, -inf)`; returns (G, topk_group)."""
    _need(is_call(masked, aten.masked_fill.Scalar) and masked.args[0] is choice and masked.args[2] == float("-inf"))
    inv = masked.args[1]
    _need(is_call(inv, aten.bitwise_not.default))
    flat = inv.args[0]
    _need(is_call(flat, aten.view.default, aten._unsafe_view.default))
    chain = [masked, inv, flat]
    node = flat.args[0]
    while is_call(node, aten.clone.default, aten.expand.default, aten.unsqueeze.default):
        chain.append(node)
        node = node.args[0]
    as_bool = node
    _need(is_call(as_bool, aten._to_copy.default) and as_bool.kwargs.get("dtype") == torch.bool)
    keep = as_bool.args[0]
    _need(is_call(keep, aten.scatter_.value) and keep.args[1] in (1, -1) and keep.args[3] == 1.0)
    zeros, picked = keep.args[0], keep.args[2]
    _need(is_call(zeros, aten.zeros_like.default) and picked.target is operator.getitem and picked.args[1] == 1)
    group_topk = picked.args[0]
    topk_group = _topk_k(group_topk)
    group_scores = group_topk.args[0]
    _need(zeros.args[0] is group_scores)
    _need(is_call(group_scores, aten.sum.dim_IntList) and list(group_scores.args[1]) in ([-1], [2])
          and not (len(group_scores.args) > 2 and group_scores.args[2]))
    top2 = group_scores.args[0]
    _need(top2.target is operator.getitem and top2.args[1] == 0)
    pair_topk = top2.args[0]
    _need(_topk_k(pair_topk) == 2)
    grouped = pair_topk.args[0]
    _need(is_call(grouped, aten.view.default) and grouped.args[0] is choice)
    g_val, c_val = val_of(grouped), val_of(choice)
    _need(g_val is not None and g_val.dim() == 3 and isinstance(g_val.shape[1], int))
    num_groups = g_val.shape[1]
    _need(known_equal(num_groups * g_val.shape[2], c_val.shape[1]))
    chain += [as_bool, keep, zeros, picked, group_topk, group_scores, top2, pair_topk, grouped]
    # the unused top-k values / indices of the two group top-ks belong to the pattern too
    for tk in (group_topk, pair_topk):
        chain += [u for u in tk.users if u not in chain]
    nodes.update(chain)
    return num_groups, topk_group


def _match(topk: Node):
    """Match the routing chain ending in `topk`; returns (nodes, logits, bias, args, weights_out, ids_out)."""
    nodes = {topk}
    top_k = _topk_k(topk)
    ids = _getitem(topk, 1)
    nodes.update(topk.users)
    selected = topk.args[0]
    num_groups, topk_group = 1, 1
    if is_call(selected, aten.masked_fill.Scalar):
        choice = selected.args[0]
        num_groups, topk_group = _match_groups(selected, choice, nodes)
    else:
        choice = selected
    _need(is_call(choice, aten.add.Tensor) and len(choice.args) == 2 and not choice.kwargs)
    a, b = choice.args
    scores, bias = (a, b) if is_call(a, aten.sigmoid.default) else (b, a)
    _need(is_call(scores, aten.sigmoid.default) and isinstance(bias, Node))
    s_val, b_val = val_of(scores), val_of(bias)
    _need(s_val is not None and s_val.dtype == torch.float32 and s_val.dim() == 2)
    _need(b_val is not None and b_val.dim() == 1 and b_val.dtype.is_floating_point
          and known_equal(b_val.shape[0], s_val.shape[1]))
    nodes.update([choice, scores])
    logits = scores.args[0]
    if is_call(logits, aten._to_copy.default) and set(logits.kwargs) == {"dtype"} \
            and logits.kwargs["dtype"] == torch.float32 and val_of(logits.args[0]).dtype.is_floating_point:
        logits = logits.args[0]  # fused_route upcasts to fp32 itself

    gather = [u for u in scores.users if u is not choice]
    _need(len(gather) == 1 and is_call(gather[0], aten.gather.default))
    gather = gather[0]
    _need(gather.args[0] is scores and gather.args[1] in (1, -1) and gather.args[2] is ids and len(gather.args) == 3)
    nodes.add(gather)
    out = gather
    renormalize = False
    if len(out.users) == 2:  # weights / (weights.sum(-1, keepdim=True) + eps)
        total = [u for u in out.users if is_call(u, aten.sum.dim_IntList)]
        div = [u for u in out.users if is_call(u, aten.div.Tensor)]
        _need(len(total) == 1 and len(div) == 1)
        total, div = total[0], div[0]
        _need(list(total.args[1]) in ([-1], [1]) and (total.args[2] if len(total.args) > 2 else False) is True)
        eps = next(iter(total.users))
        _need(len(total.users) == 1 and is_call(eps, aten.add.Tensor) and eps.args[0] is total
              and eps.args[1] == _RENORM_EPS)
        _need(div.args[0] is gather and div.args[1] is eps)
        nodes.update([total, eps, div])
        out, renormalize = div, True
    scaling = 1.0
    if len(out.users) == 1:
        mul = next(iter(out.users))
        if is_call(mul, aten.mul.Tensor) and mul.args[0] is out and isinstance(mul.args[1], (int, float)) \
                and not isinstance(mul.args[1], bool):
            scaling = float(mul.args[1])
            nodes.add(mul)
            out = mul
    for n in nodes - {out, ids}:
        _owned(n, nodes)
    return nodes, logits, bias, (top_k, renormalize, scaling, num_groups, topk_group), out, ids


def _router_gemm(logits: Node, owned_by: set):
    """(x, W, dead-after nodes) when `logits` is the router's fp32 GEMM `mm(x, t(W))` read only by the
    pattern, else None. x and W stay as the graph has them (in a bf16 model x = _to_copy(h, fp32), which
    P7's norm kernel then writes for free, and W the fp32 weight P3 folded): same operands, same dtypes."""
    if not (is_call(logits, aten.mm.default) and all(u in owned_by for u in logits.users)):
        return None
    x, t = logits.args
    if not (is_call(t, aten.t.default) and len(t.users) == 1):
        return None
    x_val, w_val, out_val = val_of(x), val_of(t.args[0]), val_of(logits)
    if x_val is None or w_val is None or out_val is None or out_val.dtype != torch.float32:
        return None
    if x_val.dim() != 2 or w_val.dim() != 2 or x_val.dtype != torch.float32 or w_val.dtype != torch.float32:
        return None
    return x, t.args[0], [logits, t]


@register_pass("p04_fused_routing", FusedRoutingConfig)
def fused_routing(gm: GraphModule, config: FusedRoutingConfig) -> int:
    """sigmoid + bias + (group limit) + top-k + gather + renorm + scale -> one k3.fused_route node."""
    matches, fake_mode = 0, None
    for topk in [n for n in gm.graph.nodes if is_call(n, aten.topk.default)]:
        if getattr(topk, "_erased", False):
            continue  # erased as part of an earlier match
        try:
            nodes, logits, bias, args, weights_out, ids_out = _match(topk)
        except _NoMatch:
            continue
        fake_mode = fake_mode or fake_mode_of(gm)
        g = gm.graph
        sigmoid = next(n for n in nodes if is_call(n, aten.sigmoid.default))
        absorbed = [sigmoid.args[0]]
        gemm = None
        if config.absorb_router_max_tokens > 0:
            gemm = _router_gemm(logits, nodes | {sigmoid.args[0]})
        if gemm is not None:  # the node computes the logits: k3.fused_route(x, ..., router_weight=W, max tokens)
            logits, weight, dead = gemm
            args = (*args, weight, config.absorb_router_max_tokens)
            absorbed += dead
        # before the top-k: every input (logits or x, bias, W) is defined by then, every consumer comes after
        with g.inserting_before(topk):
            fused = g.call_function(torch.ops.k3.fused_route.default, (logits, bias, *args))
            w = g.call_function(operator.getitem, (fused, 0))
            i = g.call_function(operator.getitem, (fused, 1))
        for n in (fused, w, i):
            set_meta_val(n, fake_mode)
        replace_uses(weights_out, w, fake_mode)
        replace_uses(ids_out, i, fake_mode)
        erase_subgraph(gm, nodes)
        erase_if_dead(gm, absorbed)
        matches += 1
    return matches

