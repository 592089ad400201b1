"""P7 + P4 in one kernel: the norm before each MoE and its absorbed router become one `k3::norm_route` node.

Matched (after P4 and P7, in decode and verify graphs: token steps of a few rows), anchored on P7's node:

    h, p, h32 = k3.attn_res_norm_f32(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl)
    w, ids    = k3.fused_route(h32, bias, top_k, renormalize, scaling, G, topk_group, W, max_tokens)
                h32 read by nothing else; W a weight (get_attr, fp32: the copy P3 folded); bias defined before
                P7's node (or a get_attr, moved there)

and replaced by `h, p, w, ids = k3.norm_route(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, W',
top_k, renormalize, scaling, G, topk_group, max_tokens[, tail[, target_programs]])` (the launch options only up to
the last one set: a node of an engine built before them has the same arguments as then). W' is W in the activations'
dtype (bf16: the checkpoint's) when that conversion is exact, so the kernel reads half the bytes and P3's fp32 copy
leaves the engine's weights; otherwise W as it is. At T <= max_tokens the op is one launch (kernels/norm_route.py);
above it, today's pair. A node whose delta (or x at a block boundary) is a `k3.all_reduce` is left to P9 (the
collective fusion), as is anything that deviates from the form above. Prefill graphs: 0 matches.

Options (NormRouteConfig): `tail`, the token's last program's routing (kernels.routing.ROUTE_TAILS: "rounds",
the op's default; "lean" gathers the picks' weights from registers and zeroes the arrival counter without waiting;
"bitonic" is lean with a tl.topk network instead of k argmax rounds, the pass's default: the whole 48B step 1.9%
faster at batch 1, 0.6% at batch 8, traces/h200_s11/call3), and `target_programs`, the fused kernel's grid target (norm_route.default_blocks; 0: its
TARGET_PROGRAMS). Neither changes the results.

Counts: one per MoE layer of a bf16 / fp16 decode graph with P4's absorbed router (P7 makes one
attn_res_norm_f32 per MoE layer there); 0 in fp32 graphs (the router GEMM is P1's merged one, not absorbed).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import (add_constant, attr_tensor, drop_unused_constants, fake_mode_of, getitem_outputs, is_call,
                          set_meta_val, val_of)
from .kernels import norm_route as _kernel  # noqa: F401  (registers torch.ops.k3.norm_route)
from .kernels.routing import ROUTE_TAILS
from .p06_fused_moe_decode import TOKEN_STEP_MODES
from .registry import PassConfig, PassConfigError, register_pass

NORM_F32 = torch.ops.k3.attn_res_norm_f32.default
ROUTE = torch.ops.k3.fused_route.default
FUSED = torch.ops.k3.norm_route.default
ALL_REDUCE = torch.ops.k3.all_reduce.default if hasattr(torch.ops.k3, "all_reduce") else None


def _match(norm: Node, order: dict):
    """(route node, its outputs, norm outputs) when `norm` feeds an absorbed router as the docstring says."""
    if norm.kwargs or len(norm.args) != 8:
        return None
    bank, x, delta, *_ = norm.args
    source = x if delta is None else delta
    if ALL_REDUCE is not None and is_call(source, ALL_REDUCE):
        return None  # P9 fuses the collective with this norm
    outs = getitem_outputs(norm)
    h32 = outs.get(2)
    if h32 is None or len(h32.users) != 1:
        return None
    route = next(iter(h32.users))
    if not is_call(route, ROUTE) or route.kwargs or len(route.args) != 9 or route.args[0] is not h32:
        return None
    bias, weight = route.args[1], route.args[7]
    if not (isinstance(weight, Node) and weight.op == "get_attr" and isinstance(bias, Node)):
        return None
    if bias.op != "get_attr" and order[bias] > order[norm]:
        return None
    routed = getitem_outputs(route)
    if not routed:
        return None
    return route, routed, outs


def _router_weight(gm: GraphModule, weight: Node, dtype: torch.dtype, anchor: Node, fake_mode) -> Node:
    """The router weight in the activations' dtype when the conversion is exact (bf16 checkpoint weights that P3
    upcast), as a new constant read before `anchor`; else the weight node as it is."""
    w = attr_tensor(gm, weight)
    if w.dtype == dtype or not dtype.is_floating_point or dtype.itemsize >= w.dtype.itemsize:
        return weight
    narrow = w.detach().to(dtype)
    if not torch.equal(narrow.to(w.dtype), w):
        return weight
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).split(".")[-1])
    return add_constant(gm, f"{weight.target.removesuffix('_fp32')}_{short}", narrow.contiguous(), anchor, fake_mode)


@dataclass
class NormRouteConfig(PassConfig):
    # the token's last-arriving program's routing tail, a key of kernels.routing.ROUTE_TAILS ("rounds": the op's own
    # default). "bitonic" since session 11: 48B step 2.206 -> 2.163 ms at batch 1, 7.133 -> 7.093 at batch 8
    # (traces/h200_s11/call3, same run, whole engine)
    tail: str = "bitonic"
    # the fused kernel's grid target (programs per launch, norm_route.default_blocks); 0: TARGET_PROGRAMS (128)
    target_programs: int = 0

    def validate(self) -> None:
        if self.tail not in ROUTE_TAILS:
            raise PassConfigError(f"p07_norm_route: tail must be one of {', '.join(ROUTE_TAILS)}, got {self.tail!r}")
        if self.target_programs < 0:
            raise PassConfigError(f"p07_norm_route: target_programs must be >= 0 (0: the kernel's default), "
                                  f"got {self.target_programs}")


def _launch_options(config: NormRouteConfig) -> tuple:
    """The op's trailing launch options (tail, target_programs), cut after the last one that differs from the op's
    default: unset, a node keeps the arguments it had before the options existed."""
    options = [config.tail, int(config.target_programs)]
    while options and options[-1] in ("rounds", 0):
        options.pop()
    return tuple(options)


@register_pass("p07_norm_route", NormRouteConfig)
def norm_route(gm: GraphModule, config: NormRouteConfig) -> int:
    """k3.attn_res_norm_f32 + the absorbed k3.fused_route reading its fp32 copy -> one k3.norm_route (decode)."""
    if gm.meta.get("k3", {}).get("mode") not in TOKEN_STEP_MODES:
        return 0
    g = gm.graph
    matches, fake_mode, dropped = 0, None, []
    order = {n: i for i, n in enumerate(g.nodes)}
    for norm in [n for n in g.nodes if is_call(n, NORM_F32)]:
        m = _match(norm, order)
        if m is None:
            continue
        route, routed, outs = m
        fake_mode = fake_mode or fake_mode_of(gm)
        bank, x, delta, query, norm_w, res_eps, norm_eps, pdl = norm.args
        _, bias, top_k, renormalize, scaling, groups, topk_group, weight, max_tokens = route.args
        if bias.op == "get_attr" and order[bias] > order[norm]:
            norm.prepend(bias)  # a weight read: it may move before the fused node
        w = _router_weight(gm, weight, val_of(x).dtype, norm, fake_mode)
        with g.inserting_before(norm):
            fused = g.call_function(FUSED, (bank, x, delta, query, norm_w, res_eps, norm_eps, pdl, bias, w, top_k,
                                             renormalize, scaling, groups, topk_group, max_tokens,
                                             *_launch_options(config)))
            items = [g.call_function(operator.getitem, (fused, i)) for i in range(4)]
        for n in [fused, *items]:
            set_meta_val(n, fake_mode)
        old = {0: outs.get(0), 1: outs.get(1), 2: routed.get(0), 3: routed.get(1)}
        for i, node in old.items():
            if node is not None:
                node.replace_all_uses_with(items[i])
        for node in [routed.get(0), routed.get(1), route, outs.get(0), outs.get(1), outs[2], norm]:
            if node is not None:
                g.erase_node(node)
        for i in (0, 1, 2, 3):  # an output nobody reads: its getitem goes
            if not items[i].users:
                g.erase_node(items[i])
        if w is not weight and not weight.users:
            g.erase_node(weight)
            dropped.append(weight.target)
        matches += 1
    drop_unused_constants(gm, dropped)  # P3's fp32 router copies the bf16 ones replaced
    return matches
