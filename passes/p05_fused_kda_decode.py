"""P5 fused KDA decode: each KDA layer's decode chain after its input GEMM becomes one `k3::fused_kda_decode`.

Matched (the ATen form of `KDAMixer.forward` in decode mode), anchored on `k3.kda_decode`:

    q/k/v   = view(k3.short_conv_decode(x_s, w_s, conv, layer, s * C, slots), [B, H, K])   s = 0, 1, 2
    g       = K3:          mul(sigmoid(mul(view(exp(A_log), [-1, 1]), xf)), lower_bound)
              Kimi Linear: mul(neg(view(exp(A_log), [-1, 1])), softplus(xf, 1, 20))
              xf = view(add(f, dt_bias), [B, H, K])
    beta    = sigmoid(b)
    o       = k3.kda_decode(q, k, v, g, beta, ssm, layer, slots)
    out     = [cast](mul(mul(mul(o', rsqrt(add(mean(pow(o', 2), -1, keepdim), eps))), w_norm), sigmoid(gate)))
              o' = o or its fp32 cast

where any operand may sit behind a cast to fp32 (bf16 graphs; the fused op upcasts itself), and is
replaced by `out = k3.fused_kda_decode(x_q, x_k, x_v, w_q, w_k, w_v, f, dt_bias, A_log, b, gate,
w_norm, conv, ssm, layer, slots, lower_bound | None, eps, f_b, g_b, use_pdl, prefetch, launch[, early_release])`. With
`absorb_low_rank` (default), an `f` that is `mm(f_a, t(W_fb))` (f_b_proj) and a `gate` that is
`view(mm(g_a, t(W_gb)), [B, H, V])` (Kimi Linear's g_b_proj) enter the op as their low-rank inputs
and weights, so the kernel does those GEMVs too at small batch. Only decode graphs have
`kda_decode` (prefill calls `kda_prefill`), so prefill is never touched. A chain whose intermediates
are read elsewhere, whose conv offsets or layer indices differ from the model's layout, or that
deviates from the form above (other constants, other reduction dims) is left alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, LAYOUTS

from .graph_utils import erase_subgraph, fake_mode_of, is_call, known_equal, replace_uses, set_meta_val, val_of
from .patterns import NoMatch, is_cast, need, rms_chain, strip_cast
from .kernels import kda_decode  # noqa: F401  (registers torch.ops.k3.fused_kda_decode)
from .registry import PassConfig, PassConfigError, register_pass

aten = torch.ops.aten
_SHORT_CONV = torch.ops.k3.short_conv_decode.default
_KDA_DECODE = torch.ops.k3.kda_decode.default
_SOFTPLUS = (1.0, kda_decode.SOFTPLUS_THRESHOLD)  # (beta, threshold) the kernel computes


@dataclass
class FusedKDADecodeConfig(PassConfig):
    # programmatic dependent launch (where kernels/pdl.py says the GPU and Triton have it): the kernel's
    # prologue overlaps the previous kernel's tail; False launches it plainly
    use_pdl: bool = True
    # with PDL, load everything the previous kernel does not write (slot, conv windows, the first fp32 state
    # block, all weights) before gdc_wait; False waits first (the schedule before; kept for the bench)
    prefetch: bool = True
    absorb_low_rank: bool = True  # take f_b_proj / g_b_proj (mm of a low-rank input) into the fused op
    # the kernel's launch layout per batch size (V split, state block width, warps): a name in
    # model_def/ops/kda_launch.py.LAYOUTS, recorded in each op. P16's `launch` must name the same layout
    # (its verify inputs, and the fold, reproduce this kernel's reductions bit for bit)
    launch: str = DEFAULT_LAYOUT
    # with PDL, release the next kernel (the out-projection) right after the wait, not after the state loop, so it
    # loads its weights while the recurrence runs; recorded as the op's last argument only when set. 48B batch 1,
    # whole step (traces/h200_s12): 2.160 -> 2.148 ms alone (call 1); with P6's early_release 2.178 -> 2.121 (call 2)
    early_release: bool = True

    def validate(self) -> None:
        if self.launch not in LAYOUTS:
            raise PassConfigError(f"p05_fused_kda_decode: launch must be one of {', '.join(LAYOUTS)}, "
                                  f"got {self.launch!r}")


class _Pattern:
    """The nodes a match will erase; `take` follows a node into the pattern."""

    def __init__(self, absorb_low_rank: bool):
        self.nodes: list[Node] = []
        self.absorb_low_rank = absorb_low_rank

    def take(self, node, *targets) -> Node:
        need(is_call(node, *targets))
        self.nodes.append(node)
        return node

    def upcast(self, node: Node) -> Node:
        """Skip a `_to_copy(x, dtype=fp32)` of a float tensor (taking it into the pattern)."""
        src = val_of(node.args[0]) if is_cast(node, torch.float32) else None
        return strip_cast(node, torch.float32, self.nodes) if src is not None and src.dtype.is_floating_point else node


def _low_rank(p: _Pattern, node: Node):
    """`mm(x, t(W))` read only by the pattern -> (x, W), taking mm and t in; None if `node` is not that."""
    if not (is_call(node, aten.mm.default) and is_call(node.args[1], aten.t.default)) or len(node.users) != 1:
        return None
    t = node.args[1]
    w = val_of(t.args[0]) if isinstance(t.args[0], Node) else None
    if len(t.users) != 1 or w is None or w.dim() != 2:
        return None
    p.nodes += [node, t]
    return node.args[0], t.args[0]


def _scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _split_mul(node: Node) -> tuple[Node, Node]:
    need(len(node.args) == 2 and not node.kwargs)
    return node.args


def _tensor(node, dims: int) -> torch.Tensor:
    need(isinstance(node, Node))
    v = val_of(node)
    need(v is not None and v.dim() == dims and v.dtype.is_floating_point)
    return v


def _match_decay_scale(p: _Pattern, node: Node, heads: int) -> Node:
    """view(exp(A_log), [-1, 1]) -> A_log (before any fp32 cast)."""
    view = p.take(node, aten.view.default)
    need(list(view.args[1]) == [-1, 1])
    a_log = p.upcast(p.take(view.args[0], aten.exp.default).args[0])
    need(_tensor(a_log, 1).shape[0] == heads)
    return a_log


def _match_forget(p: _Pattern, node: Node, batch, heads: int, head_dim: int) -> tuple:
    """view(add(f, dt_bias), [B, H, K]) -> (f, dt_bias, f_b weight or None)."""
    view = p.take(node, aten.view.default)
    need(len(view.args[1]) == 3 and list(view.args[1])[1:] == [heads, head_dim])
    add = p.take(view.args[0], aten.add.Tensor)
    need(len(add.args) == 2 and not add.kwargs and all(isinstance(a, Node) for a in add.args))
    f, dt = (p.upcast(a) for a in add.args)
    if val_of(f) is not None and val_of(f).dim() == 1:
        f, dt = dt, f
    fv, dv = _tensor(f, 2), _tensor(dt, 1)
    c = heads * head_dim
    need(known_equal(fv.shape[0], batch) and fv.shape[1] == c and dv.shape[0] == c)
    low_rank = _low_rank(p, f) if p.absorb_low_rank else None
    return (*low_rank, dt) if low_rank else (f, None, dt)


def _match_gate(p: _Pattern, g: Node, batch, heads: int, head_dim: int, match_forget=None):
    """The log-decay chain -> (f, f_b weight or None, dt_bias, A_log, lower_bound or None).
    `match_forget` (default `_match_forget`) reads xf; P16 passes one that also takes P11's addmm form."""
    match_forget = match_forget or _match_forget
    mul = p.take(g, aten.mul.Tensor)
    a, b = _split_mul(mul)
    if _scalar(a) or _scalar(b):  # K3: lower_bound * sigmoid(exp(A_log) * x)
        sig, lower_bound = (b, a) if _scalar(a) else (a, b)
        inner = p.take(p.take(sig, aten.sigmoid.default).args[0], aten.mul.Tensor)
        x, y = _split_mul(inner)
        need(isinstance(x, Node) and isinstance(y, Node))
        scale_node, forget = (x, y) if is_call(x, aten.view.default) and is_call(x.args[0], aten.exp.default) \
            else (y, x)
        a_log = _match_decay_scale(p, scale_node, heads)
        f, f_b, dt = match_forget(p, forget, batch, heads, head_dim)
        return f, f_b, dt, a_log, float(lower_bound)
    # Kimi Linear: -exp(A_log) * softplus(x)
    neg, sp = (a, b) if is_call(a, aten.neg.default) else (b, a)
    a_log = _match_decay_scale(p, p.take(neg, aten.neg.default).args[0], heads)
    p.take(sp, aten.softplus.default)
    beta_thr = tuple(sp.args[1:]) + (1.0, 20.0)[len(sp.args) - 1:]
    need(not sp.kwargs and beta_thr == _SOFTPLUS)
    f, f_b, dt = match_forget(p, sp.args[0], batch, heads, head_dim)
    return f, f_b, dt, a_log, None


def _match_convs(p: _Pattern, kda: Node, heads: int, head_dim: int):
    """q, k, v arguments -> ((x_q, x_k, x_v), (w_q, w_k, w_v), conv pool)."""
    xs, ws, convs = [], [], []
    for stream, arg in enumerate(kda.args[:3]):
        view = p.take(arg, aten.view.default)
        need(list(view.args[1])[1:] == [heads, head_dim])
        conv = p.take(view.args[0], _SHORT_CONV)
        x, w, pool, layer, offset, slots = conv.args
        need(offset == stream * heads * head_dim and layer == kda.args[6] and slots is kda.args[7])
        xs.append(x)
        ws.append(w)
        convs.append(pool)
    need(convs[0] is convs[1] is convs[2])
    return xs, ws, convs[0]


def _match_norm(p: _Pattern, kda: Node, heads: int, head_dim: int):
    """The gated RMSNorm after kda_decode -> (end node, norm weight, gate, g_b weight or None, eps)."""
    out_dtype = val_of(kda).dtype
    o = kda
    if len(kda.users) == 1:
        o = p.take(next(iter(kda.users)), aten._to_copy.default)
        need(o.kwargs == {"dtype": torch.float32} and len(o.args) == 1)
    need(len(o.users) == 2)
    normed = [u for u in o.users if is_call(u, aten.mul.Tensor)]
    need(len(normed) == 1)
    normed = normed[0]
    eps = rms_chain(o, normed, p.nodes)
    need(len(normed.users) == 1)
    scaled = p.take(next(iter(normed.users)), aten.mul.Tensor)
    a, b = _split_mul(scaled)
    weight = p.upcast(b if a is normed else a)
    need(normed in (a, b) and tuple(_tensor(weight, 1).shape) == (head_dim,))
    need(len(scaled.users) == 1)
    gated = p.take(next(iter(scaled.users)), aten.mul.Tensor)
    a, b = _split_mul(gated)
    need(scaled in (a, b))
    sig = p.take(b if a is scaled else a, aten.sigmoid.default)
    gate = p.upcast(sig.args[0])
    gv = _tensor(gate, 3)
    need(known_equal(gv.shape[0], val_of(kda).shape[0]) and tuple(gv.shape[1:]) == (heads, head_dim))
    g_b = None
    if p.absorb_low_rank and is_call(gate, aten.view.default) and len(gate.users) == 1:
        low_rank = _low_rank(p, gate.args[0])
        if low_rank:  # Kimi Linear's g_b_proj
            p.nodes.append(gate)
            gate, g_b = low_rank
    end = gated
    if val_of(gated).dtype != out_dtype:
        need(len(gated.users) == 1)
        end = p.take(next(iter(gated.users)), aten._to_copy.default)
        need(end.kwargs == {"dtype": out_dtype} and len(end.args) == 1)
    need(val_of(end).dtype == out_dtype)
    return end, weight, gate, g_b, eps


def _match(kda: Node, absorb_low_rank: bool):
    p = _Pattern(absorb_low_rank)
    p.nodes.append(kda)
    q, _, v, g, beta, ssm, layer, slots = kda.args
    qv = val_of(q)
    need(qv is not None and qv.dim() == 3 and isinstance(qv.shape[1], int) and isinstance(qv.shape[2], int))
    batch, heads, head_dim = qv.shape
    need(tuple(val_of(v).shape[1:]) == (heads, head_dim))
    xs, ws, conv = _match_convs(p, kda, heads, head_dim)
    f, f_b, dt, a_log, lower_bound = _match_gate(p, g, batch, heads, head_dim)
    b = p.upcast(p.take(beta, aten.sigmoid.default).args[0])
    bv = _tensor(b, 2)
    need(known_equal(bv.shape[0], batch) and bv.shape[1] == heads)
    end, weight, gate, g_b, eps = _match_norm(p, kda, heads, head_dim)
    for n in p.nodes:
        if n is not end:
            need(all(u in p.nodes for u in n.users))
    args = (*xs, *ws, f, dt, a_log, b, gate, weight, conv, ssm, layer, slots, lower_bound, eps, f_b, g_b)
    return p.nodes, end, args


@register_pass("p05_fused_kda_decode", FusedKDADecodeConfig)
def fused_kda_decode(gm: GraphModule, config: FusedKDADecodeConfig) -> int:
    """short convs + gates + L2 norms + recurrence + gated RMSNorm of a KDA decode layer -> one k3.fused_kda_decode."""
    matches, fake_mode = 0, None
    for kda in [n for n in gm.graph.nodes if is_call(n, _KDA_DECODE)]:
        try:
            nodes, end, args = _match(kda, config.absorb_low_rank)
        except NoMatch:
            continue
        fake_mode = fake_mode or fake_mode_of(gm)
        g = gm.graph
        # before the norm's last node: every input is an ancestor of it, so already defined; no other
        # node reads this layer's pool slices, so moving the in-place writes here keeps the semantics
        with g.inserting_before(end):
            fused = g.call_function(torch.ops.k3.fused_kda_decode.default,
                                    (*args, bool(config.use_pdl), bool(config.prefetch), config.launch)
                                    + ((True,) if config.early_release and config.use_pdl else ()))
        set_meta_val(fused, fake_mode)
        replace_uses(end, fused, fake_mode)
        erase_subgraph(gm, nodes)
        matches += 1
    return matches
