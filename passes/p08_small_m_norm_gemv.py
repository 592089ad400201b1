"""P7's norm in the prologue of P8's GEMV: a plain pre-norm whose normed rows feed exactly one k3.gemv becomes one
`k3::norm_gemv` node (kernel in `kernels/norm_gemv.py`).

Matched (after P7 and P8, in any graph that has k3.gemv: P8 makes them in decode graphs only), anchored on P7's
node:

    h, p = k3.attn_res_norm([], x, delta, None, norm_weight, res_eps, norm_eps, pdl)    no AttnRes bank
    y    = k3.gemv(h, W, c, max_m, block_n, block_k, split_k, design, use_pdl, num_warps)
           h read by nothing else (one getitem, one user: this gemv's x); c None or defined before P7's node

and replaced by `y, p = k3.norm_gemv(x, delta, norm_weight, norm_eps, W, c, <the gemv's tuned configuration>,
max_tokens)`: users of y and p keep reading them; h is never stored. The fused kernel runs at T <= min(max_m,
max_tokens) rows, the pair above that (so rows past the GEMV's reach still run cuBLAS). A node whose delta (or x)
is a `k3.all_reduce` is left to P9, as is a norm with a bank (K3's AttnRes read: the fused prologue recomputes
only a row's RMS) or an fp32 copy (P7's `_f32` op, the router's input), or anything else off the form above.

Counts: one per norm feeding a GEMV that P8 turned into k3.gemv (at the 48B shape the KDA in_proj, MLA input
GEMM and the dense MLP's gate/up; P8's choice="gemv" takes every one: the tests' count), 0 without k3.gemv.
Numerics: on CPU and past max_tokens the same references / kernels as the pair (bit-identical); where the kernel
runs, norm-then-GEMV up to the GEMV's fp32 accumulation (kernels/norm_gemv.py).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import fake_mode_of, getitem_outputs, is_call, set_meta_val
from .kernels import gemv as gemv_kernels
from .kernels import norm_gemv as _kernel  # noqa: F401  (registers torch.ops.k3.norm_gemv)
from .registry import PassConfig, PassConfigError, register_pass

NORM = torch.ops.k3.attn_res_norm.default
GEMV = torch.ops.k3.gemv.default
FUSED = torch.ops.k3.norm_gemv.default
ALL_REDUCE = torch.ops.k3.all_reduce.default if hasattr(torch.ops.k3, "all_reduce") else None


@dataclass
class NormGemvConfig(PassConfig):
    # Off by default: on the H200 the whole 48B step was SLOWER with it, batch 1 2.298 vs 2.242 ms, batch 8 7.046 vs
    # 7.042 (session 9, traces/h200_s9/call2: bench ladder --variant nonormgemv, interleaved, 28 fewer kernels per
    # step). Every program re-reading and re-normalizing the row costs more than the launch it saves behind PDL.
    enabled: bool = False
    # rows up to which the fused kernel runs (and the GEMV's own max_m); above, P7's kernel then the GEMV
    max_tokens: int = gemv_kernels.MAX_M

    def validate(self) -> None:
        if not 0 <= self.max_tokens <= gemv_kernels.MAX_M:
            raise PassConfigError(f"p08_small_m_norm_gemv.max_tokens must be in 0..{gemv_kernels.MAX_M}, "
                                  f"got {self.max_tokens}")


def _match(norm: Node, order: dict):
    """(gemv node, norm outputs) when `norm` feeds one k3.gemv as the docstring says, else None."""
    if norm.kwargs or len(norm.args) != 8:
        return None
    bank, x, delta, query = norm.args[:4]
    if bank or query is not None:
        return None
    if ALL_REDUCE is not None and any(is_call(a, ALL_REDUCE) for a in (x, delta)):
        return None  # P9 fuses the collective with this norm
    outs = getitem_outputs(norm)
    h = outs.get(0)
    if h is None or len(h.users) != 1:
        return None
    gemv = next(iter(h.users))
    if not is_call(gemv, GEMV) or gemv.kwargs or gemv.args[0] is not h or h in gemv.args[1:]:
        return None
    w, c, max_m = gemv.args[1], gemv.args[2], gemv.args[3]
    if not max_m > 0 or not isinstance(w, Node):
        return None
    if c is not None and (not isinstance(c, Node) or order[c] > order[norm]):
        return None  # c (a residual P11 folded) must exist where the fused node goes
    if w.op != "get_attr" and order[w] > order[norm]:
        return None
    return gemv, outs


@register_pass("p08_small_m_norm_gemv", NormGemvConfig)
def small_m_norm_gemv(gm: GraphModule, config: NormGemvConfig) -> int:
    """k3.attn_res_norm (no bank) whose h only feeds a k3.gemv -> one k3.norm_gemv (norm in the GEMV's prologue)."""
    config.validate()
    g = gm.graph
    matches, fake_mode = 0, None
    order = {n: i for i, n in enumerate(g.nodes)}
    for norm in [n for n in g.nodes if is_call(n, NORM)]:
        m = _match(norm, order)
        if m is None:
            continue
        gemv, outs = m
        fake_mode = fake_mode or fake_mode_of(gm)
        _, x, delta, _, norm_w, _, norm_eps, _ = norm.args
        _, w, c, *cfg = gemv.args  # max_m, block_n, block_k, split_k, design, use_pdl, num_warps[, l2_prefetch_kb]
        cfg = cfg + [gemv_kernels.DESIGNS["dot"], False, 4][len(cfg) - 4:]  # an engine's older 7-arg gemv
        cfg = cfg[:7]  # the norm's prologue kernel has no L2 prefetch: the fused launch goes without it
        if order[w] > order[norm]:
            norm.prepend(w)  # a weight read (get_attr): it may move before the fused node
        with g.inserting_before(norm):
            fused = g.call_function(FUSED, (x, delta, norm_w, norm_eps, w, c, *cfg, int(config.max_tokens)))
            y = g.call_function(operator.getitem, (fused, 0))
            p = g.call_function(operator.getitem, (fused, 1))
        for n in (fused, y, p):
            set_meta_val(n, fake_mode)
        gemv.replace_all_uses_with(y)
        if outs.get(1) is not None:
            outs[1].replace_all_uses_with(p)
        for node in (gemv, outs[0], outs.get(1), norm):
            if node is not None:
                g.erase_node(node)
        if not p.users:  # P7's first norm (p = the embedding): nobody reads p
            g.erase_node(p)
        matches += 1
    return matches
