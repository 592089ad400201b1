"""P1 horizontal GEMM merge: linears that read the same activation become one GEMM plus a split.

Captured linears look like `mm(x, t(get_attr W))`. All such mms on one input node `x` are merged:
the weights are concatenated along the output dim now, at build time, into one new buffer (named
after the layer and the parts, e.g. `w_model_layers_0_self_attn__q_proj__k_proj__...`), and

    y = mm(x, t(W_merged));  a, b, ... = split_with_sizes(y, [Na, Nb, ...], 1)

replaces them; every user of an old mm reads its column block. The blocks are strided views of
`y` (row stride = total width), which the k3 ops and ATen accept. What it hits per layer:
KDA q/k/v/f_a/b/g (g_proj in K3, g_a_proj in Kimi-Linear), MLA q_a (q_proj without q-LoRA) +
kv_a_proj_with_mqa (+ g_proj output gate in K3), the MoE front (router + latent down-projection +
shared-expert gate/up), the dense MLP's gate/up. One match per merged group.

Dtypes: mm takes both operands in one dtype, so the mms on one input node already agree; nothing
is ever cast. In a bf16 model the router runs in fp32 on `x.float()` with `W.float()` (another input
node, and a cast rather than a plain constant), so it stays a separate fp32 GEMM and the bf16 MoE
front is {latent down-proj, shared gate, shared up}: still one match per MoE layer. Merging it
into the bf16 GEMM would change the router's numerics.

Provenance of each merged buffer (source weights and their row ranges) is recorded in
`gm.meta["k3"]["merged_weights"]`, for engine export and later sharding passes.
"""
from __future__ import annotations

import operator
import os
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import (add_constant, attr_tensor, drop_unused_constants, erase_if_dead, fake_mode_of, replace_uses,
                          set_meta_val)
from .registry import PassConfig, PassConfigError, register_pass

aten = torch.ops.aten


@dataclass
class GemmMergeConfig(PassConfig):
    min_group: int = 2  # merge only groups of at least this many GEMMs on one input

    def validate(self) -> None:
        if self.min_group < 2:
            raise PassConfigError(f"p01_gemm_merge.min_group must be >= 2 (a group of one is not a merge), "
                                  f"got {self.min_group}")


def _weight_of(mm: Node):
    """(t node, get_attr node) when mm's second operand is t(constant 2-D weight), else None."""
    wt = mm.args[1]
    if not (isinstance(wt, Node) and wt.op == "call_function" and wt.target == aten.t.default):
        return None
    w = wt.args[0]
    if not (isinstance(w, Node) and w.op == "get_attr"):
        return None
    return wt, w


def _merged_name(names: list[str]) -> str:
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind("_") + 1]  # cut at a name boundary
    parts = [n[len(prefix):].removesuffix("_weight") or n for n in names]
    return prefix + "_" + "__".join(parts)


def _merge_group(gm: GraphModule, x: Node, mms: list[tuple[Node, Node, Node]], fake_mode) -> None:
    weights = [attr_tensor(gm, w) for _, _, w in mms]
    names = [w.target for _, _, w in mms]
    first = mms[0][0]
    merged = torch.cat([w.detach() for w in weights], 0).contiguous()
    w_node = add_constant(gm, _merged_name(names), merged, before=first, fake_mode=fake_mode)
    g = gm.graph
    with g.inserting_before(first):
        t_node = g.call_function(aten.t.default, (w_node,))
        mm_node = g.call_function(aten.mm.default, (x, t_node))
        sizes = [w.shape[0] for w in weights]
        split = g.call_function(aten.split_with_sizes.default, (mm_node, sizes, 1))
        for n in (t_node, mm_node, split):
            set_meta_val(n, fake_mode)
        for i, (old_mm, _, _) in enumerate(mms):
            part = g.call_function(operator.getitem, (split, i))
            set_meta_val(part, fake_mode)
            replace_uses(old_mm, part, fake_mode)
    rows, start = [], 0
    for name, n in zip(names, sizes):
        rows.append({"source": name, "rows": [start, start + n]})
        start += n
    gm.meta.setdefault("k3", {}).setdefault("merged_weights", {})[w_node.target] = rows
    erase_if_dead(gm, [m for m, _, _ in mms] + [t for _, t, _ in mms] + [w for _, _, w in mms])
    drop_unused_constants(gm, names)


@register_pass("p01_gemm_merge", GemmMergeConfig)
def gemm_merge(gm: GraphModule, config: GemmMergeConfig) -> int:
    """Horizontal GEMM merge: mms sharing one input and constant weights become one mm + split."""
    groups: dict[Node, list] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.mm.default and isinstance(node.args[0], Node):
            w = _weight_of(node)
            if w is not None and attr_tensor(gm, w[1]).dim() == 2:
                groups[node.args[0]].append((node, *w))
    todo = [(x, mms) for x, mms in groups.items() if len(mms) >= config.min_group]
    if not todo:
        return 0
    fake_mode = fake_mode_of(gm)
    for x, mms in todo:
        _merge_group(gm, x, mms, fake_mode)
    return len(todo)
