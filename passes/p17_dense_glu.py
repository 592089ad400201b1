"""P17 dense GLU: the dense MLP's activation chain (K3's SiTU-GLU: 12 ATen kernels a bf16 step; Kimi Linear's
SiLU-GLU: 2) becomes one `k3::glu_act` kernel (`kernels/glu_act.py`). In a K3 decode step after P1-P16 it is the
first (dense) layer's whole elementwise tail: 11 of its 19 launches.

Matched, anchored on each `tanh` / `silu` (make_fx's spelling of `model_def.ops.moe_math.glu_act`; [cast] only
where the operand is not fp32, mul operands in either order):

    situ: out = [_to_copy(dtype of G)](mul(mul(mul(tanh(div(g, b)), b), sigmoid(g)),
                                           mul(tanh(div(u, lb)), lb)))         g = [_to_copy(G, fp32)], u likewise
    silu: out = mul(silu(G), U)

-> `out = k3.glu_act(G, U, act, b, lb)` (silu: b = lb = 0). Every intermediate must be read inside the chain only;
G and U any nodes of one shape [N, I] and dtype (P1's merged gate/up GEMM's column blocks, or two GEMMs). The
MoE's expert activations are inside P6's kernels already, so only the dense MLP matches.

Counts: one per dense MLP (K3 presets: the first layer; Kimi Linear: the first layer), in every graph mode; 0 and
the graph unchanged where nothing matches. Numerics: on CPU the op is `glu_act` itself (bit-identical); the
Triton kernel computes the same fp32 expression once (exp-based tanh) and rounds once (situ), or rounds silu first
as ATen does (silu). On by default for both (measured on the whole engine: K3's SiTU in traces/h200_s12/call4, Kimi
Linear's silu + mul in traces/h200_s13/call1); `acts=situ` keeps silu + mul as ATen ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import erase_subgraph, fake_mode_of, is_call, replace_uses, set_meta_val, val_of
from .kernels import glu_act as _kernel  # noqa: F401  (registers torch.ops.k3.glu_act)
from .patterns import NoMatch, is_cast, need
from .registry import PassConfig, PassConfigError, register_pass

aten = torch.ops.aten
GLU_ACT = torch.ops.k3.glu_act.default


@dataclass
class DenseGluConfig(PassConfig):
    # k3-mini-6b batch 1, whole step with P15's gate_out and q_norm_gemv (traces/h200_s12/call4, same run): 1.911 ->
    # 1.891 ms alone, 1.833 with both; 11 launches less per K3 step
    enabled: bool = True
    # the activations fused: "situ" (K3's chain, 12 ATen kernels), "silu" (Kimi Linear's silu + mul, 2 kernels: one
    # launch less per step; 48B 2.247 -> 2.238 ms at batch 1, traces/h200_s13/call1)
    acts: str = "situ,silu"  # or "situ+silu" ("+" fits a `bench ladder --variant` string); "situ" or "silu" alone

    def act_set(self) -> set[str]:
        return {a.strip() for a in self.acts.replace("+", ",").split(",") if a.strip()}

    def validate(self) -> None:
        bad = sorted(self.act_set() - {"situ", "silu"})
        if bad:
            raise PassConfigError(f"p17_dense_glu.acts: unknown activations {bad}; known situ, silu")


def _other(mul: Node, one) -> object:
    """mul(a, b)'s operand that is not `one` (scalar or node); raises NoMatch if neither is."""
    need(is_call(mul, aten.mul.Tensor) and len(mul.args) == 2 and not mul.kwargs)
    a, b = mul.args
    need(a is one or b is one)
    return b if a is one else a


def _scaled_tanh(tanh: Node, nodes: list) -> tuple[Node, float, Node]:
    """tanh(div(x, s)) followed by mul(., s): (x, s, the mul)."""
    div = tanh.args[0]
    need(is_call(div, aten.div.Tensor) and isinstance(div.args[1], float) and len(tanh.users) == 1)
    s = div.args[1]
    mul = next(iter(tanh.users))
    need(_other(mul, tanh) == s)
    nodes += [div, tanh, mul]
    return div.args[0], s, mul


def _source(x: Node, nodes: list) -> Node:
    """G for g = [_to_copy(G, fp32)] (the cast recorded in nodes)."""
    if is_cast(x, torch.float32):
        nodes.append(x)
        return x.args[0]
    return x


def _match_situ(tanh: Node):
    """(G, U, beta, linear_beta, out, nodes) if `tanh` is the gate's tanh of a SiTU-GLU chain."""
    nodes: list = []
    g, beta, scaled_g = _scaled_tanh(tanh, nodes)
    need(len(scaled_g.users) == 1)
    gated = next(iter(scaled_g.users))
    sig = _other(gated, scaled_g)
    need(is_call(sig, aten.sigmoid.default) and sig.args[0] is g and len(sig.users) == 1)
    need(len(gated.users) == 1)
    prod = next(iter(gated.users))
    scaled_u = _other(prod, gated)
    need(isinstance(scaled_u, Node) and is_call(scaled_u, aten.mul.Tensor))
    tanh_u = next((a for a in scaled_u.args if is_call(a, aten.tanh.default)), None)
    need(tanh_u is not None)
    u, linear_beta, mul_u = _scaled_tanh(tanh_u, nodes)
    need(mul_u is scaled_u)
    nodes += [sig, gated, prod]
    out = prod
    gate, up = _source(g, nodes), _source(u, nodes)
    gv, uv = val_of(gate), val_of(up)
    need(gv is not None and uv is not None and gv.dim() == 2 and gv.dtype == uv.dtype and gv.shape == uv.shape)
    if gv.dtype != torch.float32:
        need(len(prod.users) == 1 and is_cast(next(iter(prod.users)), gv.dtype))
        out = next(iter(prod.users))
        nodes.append(out)
    need(val_of(prod).dtype == torch.float32)
    return gate, up, float(beta), float(linear_beta), out, nodes


def _match_silu(silu: Node):
    need(len(silu.users) == 1)
    mul = next(iter(silu.users))
    up = _other(mul, silu)
    gate = silu.args[0]
    need(isinstance(up, Node) and isinstance(gate, Node))
    gv, uv, ov = val_of(gate), val_of(up), val_of(mul)
    need(gv is not None and uv is not None and gv.dim() == 2 and gv.shape == uv.shape == ov.shape)
    need(gv.dtype == uv.dtype == ov.dtype)
    return gate, up, 0.0, 0.0, mul, [silu, mul]


def _private(nodes: list, out: Node) -> None:
    inside = set(nodes)
    for n in inside - {out}:
        need(all(u in inside for u in n.users))


@register_pass("p17_dense_glu", DenseGluConfig)
def dense_glu(gm: GraphModule, config: DenseGluConfig) -> int:
    """The dense MLP's GLU activation chain -> one k3.glu_act."""
    g = gm.graph
    fake_mode = None
    matches = 0
    config.validate()
    acts = config.act_set()
    anchors = [(n, "situ") for n in g.nodes if "situ" in acts and is_call(n, aten.tanh.default)]
    anchors += [(n, "silu") for n in g.nodes if "silu" in acts and is_call(n, aten.silu.default)]
    done: set = set()
    for anchor, act in anchors:
        if anchor in done:
            continue
        try:
            gate, up, beta, linear_beta, out, nodes = (_match_situ if act == "situ" else _match_silu)(anchor)
            _private(nodes, out)
        except NoMatch:
            continue
        order = {n: i for i, n in enumerate(g.nodes)}
        if max(order[gate], order[up]) > order[out]:
            continue
        fake_mode = fake_mode or fake_mode_of(gm)
        with g.inserting_before(out):
            new = g.call_function(GLU_ACT, (gate, up, act, beta, linear_beta))
        set_meta_val(new, fake_mode)
        replace_uses(out, new, fake_mode)
        done.update(nodes)
        erase_subgraph(gm, nodes)
        matches += 1
    return matches
