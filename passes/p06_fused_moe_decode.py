"""P6 fused MoE decode: each MoE layer's routed experts (+ the shared expert's combine) become one
`k3::fused_moe_decode` node (passes/kernels/moe_decode.py), in decode and verify graphs (TOKEN_STEP_MODES).

Matched, anchored on the expert op (after P1-P4: the router is P4's `k3.fused_route`, whose
weights / ids outputs the expert op reads; P1 has merged the shared expert's gate and up GEMMs
into the layer's input GEMM):

    u = k3.moe_experts(z, ids, weights, w13, w2, act, beta, linear_beta)            bf16 / fp32 experts
      | k3.moe_experts_mxfp4(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, act, ...)
    [latent MoE (K3): r = mm(n, t(Wup)), n = RMSNorm(u) as model_def's RMSNorm traces (pow, mean,
        add eps, rsqrt, mul, [casts around it in bf16], mul by the norm weight), or n = u without the
        norm; otherwise r = u]
    [shared combine: r's only user is
        y = add(r, s) | add(s, r)      s = mm(a, t(Ws2)), Ws2 a weight [Do, Is], s used only here
        a = mul(silu(g), up)                                        SiLU-GLU   -> shared_in=g, shared_up=up
          | the SiTU-GLU chain of moe_math.glu_act with the same betas (fp32, or between bf16 casts)
                                                                    -> shared_in=g, shared_up=up
          | anything else                                           -> shared_in=a (already activated)]

and replaced by `k3.fused_moe_decode(z, ids, weights, w13|codes, w2|codes, scales..., shared...,
act, beta, linear_beta, crossover, latent_up_w, latent_norm_w, latent_eps, use_pdl, shared_w13[, down_split[,
shared_l2_prefetch[, down_l2_prefetch[, up_launch[, flag_deps, early_release[, down_early_release[,
latent_prewait[, grouped_sorted[, sorted_finish[, routed_l2_prefetch[, up_prewait]]]]]]]]]]])`: the
trailing options only up to the last one set (a node of an engine built before them has the same arguments as then;
the op's flag_deps is never set by the pass: it is there, False, only ahead of early_release).

Shared gate/up into kernel A (`fuse_shared_up`): when the GLU's g and up are column blocks of constant-weight
GEMMs on z itself (P1's merged mm(z, t(W)) + split, or two plain mms), read by nothing but the GLU, and the
MoE is full width (a latent MoE's shared expert reads the hidden state, not z: it keeps its GEMM), their weight
rows [g; up] become the op's shared_w13 (P1's merged weight itself when it is exactly [g; up]) and the op runs
them as one more slot of its up-projection kernel. The GEMM loses those columns at build time
(gemm_columns.drop_column_blocks: what else it computes, e.g. an fp32 model's router logits, stays a GEMM).
Each part is optional:
a layer whose tail deviates from these forms keeps that tail in ATen and fuses what comes before.
A layer whose matched shapes the op's argument check refuses is left unfused (never an error), and
counted in the config's `skipped_layers`.

`crossover` is the batch from which the op runs the grouped path instead of the GEMVs (`grouped_sorted`, the default:
kernels/moe_sorted.py's sorted M-tiled experts; off: torch._grouped_mm). Config
`crossover_batch` None (default) = decided at build time: measured on the first matched layer's
weights and tail (latent up-projection and norm, shared expert) when they are on CUDA (kernels.moe_decode.measure_crossover: both paths timed from CUDA
graphs at batch 1..256), else CPU_CROSSOVER. The pass writes the value it used back into its config,
with `crossover_source` saying where it came from, so the engine's pass report records both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .gemm_columns import column_block, drop_column_blocks, record_merge, source_name
from .graph_utils import (add_constant, attr_tensor, drop_unused_constants, erase_if_dead, fake_mode_of, is_call,
                          replace_uses, set_meta_val, val_of)
from .kernels import moe_decode  # registers torch.ops.k3.fused_moe_decode
from .kernels import moe_launch  # split_from_list checks down_split
from .patterns import NoMatch, is_cast, match_rms_norm
from .registry import PassConfig, PassConfigError, register_pass

aten = torch.ops.aten
FUSED = torch.ops.k3.fused_moe_decode.default
_EXPERT_OPS = (torch.ops.k3.moe_experts.default, torch.ops.k3.moe_experts_mxfp4.default)


@dataclass
class FusedMoEDecodeConfig(PassConfig):
    # tokens from which the op switches to the grouped-GEMM path; None = measure at build (CUDA) / fixed (CPU)
    crossover_batch: int | None = None
    fuse_shared: bool = True  # fold the shared expert's down-projection (+ its GLU) and the add into the op
    fuse_latent: bool = True  # fold the latent MoE's RMSNorm and up-projection (K3) into the op
    fuse_shared_up: bool = True  # the shared expert's gate/up GEMM as a slot of the op's up-projection kernel
    # launch the GEMV kernels with programmatic dependent launch (sm90+, Triton >= 3.4; elsewhere, the CPU and
    # the interpreter included, the op runs exactly as without: kernels.pdl.pdl_for)
    use_pdl: bool = True
    # kernel B''s launch at every GEMV batch, "BLOCK_N x BLOCK_K x num_warps x K chunks x prefetch (0/1)" (e.g.
    # "64x128x4x2x1"), instead of kernels.moe_launch.SPLIT_TUNED's per-shape entry; None: the table (A/B arms)
    down_split: str | None = None
    # kernel A's shared slot first in its launch order and, with PDL, asking L2 for its static gate/up rows before
    # it waits for the router kernel (moe_decode.fused_moe_triton's shared_l2_prefetch). 48B batch 1, whole engine
    # (traces/h200_s10/call3): 2.250 ms with it, 2.249 with down_l2_prefetch too, 2.260 without either
    shared_l2_prefetch: bool = True
    # the same for kernel B''s shared slot (its W2 rows, before it waits for kernel A)
    down_l2_prefetch: bool = True
    # kernel A's launch at every GEMV batch, "BLOCK_N x BLOCK_K x num_warps" (e.g. "32x256x4"), either design, instead
    # of kernels.moe_launch.ROWS_TUNED / the rules (A/B arms for tools/bench_moe11.py's winners); None: the tables
    up_launch: str | None = None
    # (the op's flag_deps, fine-grained A -> B' counters, is not a pass option: at one MoE layer it gained nothing
    # (36.91 vs 36.75 us) and a whole 48B engine with it and the 8-warp kernel A never came back from its set-up,
    # traces/h200_s11/call2; the op keeps it for tools/bench_moe11.py only)
    # with PDL, kernel A releases kernel B right after its wait, not after its K loop, so B's programs are resident and
    # load their first weight tiles while A streams (B still waits for all of A before it reads h). 48B batch 1, whole
    # step (traces/h200_s12): 2.160 -> 2.125 ms alone (call 1); with P5's early_release 2.178 -> 2.121 (call 2)
    early_release: bool = True
    # the same for kernel B' (split design) and the kernel after the op (the next layer's norm). On with
    # latent_prewait since session 15 (below)
    down_early_release: bool = True
    # with PDL, a latent MoE's kernel C computes the shared expert's down-projection (and at batch 1 loads its W_up
    # tile) before its gdc_wait, so that half of C's 8.4 MB (k3-mini-6b) streams while B' runs; only the routed part
    # waits for u (same bits; kernels/moe_decode.py _latent_out_kernel). Both on, with P8's rows_programs
    # 132,264,528, since session 15 (traces/h200_s15, one run, batch 1): k3-mini-6b 1.826 -> 1.688 ms, 48B 2.124 ->
    # 2.113 ms; 48B batch 8 6.938 ms either way
    latent_prewait: bool = True
    # from the crossover on, the routed experts by kernels/moe_sorted.py (align + two M-tiled tl.dot kernels + the
    # weighted sum: each expert's weights read once, the GLU in the up kernel's registers, MXFP4 decoded in them)
    # instead of torch._grouped_mm and its ATen chain; the build-time crossover is measured against the same path.
    # On since session 16 (traces/h200_s16, one run each, pinned gate held): batch 64 k3-mini-6b 10.627 -> 7.455 ms,
    # 48B 28.879 -> 20.872 ms; batch 1 and 8 unchanged (the crossover stays above 8: k3-mini 32, 48B 16)
    grouped_sorted: bool = True
    # with grouped_sorted: the pairs' sum and a latent MoE's RMSNorm in one kernel (moe_sorted._expert_finish_kernel)
    # instead of ATen's sum, cast and ~7-kernel norm chain. Off until a ladder --variant measures it
    sorted_finish: bool = False
    # with PDL, at batch 1, kernel B''s routed slots ask L2 for their W2 rows (experts chosen two kernels back) before
    # their gdc_wait, while kernel A streams (A releases B' early): same bits. Off: k3-mini-6b batch 1 2.6% slower
    # (traces/h200_s19/call2, H100: 1.953 -> 2.004 ms); the 48B arm has not run
    routed_l2_prefetch: bool = False
    # with PDL, a latent MoE's kernel A (its "rows" design) reads its expert and loads its first K step of gate and up
    # rows before gdc_wait. The router ran two kernels back, before the front GEMV that makes A's input, so the ids
    # are final once A's programs run; only x waits (same bits). It pays only if A's programs are resident while the
    # front GEMV streams: P8's early_release=moe_inputs releases them. Off until a ladder --variant measures the pair
    # (session 20: traces/h200_s19/call1's profile puts kernel A 4.5 us a layer over its floor at k3-mini-6b batch 1)
    up_prewait: bool = False
    crossover_source: str = ""  # filled by the pass: where crossover_batch came from
    skipped_layers: int = 0  # filled by the pass: MoE layers whose matched shapes the op refuses (left unfused)

    def validate(self) -> None:
        if self.crossover_batch is not None and self.crossover_batch < 1:
            raise PassConfigError(f"p06_fused_moe_decode: crossover_batch must be >= 1 or none, "
                                  f"got {self.crossover_batch}")
        self.down_split_values()
        self.up_launch_values()

    def down_split_values(self) -> list[int] | None:
        """down_split as the op's int list (None: not set); PassConfigError naming what is wrong."""
        if self.down_split is None:
            return None
        try:
            values = [int(v) for v in str(self.down_split).lower().split("x")]
            moe_launch.split_from_list(values)
        except ValueError as exc:
            raise PassConfigError(f"p06_fused_moe_decode: down_split {self.down_split!r} is not "
                                  f"BLOCK_NxBLOCK_Kxnum_warps[xK_chunks[xprefetch 0/1]] ({exc})") from None
        return values

    def up_launch_values(self) -> list[int] | None:
        """up_launch as the op's int list (None: not set); PassConfigError naming what is wrong."""
        if self.up_launch is None:
            return None
        try:
            return list(moe_launch.check_up_launch(str(self.up_launch).lower().split("x")))
        except ValueError as exc:
            raise PassConfigError(f"p06_fused_moe_decode: up_launch {self.up_launch!r} is not "
                                  f"BLOCK_NxBLOCK_Kxnum_warps ({exc})") from None


def _single_user(node: Node | None) -> Node | None:
    return next(iter(node.users)) if node is not None and len(node.users) == 1 else None


def _scalar_mul(node, c=None):
    """(x, constant) of `mul(x, constant)`, or None."""
    if is_call(node, aten.mul.Tensor) and isinstance(node.args[1], (int, float)) and isinstance(node.args[0], Node):
        return node.args[0], float(node.args[1])
    return None


def _capped(node: Node):
    """`mul(tanh(div(v, b)), b)` -> (v, b, chain nodes), else None."""
    m = _scalar_mul(node)
    if m is None or not is_call(m[0], aten.tanh.default):
        return None
    tanh, b = m
    div = tanh.args[0]
    if not (is_call(div, aten.div.Tensor) and div.args[1] == b and isinstance(div.args[0], Node)):
        return None
    return div.args[0], b, [node, tanh, div]


def _match_glu(a: Node, act: str, beta: float, linear_beta: float):
    """(gate, up, nodes) when `a` is glu_act(gate, up) in the op's activation, else None."""
    if not is_call(a, aten.mul.Tensor) or len(a.args) != 2 or not all(isinstance(x, Node) for x in a.args):
        return None
    left, right = a.args
    if act == "silu":
        if is_call(left, aten.silu.default):
            return left.args[0], right, [a, left]
        return None
    # situ: mul(mul(beta·tanh(g/beta), sigmoid(g)), linear_beta·tanh(up/linear_beta))
    up_part = _capped(right)
    if up_part is None or up_part[1] != linear_beta or not is_call(left, aten.mul.Tensor):
        return None
    capped, sig = left.args
    gate_part = _capped(capped) if isinstance(capped, Node) else None
    if gate_part is None or gate_part[1] != beta or not is_call(sig, aten.sigmoid.default) \
            or sig.args[0] is not gate_part[0]:
        return None
    return gate_part[0], up_part[0], [a, left, sig] + gate_part[2] + up_part[2]


def _owned(nodes: list[Node], root: Node) -> bool:
    """Every node except `root` is used only inside the set (so it can go with the match)."""
    inside = set(nodes)
    return all(all(u in inside for u in n.users) for n in nodes if n is not root)


def _match_shared(moe: Node, act, beta, linear_beta):
    """(add, shared_in, shared_up, Ws2 get_attr, dead nodes) for the shared combine after `moe` (the routed
    experts' output, or the latent tail's up-projection), or None."""
    add = _single_user(moe)
    if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
        return None
    other = add.args[1] if add.args[0] is moe else add.args[0]
    if other is moe or not is_call(other, aten.mm.default) or len(other.users) != 1:
        return None
    a, t = other.args
    if not is_call(t, aten.t.default) or not isinstance(t.args[0], Node) or t.args[0].op != "get_attr":
        return None
    weight, a_val, out_val = t.args[0], val_of(a), val_of(add)
    if a_val is None or out_val is None or val_of(moe) is None or out_val.dtype != val_of(moe).dtype \
            or tuple(val_of(other).shape[1:]) != tuple(val_of(moe).shape[1:]):
        return None
    glu = _match_glu(a, act, beta, linear_beta)
    if glu is None and _cast(a) is not None:  # bf16 SiTU: fp32 chain between casts of g, up and of the result
        inner = _match_glu(_cast(a), act, beta, linear_beta)
        if inner is not None and _cast(inner[0], torch.float32) is not None \
                and _cast(inner[1], torch.float32) is not None:
            glu = (_cast(inner[0]), _cast(inner[1]), [a] + inner[2] + [inner[0], inner[1]])
    if glu is not None and len(a.users) == 1 and _owned(glu[2], a):
        return add, glu[0], glu[1], weight, [other, t] + glu[2]
    return add, a, None, weight, [other, t]


def _cast(node, dtype=None):
    """The input of `_to_copy(x, dtype=...)` (only a dtype change), else None."""
    return node.args[0] if is_cast(node, dtype) and isinstance(node.args[0], Node) else None


def _linear_of(node: Node):
    """(mm, weight get_attr) when `node`'s only user is mm(node, t(W)) with W a weight, else None."""
    mm = _single_user(node)
    if not is_call(mm, aten.mm.default) or mm.args[0] is not node:
        return None
    t = mm.args[1]
    if not is_call(t, aten.t.default) or len(t.users) != 1 or t.args[0].op != "get_attr":
        return None
    return mm, t.args[0], [mm, t]


def _match_latent(moe: Node):
    """(up-projection mm, Wup, norm weight or None, eps, dead nodes) for K3's latent tail after `moe`."""
    plain = _linear_of(moe)
    if plain is not None:
        return plain[0], plain[1], None, 1e-5, plain[2]
    # walk forward to the norm's output (mul by its weight), then let patterns.match_rms_norm check the chain
    src = _single_user(moe) if _cast(_single_user(moe), torch.float32) is moe else moe
    scaled = next((u for u in src.users if is_call(u, aten.mul.Tensor)), None) if src is not None else None
    out = _single_user(scaled) if scaled is not None else None
    if out is not None and _cast(out) is scaled:
        out = _single_user(out)
    try:
        x, weight, eps, chain = match_rms_norm(out) if out is not None else (None, None, None, None)
    except NoMatch:
        return None
    if x is not moe or not isinstance(weight, Node) or weight.op != "get_attr":
        return None
    up = _linear_of(out)
    if up is None or not _owned(chain, out):
        return None
    return up[0], up[1], weight, eps, chain + up[2]


def _shared_gate_up(gm: GraphModule, z: Node, shared_in: Node, shared_up: Node, width: int, dead: list[Node]):
    """The column blocks (gate, up) behind the shared GLU's inputs when the op can compute them from z: both
    [*, width] blocks of constant-weight GEMMs on z, read only by the matched GLU (`dead`); else None."""
    inside = set(dead)
    blocks = []
    for node in (shared_in, shared_up):
        block = column_block(gm, node)
        if block is None or block.x is not z or block.width != width or not all(u in inside for u in node.users):
            return None
        blocks.append(block)
    return blocks


def _shared_w13_node(gm: GraphModule, gate, up, shared_w2: Node, before: Node, fake_mode) -> Node:
    """get_attr of the [2 Is, D] gate/up weight: the GEMM's own weight when it is exactly [gate; up], else a new
    constant of those rows (the GEMM then drops them: gemm_columns.drop_column_blocks)."""
    weight = attr_tensor(gm, gate.weight)
    if gate.weight is up.weight and gate.start == 0 and up.start == gate.width and weight.shape[0] == 2 * gate.width:
        return gate.weight
    rows = torch.cat([gate.rows(gm), up.rows(gm)]).contiguous()
    node = add_constant(gm, shared_w2.target.replace("down_proj", "gate_up_proj"), rows, before=before,
                        fake_mode=fake_mode)
    record_merge(gm, node, [(source_name(gm, gate), gate.width), (source_name(gm, up), up.width)])
    return node


def _drop_gate_up_gemms(gm: GraphModule, blocks, fake_mode) -> None:
    """After the fused op took over the shared gate/up: the GEMMs lose those columns (a P1 merged GEMM keeps its
    other blocks; a plain GEMM whose output is no longer read goes, with its weight)."""
    for block in {(b.split if b.split is not None else b.mm): b for b in blocks}.values():
        if block.split is not None:
            drop_column_blocks(gm, block.split, fake_mode)
        else:
            erase_if_dead(gm, [block.mm, block.mm.args[1], block.weight])
            drop_unused_constants(gm, [block.weight.target])


def _resolve_crossover(config: FusedMoEDecodeConfig, weights: list[torch.Tensor], top_k: int,
                       act, beta, linear_beta, dtype, shared_w2, shared_glu, latent, shared_w13=None) -> int:
    """latent: (up-projection weight, norm weight, eps) tensors of the layer's latent tail (Nones without);
    shared_w13: the shared expert's gate/up weight when the op computes them (kernel A's shared slot)."""
    if config.crossover_batch is not None:
        if not config.crossover_source:
            config.crossover_source = "config"
        return config.crossover_batch
    w13 = weights[0]
    if w13.is_cuda and moe_decode.triton is not None:
        scales = (weights[2], weights[3]) if len(weights) == 4 else (None, None)
        w2 = weights[1]
        crossover, timings = moe_decode.measure_crossover(
            w13, w2, *scales, shared_w2=shared_w2, top_k=top_k, act=act, beta=beta, linear_beta=linear_beta,
            dtype=dtype, shared_glu=shared_glu, latent_up_w=latent[0], latent_norm_w=latent[1], latent_eps=latent[2],
            shared_w13=shared_w13, grouped_sorted=bool(config.grouped_sorted),
            sorted_finish=bool(config.sorted_finish and config.grouped_sorted))
        summary = ", ".join(f"{n}: {t['fused_us']}/{t['grouped_us']} us" for n, t in timings.items())
        config.crossover_source = (f"measured on {torch.cuda.get_device_name(w13.device)} "
                                   f"(batch: fused/grouped per layer) {summary}")
    else:
        crossover = moe_decode.CPU_CROSSOVER
        config.crossover_source = "fixed (weights not on CUDA)"
    config.crossover_batch = crossover
    return crossover


def _launch_options(config: FusedMoEDecodeConfig) -> tuple:
    """The op's trailing launch options (down_split, shared_l2_prefetch, down_l2_prefetch, up_launch, flag_deps
    (always False), early_release, down_early_release, latent_prewait, grouped_sorted, sorted_finish,
    routed_l2_prefetch, up_prewait), cut after the last one that differs from the op's default: unset, a node keeps
    the arguments it had before the options existed."""
    options = [config.down_split_values(), bool(config.shared_l2_prefetch), bool(config.down_l2_prefetch),
               config.up_launch_values(), False, bool(config.early_release and config.use_pdl),
               bool(config.down_early_release and config.use_pdl), bool(config.latent_prewait and config.use_pdl),
               bool(config.grouped_sorted), bool(config.sorted_finish and config.grouped_sorted),
               bool(config.routed_l2_prefetch and config.use_pdl), bool(config.up_prewait and config.use_pdl)]
    while options and options[-1] in (None, False):
        options.pop()
    return tuple(options)


# Steps whose MoE sees a handful of tokens per request: decode (one) and verify (anchor + drafts, a few). The op
# takes any number of rows (the grouped GEMM from its crossover batch up), so verify graphs get it as well;
# prefill keeps the unfused experts (long chunks: grouped GEMMs over thousands of rows).
TOKEN_STEP_MODES = ("decode", "verify", "verify_snapshot")


@register_pass("p06_fused_moe_decode", FusedMoEDecodeConfig)
def fused_moe_decode(gm: GraphModule, config: FusedMoEDecodeConfig) -> int:
    """Routed experts (+ shared expert combine) of each MoE layer -> one k3.fused_moe_decode (decode only)."""
    if gm.meta.get("k3", {}).get("mode") not in TOKEN_STEP_MODES:
        return 0
    matches, fake_mode = 0, None
    config.skipped_layers = 0
    for moe in [n for n in gm.graph.nodes if is_call(n, *_EXPERT_OPS)]:
        quantized = moe.target is torch.ops.k3.moe_experts_mxfp4.default
        if quantized:
            z, ids, wts, w13, s13, w2, s2, act, beta, linear_beta = moe.args
        else:
            z, ids, wts, w13, w2, act, beta, linear_beta = moe.args
            s13 = s2 = None
        weight_nodes = [w13, w2] + ([s13, s2] if quantized else [])
        if not all(isinstance(w, Node) and w.op == "get_attr" for w in weight_nodes):
            continue
        routed, up_w, norm_w, eps, dead = moe, None, None, 1e-5, []
        latent = _match_latent(moe) if config.fuse_latent else None
        if latent is not None:
            routed, up_w, norm_w, eps, dead = latent
        shared = _match_shared(routed, act, beta, linear_beta) if config.fuse_shared else None
        out, shared_in, shared_up, shared_w2 = routed, None, None, None
        if shared is not None:
            out, shared_in, shared_up, shared_w2, shared_dead = shared
            dead = dead + shared_dead
        tensor = (lambda w: attr_tensor(gm, w) if w is not None else None)
        weights = [tensor(w) for w in (w13, w2, s13, s2, shared_w2, up_w, norm_w)]
        try:  # the op's own argument check on the traced shapes: a layer it would refuse stays as it is
            moe_decode.check_args(val_of(z), val_of(ids), val_of(wts), *weights[:4], val_of(shared_in),
                                  val_of(shared_up), weights[4], act, *weights[5:])
        except ValueError:
            config.skipped_layers += 1
            continue
        fake_mode = fake_mode or fake_mode_of(gm)
        shared_glu, gate_up, shared_w13 = shared_up is not None, None, None
        if config.fuse_shared_up and shared_glu and up_w is None:
            gate_up = _shared_gate_up(gm, z, shared_in, shared_up, weights[4].shape[1], dead)
        if gate_up is not None:
            shared_w13 = _shared_w13_node(gm, *gate_up, shared_w2, out, fake_mode)
            shared_in = shared_up = None
        crossover = _resolve_crossover(
            config, [w for w in weights[:4] if w is not None], val_of(ids).shape[1], act, beta, linear_beta,
            val_of(z).dtype, weights[4], shared_glu, (weights[5], weights[6], eps), tensor(shared_w13))
        with gm.graph.inserting_before(out):
            fused = gm.graph.call_function(FUSED, (z, ids, wts, w13, w2, s13, s2, shared_in, shared_up, shared_w2,
                                                   act, beta, linear_beta, crossover, up_w, norm_w, eps,
                                                   bool(config.use_pdl), shared_w13) + _launch_options(config))
        set_meta_val(fused, fake_mode)
        replace_uses(out, fused, fake_mode)
        erase_if_dead(gm, [out, moe] + dead)
        if gate_up is not None:
            _drop_gate_up_gemms(gm, gate_up, fake_mode)
        matches += 1
    return matches
