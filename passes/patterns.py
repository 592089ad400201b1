"""Pieces of ATen patterns that several passes match: optional casts and the RMSNorm chain.

`match_rms_norm(out)` recognizes `model_def`'s `RMSNorm` as make_fx leaves it (the fp32 upcast and
the cast back only when the input is not fp32):

    out = mul(weight, [_to_copy](mul(xf, rsqrt(add(mean(pow(xf, 2), [-1], True), eps)))))
    xf  = [_to_copy(x, fp32)]
"""
from __future__ import annotations

import torch
from torch.fx import Node

from .graph_utils import is_call, val_of

aten = torch.ops.aten


class NoMatch(Exception):
    pass


def need(cond) -> None:
    if not cond:
        raise NoMatch


def is_cast(node, dtype=None) -> bool:
    return (is_call(node, aten._to_copy.default) and set(node.kwargs) == {"dtype"}
            and (dtype is None or node.kwargs["dtype"] == dtype) and len(node.args) == 1)


def strip_cast(node: Node, dtype, nodes: list) -> Node:
    """`node` itself, or the input of a `_to_copy(x, dtype)` (recorded in `nodes`)."""
    if is_cast(node, dtype):
        nodes.append(node)
        return node.args[0]
    return node


def rms_chain(xf: Node, normed: Node, nodes: list) -> float:
    """Check normed == mul(xf, rsqrt(add(mean(pow(xf, 2), [-1], True), eps))); returns eps."""
    need(is_call(normed, aten.mul.Tensor) and len(normed.args) == 2)
    a, b = normed.args
    rsqrt = b if a is xf else a if b is xf else None
    need(rsqrt is not None and is_call(rsqrt, aten.rsqrt.default))
    add = rsqrt.args[0]
    need(is_call(add, aten.add.Tensor) and isinstance(add.args[1], float))
    mean = add.args[0]
    need(is_call(mean, aten.mean.dim) and list(mean.args[1]) in ([-1],) and len(mean.args) > 2 and mean.args[2])
    pw = mean.args[0]
    need(is_call(pw, aten.pow.Tensor_Scalar) and pw.args[0] is xf and pw.args[1] == 2)
    nodes += [normed, rsqrt, add, mean, pw]
    return float(add.args[1])


def match_rms_norm(out: Node):
    """The RMSNorm ending in `out = mul(weight, [cast](normed))`; returns (x, weight, eps, nodes)."""
    need(is_call(out, aten.mul.Tensor) and len(out.args) == 2 and not out.kwargs)
    for weight, inner in (out.args, reversed(out.args)):
        if not isinstance(weight, Node) or not isinstance(inner, Node):
            continue
        wv, iv = val_of(weight), val_of(inner)
        if wv is None or iv is None or wv.dim() != 1 or iv.dim() != 2:
            continue
        nodes = [out]
        x_dtype = iv.dtype
        normed = strip_cast(inner, x_dtype, nodes)
        xf = None
        if is_call(normed, aten.mul.Tensor):
            xf = next((a for a in normed.args if isinstance(a, Node) and not is_call(a, aten.rsqrt.default)), None)
        if xf is None:
            continue
        try:
            eps = rms_chain(xf, normed, nodes)
        except NoMatch:
            continue
        x = strip_cast(xf, torch.float32, nodes)
        need(val_of(x).dtype == x_dtype and (x is xf or val_of(xf).dtype == torch.float32))
        need(x_dtype != torch.float32 or x is xf)
        return x, weight, eps, nodes
    raise NoMatch
