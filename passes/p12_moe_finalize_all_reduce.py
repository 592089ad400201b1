"""P12 MoE finalize into the collective's staging: a rank's routing-weighted sum of its expert outputs (+ the
shared experts' partial) is written by one kernel straight into the buffer the all-reduce reduces
(kernels/moe_finalize.py; TensorRT-LLM's MoE-finalize + all-reduce fusion).

Matched in rank graphs, anchored on the expert op (fp32/bf16 experts; after P9 and P11):

    E = k3.moe_experts(x, ids, weights, w13, w2, act, beta, linear_beta)        only user: the next node
    y = E                                                    K3's latent sum, or no shared experts
      | add(E, s) | add(s, E)                                the shared experts' partial s (same shape, dtype)
      | addmm(E, a, t(W))                                    the same after P11 folded the add into s's GEMM
    C = k3.all_reduce(y, role)                               y's only user
      | k3.all_reduce_attn_res_norm[_f32](.., partial=y, ..)  P9's collective (reduces y in place)
 -> rows, slot_rows = k3.moe_expert_rows(x, ids, w13, w2, act, beta, linear_beta)
    C' = k3.moe_finalize_all_reduce(rows, slot_rows, weights, s | None, role)       replaces the all-reduce
       | P9's op with partial = k3.moe_finalize(rows, slot_rows, weights, s | None)

`fuse_shared=False` leaves a layer with a shared partial alone. MXFP4 experts (k3.moe_experts_mxfp4) and
P6's k3.fused_moe_decode are not matched: P6 already does the weighted sum and the shared add in its down
kernel's registers, so in a default decode graph P12 finds nothing; prefill and verify graphs run the
unfused expert op and are where it applies.

Counts per captured graph without P6's op: one per MoE layer of a rank graph (k3-tiny: 8, the latent sums
into k3.all_reduce; kimi-linear-tiny: 5, the MoE outputs into P9's op); whole-model graphs have no
collective: 0.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from k3compile.model_def.ops import library as _model_ops  # noqa: F401  (registers k3.moe_experts)

from .graph_utils import fake_mode_of, is_call, replace_uses, set_meta_val, val_of
from .kernels import all_reduce_norm as _p9  # noqa: F401  (registers P9's ops)
from .kernels import moe_finalize as _kernel  # noqa: F401  (registers the ops this pass emits)
from .registry import PassConfig, register_pass

aten = torch.ops.aten
EXPERTS = torch.ops.k3.moe_experts.default
ALL_REDUCE = torch.ops.k3.all_reduce.default
P9_OPS = (torch.ops.k3.all_reduce_attn_res_norm.default, torch.ops.k3.all_reduce_attn_res_norm_f32.default)
ROWS = torch.ops.k3.moe_expert_rows.default
FINALIZE = torch.ops.k3.moe_finalize.default
FINALIZE_ALL_REDUCE = torch.ops.k3.moe_finalize_all_reduce.default


@dataclass
class MoEFinalizeConfig(PassConfig):
    fuse_shared: bool = True  # the shared experts' partial is added by the finalize kernel too


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _shared_of(experts: Node, y: Node):
    """(kind, operands) of how y adds the shared partial to the routed sum, or None if it is something else."""
    if is_call(y, aten.add.Tensor) and len(y.args) == 2 and not y.kwargs:
        a, b = y.args
        s = b if a is experts else a
        if isinstance(s, Node) and s is not experts:
            sv, ev = val_of(s), val_of(experts)
            if sv is not None and ev is not None and sv.shape == ev.shape and sv.dtype == ev.dtype:
                return "add", s
    if is_call(y, aten.addmm.default) and len(y.args) == 3 and not y.kwargs and y.args[0] is experts:
        return "addmm", y.args[1:]
    return None


def _match(experts: Node):
    """(y, shared form, collective) for an expert op whose weighted sum feeds a collective, else None."""
    y = _only_user(experts)
    if y is None:
        return None
    shared = None
    if not (is_call(y, ALL_REDUCE) or is_call(y, *P9_OPS)):
        shared = _shared_of(experts, y)
        if shared is None:
            return None
        collective = _only_user(y)
    else:
        collective, y = y, experts
    if collective is None or _only_user(y) is not collective:
        return None
    if is_call(collective, ALL_REDUCE) and collective.args[0] is y:
        return y, shared, collective
    if is_call(collective, *P9_OPS) and collective.args[2] is y:
        return y, shared, collective
    return None


@register_pass("p12_moe_finalize_all_reduce", MoEFinalizeConfig)
def moe_finalize_all_reduce(gm: GraphModule, config: MoEFinalizeConfig) -> int:
    """MoE finalize (routing-weighted sum + shared partial) -> written into the all-reduce's buffer."""
    g, fake_mode, matches = gm.graph, None, 0
    for experts in [n for n in g.nodes if is_call(n, EXPERTS)]:
        m = _match(experts)
        if m is None or experts.kwargs:
            continue
        y, shared, collective = m
        if shared is not None and not config.fuse_shared:
            continue
        fake_mode = fake_mode or fake_mode_of(gm)
        x, ids, weights, w13, w2, act, beta, linear_beta = experts.args
        with g.inserting_before(experts):
            rows = g.call_function(ROWS, (x, ids, w13, w2, act, beta, linear_beta))
            out = g.call_function(operator.getitem, (rows, 0))
            slots = g.call_function(operator.getitem, (rows, 1))
        made = [rows, out, slots]
        with g.inserting_before(y if y is not experts else collective):
            if shared is None:
                s = None
            elif shared[0] == "add":
                s = shared[1]
            else:  # P11's addmm(E, a, t(W)): the shared partial is the GEMM without its folded addend
                s = g.call_function(aten.mm.default, tuple(shared[1]))
                made.append(s)
        if is_call(collective, ALL_REDUCE):
            with g.inserting_before(collective):
                fused = g.call_function(FINALIZE_ALL_REDUCE, (out, slots, weights, s, collective.args[1]))
            set_meta_val_all(made + [fused], fake_mode)
            replace_uses(collective, fused, fake_mode)
            g.erase_node(collective)
        else:
            with g.inserting_before(collective):
                fused = g.call_function(FINALIZE, (out, slots, weights, s))
            set_meta_val_all(made + [fused], fake_mode)
            collective.replace_input_with(y, fused)
        if y is not experts:
            g.erase_node(y)
        g.erase_node(experts)
        matches += 1
    return matches


def set_meta_val_all(nodes, fake_mode) -> None:
    for n in nodes:
        set_meta_val(n, fake_mode)
