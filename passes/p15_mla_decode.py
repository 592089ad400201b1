"""P15 MLA decode: the prologue after the merged input GEMM and the latent attention become one
kernel each (`kernels/mla_decode.py`).

Prologue, anchored on `k3::kv_write` (the ATen form of `MLAMixer.forward`'s cache write):

    X    = the [c̃ ; k_r] columns of the input GEMM        (a getitem of P1's split, or any node)
    rows = cat([RMSNorm(slice(X, 1, 0, r)), slice(X, 1, r, end)], -1)
    kv_write(rows, kv, layer, out_cache_loc)
    [K3: q = RMSNorm(Q) where Q is another output of the same split as X (`q_a_layernorm`)]

-> `q' = k3.mla_decode_prologue(X, kv_norm_w, kv_eps, kv, layer, out_cache_loc, Q, q_norm_w, q_eps)`,
users of the q norm take q' (Kimi Linear has no q-LoRA: Q = None and q' is unused).

Attention, anchored on `k3::mla_decode`:

    mla_decode(cat([q_nope_lat, q_rope], -1), kv, layer, page_table, seq_lens, scale, r)
-> `k3.mla_decode_fused(q_nope_lat, q_rope, kv, layer, page_table, seq_lens, scale, pdl, launch_table)`
   (launch_table: the config's per-batch (num_splits, merge_cols) rows, flattened; the op picks its row at run time)

(the concatenation disappears: the kernel reads both halves where they are). W_UK before (the attention's
q_nope_lat input) stays a cuBLAS batched GEMM by default; with `absorb_q="triton"`:

    q_nope_lat = views(bmm(views(q_nope), views of the weight))     einsum("bhd,hdr->bhr", q_nope, W_UK)
-> `k3.mla_absorb_q(q_nope, kv_b_weight, nope, pdl)`   (kernels/mla_absorb.py: a GEMV with PDL, so the split
   kernel after it launches early; q_nope read in place, a strided view of the query GEMM's output)
   with `absorb_q="fold"`, where the layer's prologue has no q-LoRA (the query is there before it), that and the
   prologue -> `k3.mla_decode_prologue_absorb(X, kv_norm_w, kv_eps, kv, layer, out_cache_loc, q_nope, kv_b_weight,
   nope, pdl)` at the later one's place (one launch; same match count)

W_UV after (`absorb_out`), anchored on the fused attention:

    o = flatten(einsum("bhr,hdr->bhd", o_lat, W_UV))    W_UV = kv_b_proj.weight.unflatten(0, (H, -1))[:, nope:]
      as make_fx spells it: view ops -> bmm(., view ops of the weight) -> view ops, clone, _unsafe_view
-> `k3.mla_decode_fused_out(q_nope, q_rope, kv, layer, page_table, seq_lens, scale, kv_b_weight, nope, pdl,
   launch_table[, prefetch_w])`   (prefetch_w: `prefetch_w_uv`, recorded only when on)
   ([B, H * dv]: the merge kernel applies W_UV per (token, head) up to kernels.mla_decode.OUT_MAX_TOKENS
   tokens, or the option `w_uv_max_tokens` (recorded as the op's 14th argument when it differs), so the batched
   GEMM, the layout copy after it and one launch leave the decode step).

K3's q-LoRA norm into the query GEMM (`q_norm_gemv`, on by default: measured), after the prologue:

    q' = k3.mla_decode_prologue(X, ..., Q, q_norm_w, q_eps);  y = k3.gemv(q', W_qb, c, <P8's configuration>)
-> `k3.mla_decode_prologue(X, ..., None, None, 0.0)`;  `y, _ = k3.norm_gemv(Q, None, q_norm_w, q_eps, W_qb, c,
   <the same configuration>, max_tokens)` (kernels/norm_gemv.py: the norm recomputed in the GEMV's prologue), when
   q' feeds only that k3.gemv (P8 made it: choice gemv / measured faster than cuBLAS). The prologue is then the K3
   form of Kimi Linear's, so absorb_q="fold" makes it and W_UK's absorption one kernel: one launch less per MLA
   layer. (norm_gemv reads Q contiguous: at batch 1 the column block is; above, its launcher copies it.)

K3's output gate after it (`gate_out`, on by default: measured), anchored on that op:

    mul(mla_decode_fused_out(...), sigmoid(G))      G [B, H * dv]: the gate GEMM's output (a column block of P1's
-> `k3.mla_decode_fused_out(..., prefetch_w, G)`    merged input GEMM); the merge kernel gates where it stores
   (two elementwise launches per MLA layer leave the step; the sigmoid and the product rounded as before).

The view chains are checked by evaluating them on concrete tensors (the left one must be the
[B, H, r] -> [H, B, r] transpose, the weight one W_UV^T, the right one the [H, B, dv] -> [B, H * dv]
flatten), so any other spelling of the same einsum is matched and nothing else is.

Decode graphs only: a kv_write is fused only when an `mla_decode` of the same (pool, layer) follows,
so prefill graphs are left unchanged (0 matches). Count per decode graph: 3 per MLA layer (one
prologue, one attention, one W_UV absorbed), 4 with absorb_q="triton" (W_UK absorbed), one more with gate_out
where the layer has an output gate, one more with q_norm_gemv where its q-LoRA norm joins the query GEMV. A chain
whose intermediates are read elsewhere is left alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import attr_tensor, erase_if_dead, erase_subgraph, fake_mode_of, is_call, replace_uses, set_meta_val, val_of
from .kernels import mla_absorb as _absorb  # noqa: F401  (registers k3.mla_absorb_q)
from .kernels import mla_decode as _kernels  # noqa: F401  (registers the k3.mla_decode_* ops)
from .kernels import norm_gemv as _norm_gemv  # noqa: F401  (registers k3.norm_gemv)
from .patterns import NoMatch, match_rms_norm, need
from .registry import PassConfig, PassConfigError, register_pass

aten = torch.ops.aten
KV_WRITE = torch.ops.k3.kv_write.default
MLA_DECODE = torch.ops.k3.mla_decode.default
PROLOGUE = torch.ops.k3.mla_decode_prologue.default
FUSED = torch.ops.k3.mla_decode_fused.default
FUSED_OUT = torch.ops.k3.mla_decode_fused_out.default
ABSORB_Q = torch.ops.k3.mla_absorb_q.default
PROLOGUE_ABSORB = torch.ops.k3.mla_decode_prologue_absorb.default
GEMV = torch.ops.k3.gemv.default
NORM_GEMV = torch.ops.k3.norm_gemv.default
ABSORB_Q_CHOICES = ("cublas", "triton", "fold")
VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
            aten.unsqueeze.default, aten.squeeze.dim, aten.transpose.int, aten.t.default, aten.clone.default,
            aten.expand.default}  # layout-only ops of an einsum's make_fx spelling (clone: the flatten's copy)


@dataclass
class MLADecodeConfig(PassConfig):
    prologue: bool = True  # fuse norms + KV write
    attention: bool = True  # replace mla_decode with the Triton split-K kernel
    pdl: bool = True  # prologue + attention kernels with programmatic dependent launch (where kernels/pdl.py allows)
    absorb_out: bool = True  # W_UV (the einsum after the attention) into the attention's merge kernel
    # launch choice per batch, recorded into each attention node (the op picks the row at run time: the token count
    # is symbolic here): rows (largest batch, num_splits (0: from the shapes), merge_cols (0: whole-row merge));
    # see kernels.mla_decode.LAUNCH_TABLE (tools/bench_mla9.py measures the choices)
    launch_table: str = _kernels.format_launch_table(_kernels.LAUNCH_TABLE)  # '1:0:64/4:32:64/*:0:0'
    # W_UK (the einsum before the attention): "cublas" leaves the batched GEMM; "triton" -> k3.mla_absorb_q, a GEMV
    # with PDL (kernels/mla_absorb.py; the GEMM above its MAX_TOKENS); "fold": as "triton", and where the layer's
    # prologue has no q-LoRA (Kimi Linear) both in one kernel, k3.mla_decode_prologue_absorb. tools/bench_mla10.py.
    # Default "fold": 48B batch 1, whole engine (traces/h200_s10/call3): fold 2.237 ms, triton 2.255, cublas 2.260.
    absorb_q: str = "fold"
    # the W_UV merge kernel L2-prefetches its weight block before gdc_wait (only with PDL and aligned blocks); off:
    # with fold, 2.238 vs 2.237 ms at 48B batch 1 (traces/h200_s10/call3)
    prefetch_w_uv: bool = False
    # K3's output gate o * sigmoid(g) applied by the W_UV merge kernel (k3.mla_decode_fused_out's gate): 2 launches
    # less per gated MLA layer. k3-mini-6b batch 1, whole step (traces/h200_s12/call4, same run): 1.911 -> 1.878 ms
    gate_out: bool = True
    # K3's q_a norm moved from the prologue into the q_b GEMV's prologue (k3.norm_gemv), so that with absorb_q="fold"
    # the prologue and W_UK's absorption are one kernel: 1 launch less per q-LoRA MLA layer (where P8 chose its GEMV
    # for q_b). k3-mini-6b batch 1 (same run): 1.911 -> 1.888 ms; with gate_out and P17 1.833
    q_norm_gemv: bool = True
    # up to this many tokens the W_UV merge kernel applies W_UV (and the gate): recorded into each
    # k3.mla_decode_fused_out (its last argument, only when it differs from kernels.mla_decode.OUT_MAX_TOKENS, 4).
    # Above it the op runs the plain merge, cuBLAS's batched GEMM and the flatten's copy: 2 kernels more per MLA layer
    # (48B batch 8: 14 a step, traces/h200_s13/call2). 8 (the default since session 15) takes them out at batch 8,
    # with W_UV read once per (token, head) program (from L2 after the first): same step time at 48B batch 8
    # (traces/h200_s15, tools/gpu_bs8k14.sh)
    w_uv_max_tokens: int = _kernels.OUT_MAX_TOKENS

    def validate(self) -> None:
        if not 0 <= self.w_uv_max_tokens <= 64:
            raise PassConfigError(f"p15_mla_decode: w_uv_max_tokens must be in 0..64, got {self.w_uv_max_tokens}")
        if self.absorb_q not in ABSORB_Q_CHOICES:
            raise PassConfigError(f"p15_mla_decode: absorb_q must be one of {ABSORB_Q_CHOICES}, got {self.absorb_q!r}")
        try:
            _kernels.parse_launch_table(self.launch_table)
        except ValueError as e:
            raise PassConfigError(f"p15_mla_decode: {e}") from None


_FULL = 2 ** 62  # make_fx spells `x[:, a:]` as slice(slice(x, 0, 0, INT64_MAX), 1, a, INT64_MAX)


def _noop_slice_root(node: Node) -> Node:
    """Follow whole-axis-0 slices (`x[:]`, which P2 would remove) back to the sliced tensor."""
    while (is_call(node, aten.slice.Tensor) and node.args[1] == 0 and (len(node.args) < 3 or node.args[2] == 0)
           and (len(node.args) < 4 or node.args[3] >= _FULL) and (len(node.args) < 5 or node.args[4] == 1)):
        node = node.args[0]
    return node


def _slice_of(node, base: Node | None = None):
    """(root, start, end) if node = slice([x[:]], 1 or -1, start, end[, 1]) of root (== base if given)."""
    need(is_call(node, aten.slice.Tensor) and node.args[1] in (1, -1))
    root = _noop_slice_root(node.args[0])
    need(base is None or root is base)
    need(len(node.args) < 5 or node.args[4] == 1)
    return root, node.args[2] if len(node.args) > 2 else 0, node.args[3] if len(node.args) > 3 else None


def _norms_by_input(gm: GraphModule) -> dict:
    found = {}
    for n in gm.graph.nodes:
        if is_call(n, aten.mul.Tensor):
            try:
                x, w, eps, nodes = match_rms_norm(n)
            except NoMatch:
                continue
            found.setdefault(x, []).append((n, w, eps, nodes))
    return found


def _private(nodes: set, outs: set) -> None:
    for n in nodes - outs:
        need(all(u in nodes for u in n.users))


def _match_prologue(write: Node, norms: dict, decoded: set):
    rows, kv, layer, loc = write.args
    need((kv, layer) in decoded)
    need(is_call(rows, aten.cat.default) and len(rows.args[0]) == 2 and (len(rows.args) == 1 or rows.args[1] in (-1, 1)))
    normed, rope = rows.args[0]
    r = val_of(normed).shape[-1]
    x_c = None
    for x, matches in norms.items():
        for out, w, eps, nodes in matches:
            if out is normed:
                x_c, kv_w, kv_eps, kv_nodes = x, w, eps, nodes
    need(x_c is not None and is_call(x_c, aten.slice.Tensor))
    ckv, start, end = _slice_of(x_c)
    need(start == 0 and end == r)
    _, start, end = _slice_of(rope, ckv)
    need(start == r and (end is None or end >= val_of(ckv).shape[-1]))
    need(len(rope.users) == 1)
    nodes = set(kv_nodes) | {x_c, rope, rows, write}
    for sl in (x_c.args[0], rope.args[0]):  # the x[:] no-op slices, if P2 has not removed them
        if sl is not ckv:
            nodes.add(sl)
    _private(nodes, {write})
    q = None
    if ckv.op == "call_function" and ckv.target is operator.getitem:
        split = ckv.args[0]
        siblings = [u for u in split.users if u is not ckv and u in norms and len(norms[u]) == 1]
        if len(siblings) == 1:
            q_x = siblings[0]
            q_out, q_w, q_eps, q_nodes = norms[q_x][0]
            q_set = set(q_nodes) | {q_x}
            try:
                _private(q_set, {q_out})
                q = (q_x, q_w, q_eps, q_nodes, q_out)
            except NoMatch:
                q = None
    return dict(nodes=nodes, ckv=ckv, kv_w=kv_w, kv_eps=kv_eps, kv=kv, layer=layer, loc=loc, q=q)


def _hoist_weight(node: Node, anchor: Node, order: dict) -> bool:
    """Make sure `node` is defined before `anchor` (moving a weight read if needed)."""
    if order[node] < order[anchor]:
        return True
    if node.op == "get_attr":
        anchor.prepend(node)
        order[node] = order[anchor] - 0.5
        return True
    return False


def _fuse_prologue(gm: GraphModule, m: dict, fake_mode, pdl: bool) -> bool:
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    pattern = set(m["nodes"])
    q = m["q"]
    if q is not None:
        pattern |= set(q[3])
    anchor = min(pattern, key=order.__getitem__)
    weights = [m["kv_w"]] + ([q[1]] if q is not None else [])
    if not all(_hoist_weight(w, anchor, order) for w in weights):
        return False
    if q is not None and order[q[0]] > order[anchor]:
        return False
    with g.inserting_before(anchor):
        fused = g.call_function(PROLOGUE, (m["ckv"], m["kv_w"], m["kv_eps"], m["kv"], m["layer"], m["loc"],
                                           q[0] if q else None, q[1] if q else None, q[2] if q else 0.0,
                                           bool(pdl)))
    set_meta_val(fused, fake_mode)
    if q is not None:
        replace_uses(q[4], fused, fake_mode)
    erase_subgraph(gm, pattern)
    return True


def _match_attention(node: Node):
    q_lat = node.args[0]
    need(is_call(q_lat, aten.cat.default) and len(q_lat.users) == 1 and len(q_lat.args[0]) == 2)
    need(len(q_lat.args) == 1 or q_lat.args[1] in (-1, 2))
    q_nope, q_rope = q_lat.args[0]
    kv_lora_rank = node.args[6]
    need(val_of(q_nope).shape[-1] == kv_lora_rank and val_of(q_nope).dim() == 3)
    return q_lat, q_nope, q_rope


def _view_chain_forward(node: Node) -> list:
    """The layout-only ops after `node`, each its predecessor's only user."""
    chain = []
    while len(node.users) == 1 and is_call(next(iter(node.users)), *VIEW_OPS):
        node = next(iter(node.users))
        chain.append(node)
    return chain


def _evaluate(chain: list, start: Node, value: torch.Tensor, tokens: int) -> torch.Tensor:
    """Run `chain` (ops reading `start` or each other, sizes maybe symbolic) on a concrete tensor; every
    symbolic size is the token count (the only one a decode graph has; another would fail the caller's check)."""
    env = {start: value}

    def arg(a):
        if isinstance(a, Node):
            return env[a] if a in env else tokens
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return a
    for n in chain:
        env[n] = n.target(*arg(n.args), **arg(n.kwargs))
    return env[chain[-1]] if chain else value


def _match_out(gm: GraphModule, fused: Node):
    """fused -> views -> bmm(., views(W)) -> views ending in [B, H * dv]: (bmm, chains, W node, nope)."""
    left = _view_chain_forward(fused)
    tail = left[-1] if left else fused
    need(len(tail.users) == 1)
    bmm = next(iter(tail.users))
    need(is_call(bmm, aten.bmm.default) and bmm.args[0] is tail)
    w_chain, w = [], bmm.args[1]
    while isinstance(w, Node) and is_call(w, *(VIEW_OPS | {aten.slice.Tensor})):  # views of a weight: may be shared
        w_chain.insert(0, w)
        w = w.args[0]
    need(isinstance(w, Node) and w.op == "get_attr" and w_chain)
    right = _view_chain_forward(bmm)
    need(right)
    B, H, R = val_of(fused).shape
    out_shape = val_of(right[-1]).shape
    need(len(out_shape) == 2 and out_shape[0] == B and out_shape[1] % H == 0)
    dv = out_shape[1] // H
    weight = attr_tensor(gm, w)
    need(weight.dim() == 2 and weight.shape[1] == R and weight.shape[0] % H == 0 and weight.shape[0] // H > dv)
    nope = weight.shape[0] // H - dv
    tokens = 3 if H != 3 else 5  # a concrete token count unlike every other size here
    x = torch.arange(tokens * H * R, dtype=torch.float32).view(tokens, H, R)
    need(torch.equal(_evaluate(left, fused, x, tokens), x.transpose(0, 1)))
    need(torch.equal(_evaluate(w_chain, w, weight, tokens), _kernels.w_uv_of(weight, H, nope).transpose(1, 2)))
    y = torch.arange(H * tokens * dv, dtype=torch.float32).view(H, tokens, dv)
    need(torch.equal(_evaluate(right, bmm, y, tokens), y.transpose(0, 1).reshape(tokens, H * dv)))
    return dict(nodes=set(left) | {bmm} | set(right), w_chain=w_chain, w=w, nope=nope, out=right[-1])


def _view_chain_back(node: Node) -> list:
    """The layout-only ops ending at `node` (inclusive), each the only user of its input, oldest first."""
    chain = []
    while is_call(node, *VIEW_OPS) and len(node.users) == 1:
        chain.insert(0, node)
        node = node.args[0]
    return chain


def _match_absorb_q(gm: GraphModule, q_nope: Node):
    """q_nope = views(bmm(views(X), views(W))) spelling einsum("bhd,hdr->bhr", X, W_UK): (X, W node, nope, nodes,
    w_chain). The chains are checked on concrete tensors as in _match_out."""
    need(is_call(q_nope, *VIEW_OPS))
    right = _view_chain_back(q_nope) if len(q_nope.users) == 1 else []
    need(right and right[-1] is q_nope)
    bmm = right[0].args[0]
    need(is_call(bmm, aten.bmm.default) and len(bmm.users) == 1)
    left = _view_chain_back(bmm.args[0])
    need(left)
    x = left[0].args[0]
    w_chain, w = [], bmm.args[1]
    while isinstance(w, Node) and is_call(w, *(VIEW_OPS | {aten.slice.Tensor})):  # views of a weight: may be shared
        w_chain.insert(0, w)
        w = w.args[0]
    need(isinstance(w, Node) and w.op == "get_attr" and w_chain)
    B, H, R = val_of(q_nope).shape
    xv = val_of(x)
    need(xv is not None and xv.dim() == 3 and xv.shape[:2] == (B, H))
    nope = xv.shape[2]
    weight = attr_tensor(gm, w)
    need(weight.dim() == 2 and weight.shape[1] == R and weight.shape[0] % H == 0 and weight.shape[0] // H > nope > 0)
    tokens = 3 if H != 3 else 5
    xs = torch.arange(tokens * H * nope, dtype=torch.float32).view(tokens, H, nope)
    need(torch.equal(_evaluate(left, x, xs, tokens), xs.transpose(0, 1)))
    need(torch.equal(_evaluate(w_chain, w, weight, tokens), _absorb.w_uk_of(weight, H, nope)))
    y = torch.arange(H * tokens * R, dtype=torch.float32).view(H, tokens, R)
    need(torch.equal(_evaluate(right, bmm, y, tokens), y.transpose(0, 1)))
    return dict(x=x, w=w, nope=nope, nodes=set(left) | {bmm} | set(right), w_chain=w_chain)


def _absorb_q(gm: GraphModule, q_nope: Node, fake_mode, pdl: bool) -> Node | None:
    """W_UK's batched GEMM (and its views) feeding the attention -> one k3.mla_absorb_q; the new node, or None."""
    try:
        m = _match_absorb_q(gm, q_nope)
    except NoMatch:
        return None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if not _hoist_weight(m["w"], q_nope, order):
        return None
    with gm.graph.inserting_before(q_nope):
        new = gm.graph.call_function(ABSORB_Q, (m["x"], m["w"], m["nope"], bool(pdl)))
    set_meta_val(new, fake_mode)
    replace_uses(q_nope, new, fake_mode)
    erase_subgraph(gm, m["nodes"])
    erase_if_dead(gm, m["w_chain"])  # W_UV's slice may read the same view of kv_b_proj's weight
    return new


def _absorb_out(gm: GraphModule, fused: Node, fake_mode, prefetch_w: bool = False) -> Node | None:
    """W_UV's einsum after the attention -> k3.mla_decode_fused_out; the new node, or None."""
    try:
        m = _match_out(gm, fused)
    except NoMatch:
        return None
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    if not _hoist_weight(m["w"], fused, order):
        return None
    with g.inserting_after(fused):
        new = g.call_function(FUSED_OUT, (*fused.args[:7], m["w"], m["nope"], *fused.args[7:])
                              + ((True,) if prefetch_w else ()))  # an engine built before: no 11th argument
    set_meta_val(new, fake_mode)
    replace_uses(m["out"], new, fake_mode)
    erase_subgraph(gm, m["nodes"] | {fused})
    erase_if_dead(gm, m["w_chain"])  # W_UK's slice may still read the same view of kv_b_proj's weight
    return new


def _match_gate(out: Node) -> tuple[Node, set] | None:
    """(G, nodes) if the fused attention's only user is mul(out, sigmoid(G)) (either order) and the sigmoid is read
    there only, with G, the sigmoid and the product all of out's shape and dtype; else None."""
    if len(out.users) != 1:
        return None
    mul = next(iter(out.users))
    if not is_call(mul, aten.mul.Tensor) or len(mul.args) != 2 or mul.kwargs:
        return None
    sig = mul.args[1] if mul.args[0] is out else mul.args[0]
    if not (is_call(sig, aten.sigmoid.default) and len(sig.users) == 1 and isinstance(sig.args[0], Node)):
        return None
    ref = val_of(out)
    for n in (sig.args[0], sig, mul):
        v = val_of(n)
        if v is None or v.dtype != ref.dtype or v.dim() != 2 or v.shape[1] != ref.shape[1]:
            return None
    return sig.args[0], {sig, mul}


def _gate_out(gm: GraphModule, out: Node, fake_mode) -> bool:
    """mul(k3.mla_decode_fused_out(...), sigmoid(G)) -> the op with G as its gate argument."""
    m = _match_gate(out)
    if m is None:
        return False
    gate, nodes = m
    mul = next(n for n in nodes if is_call(n, aten.mul.Tensor))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if order[gate] > order[out]:  # G computed after the attention (no P1 merge): the op (pure) moves down to the mul
        mul.prepend(out)
    args = list(out.args)
    args += [None] * (11 - len(args))  # launch_table (None: the op's default) if missing
    args = args[:11] + [args[11] if len(args) > 11 else False, gate]  # prefetch_w, gate
    out.args = tuple(args)
    replace_uses(mul, out, fake_mode)
    erase_subgraph(gm, nodes)
    return True


def _q_norm_into_gemv(gm: GraphModule, prologue: Node, fake_mode) -> bool:
    """The prologue's q_a norm -> the k3.norm_gemv that replaces the one k3.gemv reading its output (see the module
    doc); the prologue keeps the KV half. False (graph unchanged) where the form differs."""
    q_a, q_w, q_eps = prologue.args[6:9]
    if q_a is None or len(prologue.users) != 1:
        return False
    gemv = next(iter(prologue.users))
    if not is_call(gemv, GEMV) or gemv.kwargs or gemv.args[0] is not prologue or prologue in gemv.args[1:]:
        return False
    _, w, c, *cfg = gemv.args  # max_m, block_n, block_k, split_k, design, use_pdl, num_warps[, l2_prefetch_kb]
    if len(cfg) < 7 or not cfg[0] > 0 or not isinstance(w, Node):
        return False
    qv, wv = val_of(q_a), val_of(w)
    if qv is None or wv is None or not qv.dtype == val_of(prologue).dtype == wv.dtype:
        return False
    g = gm.graph
    with g.inserting_before(gemv):
        fused = g.call_function(NORM_GEMV, (q_a, None, q_w, q_eps, w, c, *cfg[:7], _norm_gemv.gv.MAX_M))
        y = g.call_function(operator.getitem, (fused, 0))
    for n in (fused, y):
        set_meta_val(n, fake_mode)
    gemv.replace_all_uses_with(y)
    g.erase_node(gemv)
    prologue.args = (*prologue.args[:6], None, None, 0.0, *prologue.args[9:])
    set_meta_val(prologue, fake_mode)
    return True


def _fold_into_prologue(gm: GraphModule, absorbed: Node, kv, layer, fake_mode) -> Node | None:
    """k3.mla_absorb_q + the same (pool, layer)'s prologue without q-LoRA -> one k3.mla_decode_prologue_absorb at the
    later one's place (not when the query comes out of the prologue); the new node, or None."""
    g = gm.graph
    prologues = [n for n in g.nodes if is_call(n, PROLOGUE) and n.args[3] is kv and n.args[4] == layer
                 and n.args[6] is None and not n.users]
    if len(prologues) != 1:
        return None
    prologue = prologues[0]
    nodes = list(g.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    q_x, w, nope, pdl = absorbed.args
    # the fused node goes where the later of the two is; the pool write may move down to the absorption only if no
    # node in between touches the pool
    first, last = sorted((prologue, absorbed), key=order.__getitem__)
    if last is prologue and (order[q_x] > order[prologue] or not _hoist_weight(w, prologue, order)):
        return None
    if any(kv in n.all_input_nodes for n in nodes[order[first] + 1: order[last]]):
        return None
    with g.inserting_before(last):
        new = g.call_function(PROLOGUE_ABSORB, (*prologue.args[:6], q_x, w, nope, pdl))
    set_meta_val(new, fake_mode)
    replace_uses(absorbed, new, fake_mode)
    g.erase_node(absorbed)
    g.erase_node(prologue)
    return new


@register_pass("p15_mla_decode", MLADecodeConfig)
def mla_decode(gm: GraphModule, config: MLADecodeConfig) -> int:
    """MLA decode: norms + KV write -> one prologue kernel; latent attention -> a Triton split-K kernel."""
    g = gm.graph
    decodes = [n for n in g.nodes if is_call(n, MLA_DECODE)]
    if not decodes:
        return 0
    fake_mode = fake_mode_of(gm)
    matches = 0
    if config.prologue:
        decoded = {(n.args[1], n.args[2]) for n in decodes}
        norms = _norms_by_input(gm)
        for write in [n for n in g.nodes if is_call(n, KV_WRITE)]:
            try:
                m = _match_prologue(write, norms, decoded)
            except NoMatch:
                continue
            if _fuse_prologue(gm, m, fake_mode, config.pdl):
                matches += 1
                norms = _norms_by_input(gm)
        if config.q_norm_gemv:
            for prologue in [n for n in g.nodes if is_call(n, PROLOGUE)]:
                matches += _q_norm_into_gemv(gm, prologue, fake_mode)
    if config.attention:
        launch_table = _kernels.flat_launch_table(_kernels.parse_launch_table(config.launch_table))
        for node in decodes:
            try:
                q_lat, q_nope, q_rope = _match_attention(node)
            except NoMatch:
                continue
            _, kv, layer, page_table, seq_lens, scale, _ = node.args
            if config.absorb_q in ("triton", "fold"):
                absorbed = _absorb_q(gm, q_nope, fake_mode, config.pdl)
                if absorbed is not None:
                    matches += 1
                    folded = _fold_into_prologue(gm, absorbed, kv, layer, fake_mode) if config.absorb_q == "fold" \
                        else None
                    q_nope = folded or absorbed
            with g.inserting_before(node):
                fused = g.call_function(FUSED, (q_nope, q_rope, kv, layer, page_table, seq_lens, scale,
                                                bool(config.pdl), launch_table))
            set_meta_val(fused, fake_mode)
            replace_uses(node, fused, fake_mode)
            erase_subgraph(gm, [node, q_lat])
            matches += 1
            out = None
            if config.absorb_out:
                out = _absorb_out(gm, fused, fake_mode, config.pdl and config.prefetch_w_uv)
            if out is not None:
                matches += 1
                if config.gate_out and _gate_out(gm, out, fake_mode):
                    matches += 1
                if config.w_uv_max_tokens != _kernels.OUT_MAX_TOKENS:
                    _set_w_uv_max_tokens(out, int(config.w_uv_max_tokens))
    return matches


def _set_w_uv_max_tokens(out: Node, tokens: int) -> None:
    """The op's 14th argument, after launch_table, prefetch_w and gate (their values, or the op's defaults)."""
    args = list(out.args)
    args += [None, False, None][len(args) - 10:] if len(args) < 13 else []
    out.args = tuple(args[:13]) + (tokens,)
