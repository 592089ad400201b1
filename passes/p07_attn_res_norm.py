"""P7 AttnRes + RMSNorm: residual add, Block-AttnRes read and the pre-norm that follows become one
`k3::attn_res_norm` node (kernel in `kernels/attn_res_norm.py`).

Matched (the ATen form of `model_def` `attn_res_read` then `RMSNorm`), anchored on the norm's final
weight multiply. Optional casts are shown in brackets (bf16 graphs have them, fp32 graphs do not):

    p      = add(x, delta)                                   the residual add, [N, D]
    S      = stack([*bank, p])            R = [_to_copy(S, fp32)]
    logits = sum(mul(mul(R, rsqrt(add(mean(pow(R, 2), [-1], keepdim), res_eps))), query), [-1])
    mix    = [_to_copy(sum(mul(unsqueeze(_softmax(logits, 0), -1), R), [0]), dtype)]
    h      = mul(weight, [_to_copy](mul(Mf, rsqrt(add(mean(pow(Mf, 2), [-1], keepdim), norm_eps)))))
             with Mf = [_to_copy(mix, fp32)]

and, without AttnRes (Kimi Linear's plain pre-norm residual), the same with mix = p (no stack).
The replacement is `h, p' = k3.attn_res_norm(bank, x, delta, query, weight, res_eps, norm_eps, pdl)`:
users of p take p', users of h take h; `sym_size(S, k)` becomes `sym_size(x, k - 1)`. Where h (not
fp32 itself) is also cast to fp32 (`_to_copy(h, dtype=fp32)`: the MoE router's GEMM input), the node is
`k3.attn_res_norm_f32` instead, whose third output, h's fp32 copy written by the same kernel, replaces
those casts (one copy kernel fewer per MoE layer; `fp32_copy=False` keeps them). Where the residual
add's left side is `zeros_like(...)` read by nothing else (K3 at a block boundary: the finished partial
sum went to the bank and the new one starts from zeros), the node takes `x = delta, delta = None`
(0 + d is d, the kernel copies it into p) and the fill kernel is gone (`fold_zeros=False` keeps it). `query`
(γ ⊙ w, a product of two weights) is folded into one fp32 buffer at build time when it is made of
constants; otherwise its node is passed as is.

Layer 0's first norm reads the embedding output with no residual add before it (`first_norm`): it
becomes the same node with x = the embedding, delta = None (its p output, a copy of x, is unused).

Counts (per captured step, decode and prefill alike since the read is token-local): K3-style
configs (attn_res_block_size set) 2 per layer, minus layer 0's attention-side read (the bank is
empty and no residual add precedes it), plus the final read = 2L, plus that first norm = 2L + 1.
Plain residual: the same 2L + 1 (every pre-norm but layer 0's input norm follows a residual add). Of the K3 ones, ceil(L / block) (the
attention-side read after each block boundary, layer 0's included) take the zeros_like fold. A chain whose intermediates are
read elsewhere, or that differs in any way from the form above, is left alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import (add_constant, attr_tensor, drop_unused_constants, erase_if_dead, erase_subgraph, fake_mode_of,
                          is_call, replace_uses, set_meta_val, val_of)
from .kernels import attn_res_norm as _kernel  # registers torch.ops.k3.attn_res_norm
from .patterns import NoMatch, is_cast, match_rms_norm, need, rms_chain, strip_cast
from .registry import PassConfig, register_pass

aten = torch.ops.aten
FUSED = torch.ops.k3.attn_res_norm.default
FUSED_F32 = torch.ops.k3.attn_res_norm_f32.default  # the same, plus h's fp32 copy


@dataclass
class AttnResNormConfig(PassConfig):
    fold_query: bool = True  # compute γ ⊙ w once at build time when both are weights
    pdl: bool = True  # programmatic dependent launch of the kernel (where kernels/pdl.py allows)
    fp32_copy: bool = True  # h's fp32 casts (the router GEMM's input) written by the kernel, not a copy kernel
    fold_zeros: bool = True  # add(zeros_like(..), d) at block boundaries: p = d in the kernel, no fill kernel
    first_norm: bool = True  # layer 0's norm of the embedding output (no residual add): x = embedding, delta None


def _match_read(mix: Node):
    """The AttnRes softmax mixture producing `mix` (before its cast back); returns (stack, query, eps, nodes)."""
    nodes = [mix]
    need(is_call(mix, aten.sum.dim_IntList) and list(mix.args[1]) == [0] and not (len(mix.args) > 2 and mix.args[2]))
    weighted = mix.args[0]
    need(is_call(weighted, aten.mul.Tensor))
    unsq, r = weighted.args
    if not is_call(unsq, aten.unsqueeze.default):
        unsq, r = r, unsq
    need(is_call(unsq, aten.unsqueeze.default) and unsq.args[1] in (-1, 2))
    soft = unsq.args[0]
    need(is_call(soft, aten._softmax.default) and soft.args[1] == 0 and soft.args[2] is False)
    logits = soft.args[0]
    need(is_call(logits, aten.sum.dim_IntList) and list(logits.args[1]) == [-1]
          and not (len(logits.args) > 2 and logits.args[2]))
    scored = logits.args[0]
    need(is_call(scored, aten.mul.Tensor))
    nodes += [weighted, unsq, soft, logits, scored]
    for normed, query in (scored.args, reversed(scored.args)):
        if not isinstance(normed, Node) or not isinstance(query, Node):
            continue
        sub = []
        try:
            eps = rms_chain(r, normed, sub)
        except NoMatch:
            continue
        qv = val_of(query)
        need(qv is not None and qv.dim() == 1 and qv.dtype == torch.float32)
        nodes += sub
        stack = strip_cast(r, torch.float32, nodes)
        need(is_call(stack, aten.stack.default) and (len(stack.args) == 1 or stack.args[1] == 0))
        need(stack is r or val_of(r).dtype == torch.float32)
        return stack, query, eps, nodes
    raise NoMatch


def _const_value(gm: GraphModule, node: Node):
    """Evaluate `node` if it is computed from weights only (get_attr + pure aten ops), else None."""
    if node.op == "get_attr":
        return attr_tensor(gm, node)
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target._schema.is_mutable:
        return None
    args = []
    for a in node.args:
        if isinstance(a, Node):
            v = _const_value(gm, a)
            if v is None:
                return None
            args.append(v)
        else:
            args.append(a)
    return node.target(*args, **node.kwargs)


def _match(out: Node, first_norm: bool = True):
    x, weight, norm_eps, nodes = match_rms_norm(out)
    mix_in = x
    bank, query, res_eps, stack = [], None, 0.0, None
    if first_norm and is_call(x, aten.embedding.default):  # layer 0's norm of the embedded tokens: no add before
        xv, ov = val_of(x), val_of(out)
        need(xv.dim() == 2 and ov is not None and ov.shape == xv.shape)
        inner = set(nodes) - {out}
        for n in inner:
            need(all(u in inner or u is out for u in n.users))
        return dict(nodes=inner | {out}, stack=None, bank=[], x=x, delta=None, p=None, query=None, weight=weight,
                    res_eps=0.0, norm_eps=norm_eps, out=out)
    if not is_call(x, aten.add.Tensor):  # an AttnRes read: [cast back](sum(...))
        pre = strip_cast(x, None, nodes)
        need(pre is not x or val_of(x).dtype == torch.float32)
        stack, query, res_eps, read_nodes = _match_read(pre)
        nodes += read_nodes
        rows = list(stack.args[0])
        need(len(rows) >= 2)
        bank, p = rows[:-1], rows[-1]
        need(all(isinstance(b, Node) for b in bank))
    else:
        p = mix_in
    need(is_call(p, aten.add.Tensor) and len(p.args) == 2 and not p.kwargs)
    a, d = p.args
    need(isinstance(a, Node) and isinstance(d, Node))
    pv, av, dv = val_of(p), val_of(a), val_of(d)
    need(pv.dim() == 2 and av.shape == pv.shape and dv.shape == pv.shape and av.dtype == dv.dtype == pv.dtype)
    for b in bank:
        bv = val_of(b)
        need(bv is not None and bv.shape == pv.shape and bv.dtype == pv.dtype)
    need(len(bank) <= _kernel.MAX_BANK)
    inner = set(nodes) - {out}
    if stack is not None:
        inner.add(stack)
    # everything but p and h must be private to the pattern (a stack's sym_size users are rewired)
    for n in inner:
        for u in n.users:
            need(u in inner or u is out or (n is stack and is_call(u, aten.sym_size.int)))
    return dict(nodes=inner | {out}, stack=stack, bank=bank, x=a, delta=d, p=p, query=query, weight=weight,
                res_eps=res_eps, norm_eps=norm_eps, out=out)


@register_pass("p07_attn_res_norm", AttnResNormConfig)
def attn_res_norm(gm: GraphModule, config: AttnResNormConfig) -> int:
    """residual add + AttnRes read (softmax over the bank) + RMSNorm -> one k3.attn_res_norm node."""
    matches, fake_mode, dropped_weights = 0, None, []
    g = gm.graph
    for out in [n for n in g.nodes if is_call(n, aten.mul.Tensor)]:
        if out.graph is not g or getattr(out, "_erased", False):
            continue
        try:
            m = _match(out, config.first_norm)
        except NoMatch:
            continue
        fake_mode = fake_mode or fake_mode_of(gm)
        order = {n: i for i, n in enumerate(g.nodes)}
        anchor = min(m["nodes"], key=order.__getitem__)  # the fused node takes the pattern's first slot
        # p's other users must all come after it, or rewiring them would break the order
        if m["p"] is not None and any(order[u] < order[anchor] for u in m["p"].users if u not in m["nodes"]):
            continue
        query = m["query"]
        if query is not None and config.fold_query:
            value = _const_value(gm, query)
            if value is not None:
                query = add_constant(gm, f"{m['weight'].name}_attn_res_query", value.detach().float().contiguous(),
                                     anchor, fake_mode)
        if not all(_hoistable(n, anchor, order) for n in (m["weight"], query) if n is not None):
            continue
        for n in (m["weight"], query):
            if n is not None:
                _hoist(n, anchor, order)
        # fp32 casts of h (the MoE router's GEMM input): the kernel writes that copy too
        casts = [u for u in m["out"].users if is_cast(u, torch.float32)] if config.fp32_copy else []
        if val_of(m["out"]) is None or val_of(m["out"]).dtype == torch.float32:
            casts = []
        x, delta, zeros = m["x"], m["delta"], None
        if config.fold_zeros and is_call(x, aten.zeros_like.default) and set(x.users) == {m["p"]}:
            x, delta, zeros = m["delta"], None, m["x"]  # p = 0 + d = d
        with g.inserting_before(anchor):
            fused = g.call_function(FUSED_F32 if casts else FUSED, (
                list(m["bank"]), x, delta, query, m["weight"], m["res_eps"], m["norm_eps"],
                bool(config.pdl)))
            h = g.call_function(operator.getitem, (fused, 0))
            p = g.call_function(operator.getitem, (fused, 1))
            h32 = g.call_function(operator.getitem, (fused, 2)) if casts else None
        for n in (fused, h, p, h32):
            if n is not None:
                set_meta_val(n, fake_mode)
        for cast in casts:
            replace_uses(cast, h32, fake_mode)
            g.erase_node(cast)
        replace_uses(m["out"], h, fake_mode)
        stack = m["stack"]
        if stack is not None:
            for u in [u for u in stack.users if is_call(u, aten.sym_size.int)]:
                dim = u.args[1] if u.args[1] >= 0 else u.args[1] + 3
                if dim < 1:
                    raise RuntimeError("p07: sym_size over the stacked rows' axis cannot be rewired")
                u.args = (x, dim - 1)  # the stack's row dims are x's dims
        if m["p"] is not None:  # the first norm has no residual sum: its users keep reading the embedding
            for u in [u for u in m["p"].users if u not in m["nodes"]]:
                u.replace_input_with(m["p"], p)
        erase_subgraph(gm, m["nodes"] | ({m["p"]} if m["p"] is not None else set()))
        if zeros is not None:
            erase_if_dead(gm, [zeros])
        dropped_weights += _erase_dead_query(gm, m["query"], query)
        matches += 1
    drop_unused_constants(gm, dropped_weights)  # the folded γ and w are not engine weights any more
    return matches


def _hoistable(node: Node, anchor: Node, order: dict) -> bool:
    """Defined before `anchor` already, or a pure chain over weights that can move there."""
    if order.get(node, -1) < order[anchor]:
        return True
    if node.op == "get_attr":
        return True
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and not node.target._schema.is_mutable
            and all(_hoistable(a, anchor, order) for a in node.all_input_nodes))


def _hoist(node: Node, anchor: Node, order: dict) -> None:
    if order.get(node, -1) < order[anchor]:
        return
    for a in node.all_input_nodes:
        _hoist(a, anchor, order)
    anchor.prepend(node)
    order[node] = order[anchor] - 0.5


def _erase_dead_query(gm: GraphModule, old: Node | None, new: Node | None) -> list[str]:
    """After folding, the query's constant chain (views/casts/mul of weights) is dead: erase it and
    return the weight names it read."""
    if old is None or old is new:
        return []
    todo, seen = [old], []
    while todo:
        n = todo.pop()
        if n in seen or n.op not in ("call_function", "get_attr"):
            continue
        seen.append(n)
        todo += [a for a in n.all_input_nodes]
    erase_if_dead(gm, seen)
    return [n.target for n in seen if n.op == "get_attr"]
