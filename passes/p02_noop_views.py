"""P2 no-op views: drop view ops that return their input unchanged, and collapse view chains.

A view op (view, reshape, _unsafe_view, slice, expand, permute, squeeze, alias, detach, ...) whose
result provably has the input's sizes, strides and storage offset is the input itself: its users
read the input instead. `x[:, 0:INT64_MAX]` (the `[:, :]` slices indexing makes) is the common
case. Sizes are symbolic, so "provably" means `statically_known_true` on the size expressions;
when the symbolic reasoning cannot decide, the node stays.

A chain of reshapes `view(view(x, a), b)` becomes `view(x, b)` when x is provably contiguous (for
a non-contiguous x a direct view might not exist even though the two steps do); the inner view
is erased when nothing else reads it.

Aliasing stays right: the replacement aliases the same memory with the same layout, so in-place
writes through either name hit the same elements.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import erase_if_dead, is_contiguous, same_layout, val_of
from .registry import PassConfig, register_pass

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@dataclass
class NoopViewsConfig(PassConfig):
    collapse_chains: bool = True  # view(view(x)) -> view(x) for contiguous x


def _is_view_node(node: Node) -> bool:
    t = node.target
    return (node.op == "call_function" and isinstance(t, torch._ops.OpOverload)
            and (t.is_view or t == aten._unsafe_view.default) and bool(node.args) and isinstance(node.args[0], Node))


def _is_noop(node: Node) -> bool:
    out, src = val_of(node), val_of(node.args[0])
    return out is not None and src is not None and same_layout(out, src)


@register_pass("p02_noop_views", NoopViewsConfig)
def noop_views(gm: GraphModule, config: NoopViewsConfig) -> int:
    """Remove views that change nothing (same sizes/strides/offset) and collapse reshape chains."""
    matches = 0
    for node in list(gm.graph.nodes):
        if not _is_view_node(node) or not isinstance(node.meta.get("val"), torch.Tensor):
            continue  # multi-output views (split) are left alone
        inner = node.args[0]
        if (config.collapse_chains and node.target in _RESHAPES and inner.op == "call_function"
                and inner.target in _RESHAPES and isinstance(inner.args[0], Node)):
            src = val_of(inner.args[0])
            if src is not None and is_contiguous(src):
                node.args = (inner.args[0], *node.args[1:])  # same sizes, contiguous strides: meta unchanged
                erase_if_dead(gm, [inner])
                matches += 1
        if _is_noop(node):  # (also after a collapse: view(view(x, a), x.shape) is x)
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            matches += 1
    return matches
