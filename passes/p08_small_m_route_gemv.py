"""The K3 MoE's front GEMV in the launch of its norm + router: `k3::norm_route` whose h feeds exactly one k3.gemv
becomes one `k3::norm_route_gemv` node (kernel in `kernels/norm_route.py`).

Matched (after P7's norm_route and P8, in any graph that has both: token steps whose GEMMs P8 made k3.gemv):

    h, p, w, ids = k3.norm_route(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl, bias, W_r, ...)
    y            = k3.gemv(h, W, None, max_m, block_n, block_k, split_k, design, use_pdl, num_warps, ...)
                   h read by nothing else; W a weight (get_attr); no bias c

and replaced by `h, p, w, ids, y = k3.norm_route_gemv(<norm_route's arguments, its launch options spelled out>, W,
<the gemv's configuration, defaults spelled out>, max_tokens[, front_block])`. In K3 the gemv is the MoE's front: the
routed experts' latent down-projection merged (P1) with the shared expert's gate/up, all on the normed row. The
fused kernel runs at T <= min(max_tokens, the router kernel's limit); above, the pair (bit-identical to the graph
before the pass), as on CPU. Kimi Linear's MoE has no front GEMV (its shared gate/up is a slot of P6's kernel A): 0
matches there; tensor-parallel ranks have no norm_route (their norm reads an all-reduce: P9's), 0 too.

Why: the front GEMV is a separate launch between the router and P6's kernel A, although the router's programs
already recompute h; as more programs of the router's launch it streams its weights beside the routing tail
instead of after it, one launch fewer per MoE layer (k3-mini-6b: 28 of 288). Off until it is measured on the device
(`bench ladder --variant front:p08_small_m_route_gemv.enabled=true`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import args_with_defaults, fake_mode_of, getitem_outputs, is_call, set_meta_val
from .kernels import gemv as _gemv  # noqa: F401  (registers torch.ops.k3.gemv)
from .kernels import norm_route as _kernel
from .registry import PassConfig, PassConfigError, register_pass

NORM_ROUTE = torch.ops.k3.norm_route.default
GEMV = torch.ops.k3.gemv.default
FUSED = torch.ops.k3.norm_route_gemv.default



@dataclass
class RouteGemvConfig(PassConfig):
    enabled: bool = False  # off: k3-mini-6b batch 1 25% slower (traces/h200_s19/call2, H100: 1.953 -> 2.447 ms)
    # tokens up to which the fused kernel runs (the router kernel's own limit caps it); above, the pair
    max_tokens: int = _kernel.FUSED_MAX_TOKENS
    # the front GEMV's weight rows per program (a power of two up to MAX_FRONT_BLOCK); 0: the kernel's default
    # (norm_route.front_rows: 16 rows at D = 2048, one wave at k3-mini-6b batch 1). Results do not depend on it.
    front_block: int = 0

    def validate(self) -> None:
        if not 0 <= self.max_tokens <= _kernel.FUSED_MAX_TOKENS:
            raise PassConfigError(f"p08_small_m_route_gemv.max_tokens must be in 0..{_kernel.FUSED_MAX_TOKENS}, "
                                  f"got {self.max_tokens}")
        try:
            _kernel.check_front_launch(self.max_tokens, self.front_block)
        except ValueError as err:
            raise PassConfigError(f"p08_small_m_route_gemv.front_block: {err}") from None


def _match(route: Node):
    """(gemv node, route outputs) when `route`'s h feeds one bias-free k3.gemv of a weight, else None."""
    if route.kwargs or not 16 <= len(route.args) <= 18:
        return None
    outs = getitem_outputs(route)
    h = outs.get(0)
    if h is None or len(h.users) != 1:
        return None
    gemv = next(iter(h.users))
    if not is_call(gemv, GEMV) or gemv.kwargs or gemv.args[0] is not h or not 7 <= len(gemv.args) <= 13:
        return None
    w, c = gemv.args[1], gemv.args[2]
    if c is not None or not (isinstance(w, Node) and w.op == "get_attr"):
        return None
    return gemv, outs


def _no_up_prewait(node: Node) -> None:
    """P6's up_prewait lets kernel A read its expert ids before gdc_wait, which holds only while the router runs two
    launches before A. Folded here, the router and the front GEMV are one launch, right before A: the option goes."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "up_prewait" in names and names.index("up_prewait") < len(node.args):
        i = names.index("up_prewait")
        node.args = (*node.args[:i], False, *node.args[i + 1:])


@register_pass("p08_small_m_route_gemv", RouteGemvConfig)
def route_gemv(gm: GraphModule, config: RouteGemvConfig) -> int:
    """k3.norm_route + the k3.gemv on its h -> one k3.norm_route_gemv."""
    g = gm.graph
    matches, fake_mode = 0, None
    order = {n: i for i, n in enumerate(g.nodes)}  # moved weight reads only go earlier: still a valid test
    for route in [n for n in g.nodes if is_call(n, NORM_ROUTE)]:
        m = _match(route)
        if m is None:
            continue
        gemv, outs = m
        fake_mode = fake_mode or fake_mode_of(gm)
        w = gemv.args[1]
        if order[w] > order[route]:
            route.prepend(w)  # a weight read: it may move before the fused node
        # both ops' trailing defaults spelled out (tail, target_programs; max_m .. upper): the fused op takes all
        route_args, gemv_args = args_with_defaults(route), args_with_defaults(gemv)[3:]
        with g.inserting_before(route):
            launch = (config.front_block,) if config.front_block else ()  # unset: the schema's default
            fused = g.call_function(FUSED, (*route_args, w, *gemv_args, config.max_tokens, *launch))
            items = [g.call_function(operator.getitem, (fused, i)) for i in range(5)]
        for n in [fused, *items]:
            set_meta_val(n, fake_mode)
        for i in (1, 2, 3):
            if outs.get(i) is not None:
                outs[i].replace_all_uses_with(items[i])
        gemv.replace_all_uses_with(items[4])
        for node in [gemv, *outs.values(), route]:
            g.erase_node(node)
        for user in list(items[3].users):  # the routing now comes from the launch right before P6's kernel A
            _no_up_prewait(user)
        for item in items:  # an output nobody reads (h: its one reader was the gemv) loses its getitem
            if not item.users:
                g.erase_node(item)
        matches += 1
    return matches
