"""Where each node of a step graph comes from: its op, the model layer it computes, and the pass that made it.

    table = node_provenance(gm)   # {node name: {"op": "aten.mm.default", "layer": "L3", "pass": "p01_gemm_merge"}}

Layer: a weight's name says its layer (`w_model_layers_3_…`, a merged `w_model_layers_3_self_attn__q_proj__…`);
every other node takes the deepest layer among its inputs, so the elementwise tail of layer 3's
attention is layer 3 too. The embedding lookup is "embed", the final norm and lm_head "head",
and index arithmetic on the step inputs alone "inputs". (A norm's statistics before it meets the
layer's norm weight read the previous layer's output and count there: the price of not relying on
module stacks, which the graph file does not keep.)

Pass: the pass manager tags every node a pass creates (`node.meta[PASS_META]`); untagged nodes
are as captured ("capture").
"""
from __future__ import annotations

import re

import torch.fx

from k3compile.capture import PASS_META

CAPTURED = "capture"
EMBED, HEAD, INPUTS = "embed", "head", "inputs"
_LAYER_WEIGHT = re.compile(r"(?:^|_)layers_(\d+)_")
_EMBED_WEIGHT = re.compile(r"embed_tokens")
_RANK_EMBED, _RANK_HEAD = -1, 1 << 30  # head comes after every layer


def layer_label(rank: int | None) -> str:
    if rank is None:
        return INPUTS
    if rank == _RANK_EMBED:
        return EMBED
    if rank == _RANK_HEAD:
        return HEAD
    return f"L{rank}"


def _weight_rank(target: str) -> int:
    m = _LAYER_WEIGHT.search(target)
    if m:
        return int(m.group(1))
    return _RANK_EMBED if _EMBED_WEIGHT.search(target) else _RANK_HEAD


def op_label(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    return getattr(t, "__name__", str(t))


def node_layers(gm: torch.fx.GraphModule) -> dict[str, str]:
    """{node name: layer label} for every node (see the module docstring)."""
    rank: dict[torch.fx.Node, int | None] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            rank[n] = _weight_rank(str(n.target))
        elif n.op == "placeholder":
            rank[n] = None
        else:
            inputs = [rank[a] for a in n.all_input_nodes if rank.get(a) is not None]
            rank[n] = max(inputs) if inputs else None
    return {n.name: layer_label(r) for n, r in rank.items()}


def node_provenance(gm: torch.fx.GraphModule) -> dict[str, dict]:
    """{call node name: {"op", "layer", "pass"}} for the nodes that run ops (call_function)."""
    layers = node_layers(gm)
    return {n.name: {"op": op_label(n), "layer": layers[n.name], "pass": n.meta.get(PASS_META, CAPTURED)}
            for n in gm.graph.nodes if n.op == "call_function"}
