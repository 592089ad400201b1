"""P18 short-conv merge: a KDA layer's three prefill short convs (q, k, v) become one `k3::short_conv_prefill` over
their channels side by side.

Why: a prefill step runs eagerly (no CUDA graph), op by op from the host, and the served k3-mini-6b's prefill
forwards cost ~200 ms each whatever their size (traces/h200_s13/call3: TTFT 643 ms for 3 forwards, 225 ms for 1 of
16 tokens), far above their device time. Each short conv is ~30 ATen ops on the host (k3::short_conv_prefill's
packed reference, which CUDA runs too: window gather, index building, scatter, unfold, SiLU, window write-back) plus
a mutating custom op's dispatch; 63 of them a k3-mini step. The conv is depthwise, so three convs of adjacent
channel ranges of one layer's conv-state slot are one conv over the union, with the same arithmetic per channel:

    a = short_conv_prefill(xq, wq, pool, L, o, slots, cu, seq)           x = slice(Y, 1, s, s + Cq + Ck + Cv)
    b = short_conv_prefill(xk, wk, pool, L, o + Cq, slots, cu, seq)  ->  y = short_conv_prefill(x, W, pool, L, o, ...)
    c = short_conv_prefill(xv, wv, pool, L, o + Cq + Ck, slots, ...)     a, b, c = column slices of y

with W = cat(wq, wk, wv) (rows: channels), a new constant made at build time. x is a column slice of the producer
when xq, xk, xv are adjacent blocks of one split_with_sizes (P1's merged q/k/v/... GEMM: no copy), else
cat([xq, xk, xv], 1). Matched: short_conv_prefill nodes with the same pool, layer, slots, cu_seqlens and seq_lens
whose channel ranges follow each other, weights constant (get_attr, or squeeze(get_attr, 1) as captured), inputs of
one dtype and row count, all defined before the group's first conv. Counts: one per merged group (a K3 / Kimi Linear
KDA layer: 1), 0 in decode and verify graphs (other ops). Numerics: bit-identical (the same per-channel math).
Off by default until the device measures it (tools/gpu_ttft13.sh applies it to a built engine's prefill graph).
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from k3compile.model_def.ops import library  # noqa: F401  (registers torch.ops.k3.short_conv_prefill)

from .graph_utils import (add_constant, attr_tensor, drop_unused_constants, erase_if_dead, fake_mode_of, known_equal,
                          replace_uses, set_meta_val, val_of)
from .registry import PassConfig, PassConfigError, register_pass

aten = torch.ops.aten
SHORT_CONV_PREFILL = torch.ops.k3.short_conv_prefill.default


@dataclass
class ShortConvMergeConfig(PassConfig):
    enabled: bool = False   # not measured on the device yet (tools/gpu_ttft13.sh)
    min_group: int = 2   # merge runs of at least this many adjacent convs

    def validate(self) -> None:
        if self.min_group < 2:
            raise PassConfigError(f"p18_short_conv_merge.min_group must be >= 2 (a group of one is not a merge), "
                                  f"got {self.min_group}")


def _weight(gm: GraphModule, w) -> tuple[torch.Tensor, list[Node]] | None:
    """(the constant [C, W] weight, its nodes) for get_attr or squeeze(get_attr, 1), else None."""
    if not isinstance(w, Node):
        return None
    if w.op == "get_attr":
        t = attr_tensor(gm, w)
        return (t, [w]) if t.dim() == 2 else None
    if w.op == "call_function" and w.target == aten.squeeze.dim and w.args[1:] == (1,) \
            and isinstance(w.args[0], Node) and w.args[0].op == "get_attr":
        t = attr_tensor(gm, w.args[0])
        return (t.squeeze(1), [w, w.args[0]]) if t.dim() == 3 and t.shape[1] == 1 else None
    return None


def _adjacent_blocks(xs: list[Node]):
    """(producer, first column, last column) when xs are consecutive column blocks (dim 1) of one split_with_sizes,
    else None."""
    if not all(x.op == "call_function" and x.target is operator.getitem for x in xs):
        return None
    split = xs[0].args[0]
    if not all(x.args[0] is split for x in xs) or not (
            isinstance(split, Node) and split.target == aten.split_with_sizes.default
            and len(split.args) == 3 and split.args[2] == 1):
        return None
    idx = [x.args[1] for x in xs]
    if idx != list(range(idx[0], idx[0] + len(xs))):
        return None
    sizes = split.args[1]
    start = sum(sizes[:idx[0]])
    return split.args[0], start, start + sum(sizes[idx[0]: idx[-1] + 1])


def _runs(convs: list[Node], gm: GraphModule, min_group: int) -> list[list[tuple[Node, torch.Tensor, list[Node]]]]:
    """Runs of convs (sorted by channel offset) whose channel ranges follow each other and that can merge."""
    items = []
    for c in convs:
        w = _weight(gm, c.args[1])
        xv = val_of(c.args[0])
        if w is None or xv is None or xv.dim() != 2 or w[0].shape[0] != xv.shape[1]:
            continue
        items.append((c, *w))
    items.sort(key=lambda it: it[0].args[4])
    runs, cur = [], []
    for it in items:
        if cur:
            prev = cur[-1][0]
            pv, xv = val_of(prev.args[0]), val_of(it[0].args[0])
            if not (prev.args[4] + pv.shape[1] == it[0].args[4] and pv.dtype == xv.dtype
                    and known_equal(pv.shape[0], xv.shape[0]) and cur[-1][1].shape[1] == it[1].shape[1]
                    and cur[-1][1].dtype == it[1].dtype):
                runs.append(cur)
                cur = []
        cur.append(it)
    runs.append(cur)
    return [r for r in runs if len(r) >= min_group]


def _merge(gm: GraphModule, run, fake_mode) -> bool:
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    convs = [c for c, _, _ in run]
    first = min(convs, key=order.__getitem__)
    xs = [c.args[0] for c in convs]
    if max(order[x] for x in xs) > order[first]:
        return False   # an input is made after the first conv: moving the others up would read it early
    weight = torch.cat([w for _, w, _ in run], 0).contiguous()
    w_node = add_constant(gm, "w_short_conv_merged", weight, before=first, fake_mode=fake_mode)
    blocks = _adjacent_blocks(xs)
    with g.inserting_before(first):
        if blocks is not None:
            x = g.call_function(aten.slice.Tensor, (blocks[0], 1, blocks[1], blocks[2]))
        else:
            x = g.call_function(aten.cat.default, (xs, 1))
        set_meta_val(x, fake_mode)
        c0 = convs[0]
        y = g.call_function(SHORT_CONV_PREFILL, (x, w_node, *c0.args[2:4], c0.args[4], *c0.args[5:]))
        set_meta_val(y, fake_mode)
        col = 0
        for c, w, _ in run:
            part = g.call_function(aten.slice.Tensor, (y, 1, col, col + w.shape[0]))
            set_meta_val(part, fake_mode)
            col += w.shape[0]
            replace_uses(c, part, fake_mode)
    old_attrs = [n.target for _, _, nodes in run for n in nodes if n.op == "get_attr"]
    for c in convs:
        g.erase_node(c)   # mutating ops: DCE would keep them
    erase_if_dead(gm, [n for _, _, nodes in run for n in nodes] + xs)
    drop_unused_constants(gm, old_attrs)
    return True


@register_pass("p18_short_conv_merge", ShortConvMergeConfig)
def short_conv_merge(gm: GraphModule, config: ShortConvMergeConfig) -> int:
    """A KDA layer's q/k/v prefill short convs -> one short_conv_prefill over their channels."""
    config.validate()
    groups: dict[tuple, list[Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == SHORT_CONV_PREFILL and isinstance(n.args[4], int):
            a = n.args
            groups[(a[2], a[3], a[5], a[6], a[7])].append(n)
    todo = [r for convs in groups.values() if len(convs) >= config.min_group
            for r in _runs(convs, gm, config.min_group)]
    if not todo:
        return 0
    fake_mode = fake_mode_of(gm)
    return sum(_merge(gm, run, fake_mode) for run in todo)
