"""Column blocks of a constant-weight GEMM, and taking some of them out of it at build time.

A pass that folds some of a GEMM's outputs into a kernel of its own (P6: the shared expert's gate and up,
which P1 merged with the other GEMMs on the same input) needs the weight rows behind those outputs, and
then must not leave the GEMM computing them for nobody. The GEMM is `mm(x, t(get_attr W))`, its outputs
read whole or, after P1, through `split_with_sizes(mm, sizes, 1)` and getitems.

`column_block(node)` says which rows of which weight a node's values come from; `drop_column_blocks(gm,
split)` rebuilds a P1 merged GEMM without the blocks nobody reads any more (a smaller merged weight, or a plain
mm when one block is left, or nothing), keeping the provenance P1 recorded in gm.meta["k3"]["merged_weights"].
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import add_constant, attr_tensor, drop_unused_constants, erase_if_dead, is_call, replace_uses, \
    set_meta_val

aten = torch.ops.aten


@dataclass
class ColumnBlock:
    """Output columns [start, start + width) of mm(x, t(W)): W's rows of the same range."""
    x: Node  # the GEMM's input
    mm: Node
    weight: Node  # get_attr of W [N, K]
    start: int
    width: int
    split: Node | None  # the split_with_sizes the block is read through, None when the mm is read whole
    index: int  # the block's getitem index in `split` (0 without a split)

    def rows(self, gm: GraphModule) -> torch.Tensor:
        return attr_tensor(gm, self.weight)[self.start:self.start + self.width]


def _gemm(mm) -> tuple[Node, Node] | None:
    """(x, W get_attr) of mm(x, t(W)) with W a constant 2-D weight, else None."""
    if not is_call(mm, aten.mm.default) or not isinstance(mm.args[0], Node):
        return None
    t = mm.args[1]
    if not is_call(t, aten.t.default) or not isinstance(t.args[0], Node) or t.args[0].op != "get_attr":
        return None
    return mm.args[0], t.args[0]


def column_block(gm: GraphModule, node: Node) -> ColumnBlock | None:
    """Where `node`'s values come from when it is a constant-weight GEMM or a column block of one, else None."""
    split, index = None, 0
    mm = node
    if is_call(node, operator.getitem) and is_call(node.args[0], aten.split_with_sizes.default):
        split, index = node.args
        args = split.args
        if (args[2] if len(args) > 2 else split.kwargs.get("dim", 0)) not in (1, -1) or split.kwargs.keys() - {"dim"}:
            return None
        mm = args[0]
    gemm = _gemm(mm)
    if gemm is None or attr_tensor(gm, gemm[1]).dim() != 2:
        return None
    x, weight = gemm
    rows = attr_tensor(gm, weight).shape[0]
    if split is None:
        return ColumnBlock(x, mm, weight, 0, rows, None, 0)
    sizes = list(split.args[1])
    if sum(sizes) != rows:
        return None
    return ColumnBlock(x, mm, weight, sum(sizes[:index]), sizes[index], split, index)


def _provenance(gm: GraphModule, weight: Node, sizes: list[int]) -> list[dict]:
    """P1's record of the merged weight's parts (one per split block), or the blocks' row ranges."""
    parts = gm.meta.get("k3", {}).get("merged_weights", {}).get(weight.target)
    if parts is not None and len(parts) == len(sizes):
        return parts
    rows, start = [], 0
    for n in sizes:
        rows.append({"source": weight.target, "rows": [start, start + n]})
        start += n
    return rows


def drop_column_blocks(gm: GraphModule, split: Node, fake_mode) -> None:
    """Rebuild the merged GEMM behind `split` (P1's mm + split_with_sizes) without the blocks no node reads:
    their weight rows leave the graph. One block left: a plain mm read by its users; none: nothing left."""
    block_users: dict[int, list[Node]] = {}
    for user in list(split.users):
        if is_call(user, operator.getitem) and not user.users:
            gm.graph.erase_node(user)
        elif is_call(user, operator.getitem):
            block_users.setdefault(user.args[1], []).append(user)
        else:
            return  # read other than through getitems: leave it
    mm = split.args[0]
    x, weight = _gemm(mm)
    sizes = list(split.args[1])
    keep = sorted(block_users)
    if len(keep) == len(sizes):
        return
    old_name, old = weight.target, attr_tensor(gm, weight)
    dead = [split, mm, mm.args[1], weight]
    if keep:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        parts = _provenance(gm, weight, sizes)
        merged = torch.cat([old[starts[i]:starts[i] + sizes[i]] for i in keep]).contiguous()
        # one block left is one of P1's source weights again: its own name; several keep the merged one's
        name = parts[keep[0]]["source"] if len(keep) == 1 else old_name
        w_node = add_constant(gm, name, merged, before=split, fake_mode=fake_mode)
        with gm.graph.inserting_before(split):
            t_node = gm.graph.call_function(aten.t.default, (w_node,))
            new_mm = gm.graph.call_function(aten.mm.default, (x, t_node))
            set_meta_val(t_node, fake_mode)
            set_meta_val(new_mm, fake_mode)
            if len(keep) == 1:
                for user in block_users[keep[0]]:
                    replace_uses(user, new_mm, fake_mode)
                    dead.insert(0, user)
            else:
                new_split = gm.graph.call_function(aten.split_with_sizes.default,
                                                   (new_mm, [sizes[i] for i in keep], 1))
                set_meta_val(new_split, fake_mode)
                for j, i in enumerate(keep):
                    part = gm.graph.call_function(operator.getitem, (new_split, j))
                    set_meta_val(part, fake_mode)
                    for user in block_users[i]:
                        replace_uses(user, part, fake_mode)
                        dead.insert(0, user)
    erase_if_dead(gm, dead)
    if old_name in drop_unused_constants(gm, [old_name]):
        gm.meta.get("k3", {}).get("merged_weights", {}).pop(old_name, None)
    if len(keep) > 1:
        record_merge(gm, w_node, [(parts[i]["source"], sizes[i]) for i in keep])


def record_merge(gm: GraphModule, weight: Node, parts: list[tuple[str, int]]) -> None:
    """Provenance of a merged weight, as P1 keeps it: each source weight's name and its rows in the merge."""
    rows, start = [], 0
    for source, n in parts:
        rows.append({"source": source, "rows": [start, start + n]})
        start += n
    gm.meta.setdefault("k3", {}).setdefault("merged_weights", {})[weight.target] = rows


def source_name(gm: GraphModule, block: ColumnBlock) -> str:
    """The name of the weight the block's rows came from before any merge."""
    if block.split is None:
        return block.weight.target
    return _provenance(gm, block.weight, list(block.split.args[1]))[block.index]["source"]
