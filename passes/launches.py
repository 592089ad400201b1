"""Estimated kernel launches of a graph: what the pass report counts before and after each pass.

The rule, node by node (an eager run on a GPU launches roughly one kernel per counted node):

| node                                                                          | launches |
|-------------------------------------------------------------------------------|----------|
| placeholder, get_attr, output                                                 | 0        |
| ATen view op (its schema returns an alias of the input: view, reshape, t,     | 0        |
| permute, transpose, expand, slice, select, split*, (un)squeeze, alias, detach,|          |
| as_strided, unbind, ...) and `_unsafe_view`                                   |          |
| `operator.getitem`; `aten.sym_size/sym_stride/sym_numel/sym_storage_offset`   | 0        |
| host-side scalar math on sizes (`operator.*`, `math.*`, `torch.sym_*`)        | 0        |
| allocation without a fill (`empty`, `empty_like`, `empty_strided`, `new_empty`)| 0        |
| every other call: compute, copies and casts, `zeros_like`, `cat`, `k3::` ops  | 1        |

It is an estimate: a `k3::` op counts as one launch whatever its implementation runs (the CPU
references loop in Python; the fused CUDA kernels are one launch each), `reshape` counts as a view
(make_fx graphs have it decomposed already: a copying reshape appears as `clone` + `_unsafe_view`),
and cuBLAS may split one GEMM into two kernels. Good enough to see what a pass removed.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten

_FREE_TARGETS = {
    operator.getitem,
    aten._unsafe_view.default,
    aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default,
}
_HOST_MODULES = ("_operator", "operator", "math")


def node_launches(node: Node) -> int:
    if node.op != "call_function":
        return 0
    t = node.target
    if t in _FREE_TARGETS:
        return 0
    if isinstance(t, torch._ops.OpOverload):
        return 0 if t.is_view else 1
    if getattr(t, "__module__", None) in _HOST_MODULES or getattr(t, "__name__", "").startswith("sym_"):
        return 0
    return 1


def count_launches(gm: GraphModule) -> int:
    return sum(node_launches(n) for n in gm.graph.nodes)


def count_nodes(gm: GraphModule) -> int:
    return len(gm.graph.nodes)
