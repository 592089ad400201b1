"""P11 copy elision and residual folding: producers write where their consumers read.

Where the copies of the decode step come from (k3-tiny / kimi-linear-tiny decode, bf16, after P1-P4;
`copy_nodes` counts them): the RMSNorm up/down casts (`_to_copy`, two per norm: P7's fused norm
takes them), the fp32 casts in front of the routers and the KDA gate/beta math, one `cat` per MLA
layer for the KV row and one for the absorbed query (P15's prologue kernel writes both in place),
one `clone` per MLA layer (the per-head attention output made contiguous for o_proj), and inside
the k3 ops' reference implementations (short-conv window gather/cat/scatter, KV index_put: P5 and
P15 replace those kernels). What the graph itself allows without a new kernel is folding the
element-wise add that consumes a GEMM into the GEMM's epilogue:

    add(r, k3.gemv(x, W, None, ...))  ->  k3.gemv(x, W, r, ...)   (P8's kernel adds r in its tail)
    add(r, mm(x, Wt))                 ->  addmm(r, x, Wt)         (cuBLAS: C = r + x @ Wt; fp32 graphs,
                                                                    or 16-bit ones with fold_16bit_addmm)

r is the residual stream (o_proj / down_proj + hidden), the routed experts' output (+ the shared
expert's down projection), or a bias row [N] (KDA's dt_bias in fp32 graphs; bf16 graphs cast the
GEMM's result to fp32 first, and a cast in between is not folded). The GEMM's result must have no
other reader, r must have the add's shape ([M, N]) or be a [N] row, the same dtype (no type
promotion), and the add no alpha. One kernel and one round trip of the [M, N] result through
memory less per match.

Numerics: k3.gemv rounds the product before adding r, exactly like the unfused mm + add. A 16-bit
addmm rounds once, more accurate but not the same step: on a bf16 k3-tiny engine with every pass
the logits moved by 1.3% (beyond the 1e-2 verify tolerance), so 16-bit addmm folding is opt-in.
fp32 addmm differs from mm + add by ~1 ulp.

Matches = adds folded.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import (fake_mode_of, is_call, known_equal, replace_uses, same_layout, same_sizes, set_meta_val,
                          val_of)
from .kernels import gemv as _gemv  # noqa: F401  (torch.ops.k3.gemv)
from .registry import PassConfig, register_pass

aten = torch.ops.aten

# nodes that move or duplicate data rather than compute: what "copies" counts (graph level)
COPY_TARGETS = {
    aten._to_copy.default: "_to_copy", aten.clone.default: "clone", aten.copy.default: "copy",
    aten.copy_.default: "copy_", aten.cat.default: "cat", aten.stack.default: "stack",
    aten.index_put.default: "index_put", aten.index_put_.default: "index_put_",
    aten.slice_scatter.default: "slice_scatter", aten.select_scatter.default: "select_scatter",
    aten.contiguous.default: "contiguous", aten.expand_copy.default: "expand_copy",
}


def copy_nodes(gm: GraphModule) -> collections.Counter:
    """Copy-kind nodes of a graph by op name, plus "add-after-gemm": element-wise adds reading a GEMM's
    result (the round trip the residual fold removes)."""
    out = collections.Counter()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in COPY_TARGETS:
            out[COPY_TARGETS[n.target]] += 1
        elif n.target == aten.add.Tensor and any(_is_gemm(a) for a in n.args[:2]):
            out["add-after-gemm"] += 1
    return out


@dataclass
class CopyElisionConfig(PassConfig):
    fold_residual_add: bool = True  # add(r, GEMM) -> GEMM with r in its epilogue
    fold_16bit_addmm: bool = False  # also fold into cuBLAS addmm in bf16/fp16 graphs (rounds once: not exact)


def _is_gemm(node) -> bool:
    return is_call(node, aten.mm.default) or (is_call(node, torch.ops.k3.gemv.default) and node.args[2] is None)


def _fold(gm: GraphModule, add: Node, fake_mode, config: "CopyElisionConfig") -> bool:
    if len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return False
    out = val_of(add)
    for gemm, r in ((add.args[1], add.args[0]), (add.args[0], add.args[1])):
        if not (_is_gemm(gemm) and isinstance(r, Node) and r is not gemm and len(gemm.users) == 1):
            continue
        rv, gv = val_of(r), val_of(gemm)
        if rv is None or gv is None or out is None:
            continue
        if gemm.target == aten.mm.default and gv.dtype in (torch.bfloat16, torch.float16) \
                and not config.fold_16bit_addmm:
            continue
        full = rv.dim() == 2 and same_sizes(rv.shape, out.shape)  # a residual [M, N]
        bias = rv.dim() == 1 and out.dim() == 2 and known_equal(rv.shape[0], out.shape[1])  # a bias [N]
        if not (rv.dtype == gv.dtype == out.dtype and same_layout(gv, out) and (full or bias)):
            continue
        with gm.graph.inserting_before(add):
            if gemm.target == aten.mm.default:
                new = gm.graph.call_function(aten.addmm.default, (r, *gemm.args))
            else:
                x, w, _, *rest = gemm.args
                new = gm.graph.call_function(torch.ops.k3.gemv.default, (x, w, r, *rest))
        set_meta_val(new, fake_mode)
        replace_uses(add, new, fake_mode)
        gm.graph.erase_node(add)
        gm.graph.erase_node(gemm)
        return True
    return False


@register_pass("p11_copy_elision", CopyElisionConfig)
def copy_elision(gm: GraphModule, config: CopyElisionConfig) -> int:
    """Copy elision: element-wise adds after a GEMM folded into the GEMM's epilogue."""
    if not config.fold_residual_add:
        return 0
    adds = [n for n in gm.graph.nodes if is_call(n, aten.add.Tensor) and any(_is_gemm(a) for a in n.args[:2])]
    if not adds:
        return 0
    fake_mode = fake_mode_of(gm)
    return sum(_fold(gm, add, fake_mode, config) for add in adds)
