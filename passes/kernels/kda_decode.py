"""Fused KDA decode: a whole KDA layer's decode step between its input GEMM and o_proj, in one kernel.

This is the op that pass P5 puts in place of a KDA layer's decode subgraph. For B requests (one
token each), H heads of key dim K and value dim V, C = H*K channels per stream, it computes
exactly what `model_def.layers.kda.KDAMixer.forward` does in decode mode after the projections:

    q, k, v  = SiLU(short conv(x_q / x_k / x_v))     window conv_pool[slot, layer, stream*C + c, :]
                                                       is read and shifted in place; the result is
                                                       rounded to x's dtype (as k3::short_conv_decode)
    g        = Kimi Linear: -exp(A_log[h]) * softplus(f + dt_bias)     (lower_bound None)
               K3:          lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))
    beta     = sigmoid(b)
    q, k     = L2-normalized q * K^-1/2, L2-normalized k
    S        = ssm_pool[slot, layer, h] (fp32, updated in place):
               S <- Diag(exp g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q, rounded to v's dtype
    out      = RMSNorm(o) * norm_weight * sigmoid(gate)                 per head, fp32, in v's dtype

Optionally the op also absorbs the low-rank up-projections that feed it: given `f_b_weight` [H*K, R],
`f` is f_b_proj's input [B, R] and f = f @ f_b_weight^T; given `g_b_weight` [H*V, R] (Kimi Linear's
output gate), `gate` is g_b_proj's input [B, R]. Up to LOW_RANK_IN_KERNEL_MAX_BATCH requests the
kernel does these GEMVs itself (so a Kimi-Linear KDA layer is one kernel between its input GEMM and
o_proj); above it they run as cuBLAS GEMMs first.

`torch.ops.k3.fused_kda_decode(...)` is the single graph node. CPU (and any device or shape the
kernel does not take) runs the reference: the composition of the unfused ops (k3::short_conv_decode,
model_def's kda_gate, k3::kda_decode, the gated RMSNorm), so a CPU engine with P5 gives the same
numbers as one without it. CUDA runs the Triton kernel, one launch: at large batch one program per
(request, head) holding the head's K x V state in column blocks, then the gated RMSNorm over V in the
same program; at small batch (too few programs to fill the GPU) each head's V columns are split over
`v_split_for` programs (model_def/ops/kda_launch.py: the launch layouts), each owning a [K, V / split]
slice of the state; every part stores its gated, not yet RMS-scaled output in fp32 and its sum of
squares, and the last part of the head to arrive (an atomic counter that it zeroes again) scales the
head in one pass and writes the output (no second kernel, no zero fill).

Launch layout: the op's `launch` argument (P5's option) names a layout of model_def/ops/kda_launch.py: V
split, state block width and warps per batch size (the ReplaySSM fold and P16's verify-inputs kernel take
the same name to reproduce the kernel's reductions bit for bit). The CPU reference ignores it.

Programmatic dependent launch: the op's `use_pdl` argument (P5's option, so an engine records it)
launches the kernel with `launch_pdl=True` where Triton and the GPU support it (sm90+); with `prefetch`
(P5's option too) the kernel then loads everything the previous kernel does not write before
`gdc_wait()` -- slot index, conv windows, its first fp32 state block, all weights including the
low-rank up-projections' -- overlapping the previous kernel's tail (why reading the state early is
safe: the comment in the kernel), and calls `gdc_launch_dependents()` once its inputs are read (with
`early_release`, P5's option, right after its wait, so the next kernel -- the out-projection's GEMV -- is resident
and loads its weights while the recurrence runs). The CPU reference ignores all three.

Testing without a GPU: with TRITON_INTERPRET=1 in the environment *before this module is imported*,
`fused_kda_decode_triton` runs on CPU tensors (see tests/passes/kernels/interpret_kda_decode.py).
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from k3compile.model_def.ops import library as k3ops  # noqa: F401  (registers the unfused k3 ops)
from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, block_v_for, check_layout, v_split_for, warps_for
from k3compile.model_def.ops.kda_math import L2_EPS, kda_gate

from .arrivals import arrival_counters
from .pdl import pdl_for

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through the reference
    triton = None

# The kernel walks the [K, V] state in [K, BV] column blocks; heads beyond 128 x 128 run the
# reference (no model we serve has them; the launch heuristics are tuned up to there).
KERNEL_MAX_TILE = 128 * 128
ARRIVALS_OWNER = "kda_decode"  # its counters in kernels.arrivals (one per (request, head) while split)
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus(beta=1, threshold=20), as kda_gate uses
# Above this batch the absorbed low-rank up-projections (f_b_proj, g_b_proj) run as cuBLAS GEMMs before
# the kernel: inside it every (request, head) program re-reads its weight rows, which pays at small
# batch (two launches saved) and costs L2 traffic at large batch.
LOW_RANK_IN_KERNEL_MAX_BATCH = 16
# A program holds f_b_proj's rows for its K channels (and g_b_proj's for a V block) as one register tile
# loaded before gdc_wait up to this many elements (128 x 128: K = rank = 128, the 48B shape); larger ranks
# load in chunks after the wait.
LOW_RANK_TILE_MAX = 128 * 128
# At small batch a head's V columns are split over several programs (one per [K, V / split] slice of the
# state): at batch 1 one program per (request, head) leaves 100 of 132 SMs idle and the kernel latency-bound.
# How many parts, how wide a block and how many warps: a named layout of model_def/ops/kda_launch.py (the
# fold and the verify-inputs kernel follow the same rule; session 4 and kda8's measurements are there).

# --------------------------------------------------------------------------- argument checks

def check_args(q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits,
               gate, norm_weight, conv_pool, ssm_pool, layer, slots, f_b_weight=None,
               g_b_weight=None) -> tuple[int, int, int, int, int]:
    """Raise ValueError naming the first inconsistency; returns (B, H, K, V, conv width)."""
    def need(cond, msg):
        if not cond:
            raise ValueError(f"fused_kda_decode: {msg}")

    def same(shape, want) -> bool:
        # symbolic batch sizes (fake tensors in a captured graph) are not compared: that would add
        # guards tying independent symbols together; eager calls always have int sizes
        return len(shape) == len(want) and all(not (isinstance(a, int) and isinstance(b, int)) or a == b
                                               for a, b in zip(shape, want))

    need(q_in.dim() == 2 and same(k_in.shape, q_in.shape) and same(v_in.shape, q_in.shape),
         f"q/k/v inputs must be [B, H*K] of one shape, got {tuple(q_in.shape)}, {tuple(k_in.shape)}, "
         f"{tuple(v_in.shape)}")
    b, c = q_in.shape
    need(a_log.dim() == 1 and a_log.shape[0] >= 1, f"A_log must be [H], got {tuple(a_log.shape)}")
    h = a_log.shape[0]
    need(c % h == 0, f"{c} channels do not split into {h} heads")
    kd = c // h
    if g_b_weight is None:
        need(gate.dim() == 3 and same(gate.shape[:2], (b, h)),
             f"gate must be [B, H, V] = [{b}, {h}, V], got {tuple(gate.shape)}")
        vd = gate.shape[2]
    else:
        need(g_b_weight.dim() == 2 and g_b_weight.shape[0] % h == 0,
             f"g_b weight must be [H*V, R] with H = {h}, got {tuple(g_b_weight.shape)}")
        vd = g_b_weight.shape[0] // h
        need(gate.dim() == 2 and same(gate.shape, (b, g_b_weight.shape[1])),
             f"low-rank gate input must be [B, R] = [{b}, {g_b_weight.shape[1]}], got {tuple(gate.shape)}")
    need(vd == kd, f"value dim {vd} must equal key dim {kd} (the conv pool stores v with q's channel count)")
    need(norm_weight.shape == (vd,), f"norm weight must be [V] = [{vd}], got {tuple(norm_weight.shape)}")
    for name, w in (("q", q_conv_weight), ("k", k_conv_weight), ("v", v_conv_weight)):
        need(w.dim() == 2 and w.shape[0] == c, f"{name} conv weight must be [{c}, width], got {tuple(w.shape)}")
    width = q_conv_weight.shape[1]
    need(k_conv_weight.shape[1] == width and v_conv_weight.shape[1] == width, "conv widths differ")
    if f_b_weight is None:
        need(same(f.shape, (b, c)), f"forget projection must be [B, H*K] = [{b}, {c}], got {tuple(f.shape)}")
    else:
        need(f_b_weight.dim() == 2 and f_b_weight.shape[0] == c,
             f"f_b weight must be [H*K = {c}, R], got {tuple(f_b_weight.shape)}")
        need(f.dim() == 2 and same(f.shape, (b, f_b_weight.shape[1])),
             f"low-rank forget input must be [B, R] = [{b}, {f_b_weight.shape[1]}], got {tuple(f.shape)}")
    need(dt_bias.shape == (c,), f"dt_bias must be [H*K] = [{c}], got {tuple(dt_bias.shape)}")
    need(same(beta_logits.shape, (b, h)), f"beta logits must be [B, H] = [{b}, {h}], got {tuple(beta_logits.shape)}")
    need(conv_pool.dim() == 4 and same(conv_pool.shape[2:], (3 * c, width - 1)),
         f"conv pool must be [slots, layers, 3*H*K = {3 * c}, width-1 = {width - 1}], got {tuple(conv_pool.shape)}")
    need(ssm_pool.dim() == 5 and same(ssm_pool.shape[2:], (h, kd, vd)) and ssm_pool.dtype == torch.float32,
         f"ssm pool must be fp32 [slots, layers, {h}, {kd}, {vd}], got {ssm_pool.dtype} {tuple(ssm_pool.shape)}")
    layers = (ssm_pool.shape[1], conv_pool.shape[1])
    need(layer >= 0 and all(not isinstance(n, int) or layer < n for n in layers),
         f"layer {layer} out of range for pools with {ssm_pool.shape[1]} / {conv_pool.shape[1]} layers")
    need(same(slots.shape, (b,)) and not slots.dtype.is_floating_point,
         f"slots must be an integer [B] = [{b}] tensor, got {slots.dtype} {tuple(slots.shape)}")
    return b, h, kd, vd, width


# --------------------------------------------------------------------------- CPU reference

def expand_low_rank(f, gate, f_b_weight, g_b_weight, heads: int):
    """The low-rank up-projections the op may absorb, as the unfused graph computes them (mm, t)."""
    if f_b_weight is not None:
        f = torch.mm(f, f_b_weight.t())
    if g_b_weight is not None:
        gate = torch.mm(gate, g_b_weight.t()).unflatten(-1, (heads, -1))
    return f, gate


def fused_kda_decode_reference(q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias, a_log,
                               beta_logits, gate, norm_weight, conv_pool, ssm_pool, layer, slots, lower_bound,
                               norm_eps, f_b_weight=None, g_b_weight=None):
    """The unfused ops, composed exactly as KDAMixer.forward calls them in decode."""
    b, h, kd, vd, _ = check_args(q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias, a_log,
                                 beta_logits, gate, norm_weight, conv_pool, ssm_pool, layer, slots, f_b_weight,
                                 g_b_weight)
    f, gate = expand_low_rank(f, gate, f_b_weight, g_b_weight, h)
    c = h * kd
    conv = torch.ops.k3.short_conv_decode
    q = conv(q_in, q_conv_weight, conv_pool, layer, 0, slots).unflatten(-1, (h, kd))
    k = conv(k_in, k_conv_weight, conv_pool, layer, c, slots).unflatten(-1, (h, kd))
    v = conv(v_in, v_conv_weight, conv_pool, layer, 2 * c, slots).unflatten(-1, (h, vd))
    g = kda_gate(f, a_log, dt_bias, kd, lower_bound)
    beta = torch.sigmoid(beta_logits.float())
    o = torch.ops.k3.kda_decode(q, k, v, g, beta, ssm_pool, layer, slots)
    # model_def.layers.common.GatedRMSNorm
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.float()
    return (of * torch.sigmoid(gate.float())).to(o.dtype)


# --------------------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def _low_rank_rows(x_row_ptr, w_ptr, rows, row_mask, RANK: tl.constexpr, BROWS: tl.constexpr,
                       BR: tl.constexpr):
        """(W[rows, :] @ x) for one token, fp32 accumulation, rounded to x's dtype; W is [*, RANK] row-major."""
        acc = tl.zeros([BROWS], dtype=tl.float32)
        for r0 in range(0, RANK, BR):
            r = r0 + tl.arange(0, BR)
            mr = r < RANK
            x = tl.load(x_row_ptr + r, mask=mr, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * RANK + r[None, :], mask=row_mask[:, None] & mr[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        return acc.to(x_row_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _low_rank_tile(w_ptr, rows, row_mask, RANK: tl.constexpr, RPAD: tl.constexpr):
        """W[rows, :] as one [rows, RPAD] tile (W is [*, RANK] row-major): loadable before gdc_wait."""
        r = tl.arange(0, RPAD)
        return tl.load(w_ptr + rows[:, None] * RANK + r[None, :], mask=row_mask[:, None] & (r[None, :] < RANK),
                       other=0.0)

    @triton.jit
    def _low_rank_apply(x_row_ptr, w, RANK: tl.constexpr, RPAD: tl.constexpr):
        """(w @ x) for one token with a tile from `_low_rank_tile`, fp32 accumulation, rounded to x's dtype."""
        r = tl.arange(0, RPAD)
        x = tl.load(x_row_ptr + r, mask=r < RANK, other=0.0).to(tl.float32)
        return tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(x_row_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _conv_taps(x_row_ptr, w_ptr, win_ptr, chans, mask, WIDTH: tl.constexpr, WPAD: tl.constexpr):
        """What one short-conv step needs besides this token's x: the window [chans, WIDTH-1] at win_ptr
        (cast to x's dtype, as the unfused op does) and the conv weights. Nothing here comes from the
        previous kernel, so it may load before gdc_wait."""
        x_dtype = x_row_ptr.dtype.element_ty
        j = tl.arange(0, WPAD)
        mj = mask[:, None] & (j[None, :] < WIDTH - 1)
        hist = tl.load(win_ptr + chans[:, None] * (WIDTH - 1) + j[None, :], mask=mj, other=0.0).to(x_dtype)
        w = tl.load(w_ptr + chans[:, None] * WIDTH + j[None, :], mask=mj, other=0.0).to(tl.float32)
        w_last = tl.load(w_ptr + chans * WIDTH + WIDTH - 1, mask=mask, other=0.0).to(tl.float32)
        return hist, w, w_last

    @triton.jit
    def _conv_apply(x_row_ptr, chans, mask, hist, w, w_last):
        """The conv step + SiLU from `_conv_taps` and this token's x: (output rounded to x's dtype as
        k3::short_conv_decode does, in fp32; x)."""
        x_dtype = x_row_ptr.dtype.element_ty
        x = tl.load(x_row_ptr + chans, mask=mask, other=0.0)
        acc = tl.sum(w * hist.to(tl.float32), axis=1)
        acc += w_last * x.to(tl.float32)
        return (acc * tl.sigmoid(acc)).to(x_dtype).to(tl.float32), x

    @triton.jit
    def _short_conv_read(x_row_ptr, w_ptr, win_ptr, chans, mask, WIDTH: tl.constexpr, WPAD: tl.constexpr):
        """One causal depthwise conv step + SiLU for channels `chans` from the window [chans, WIDTH-1] at
        win_ptr and this token's x. Returns (output rounded to x's dtype as k3::short_conv_decode does, in
        fp32; the window as read; x): `_short_conv_write` later shifts the window in place."""
        hist, w, w_last = _conv_taps(x_row_ptr, w_ptr, win_ptr, chans, mask, WIDTH, WPAD)
        out, x = _conv_apply(x_row_ptr, chans, mask, hist, w, w_last)
        return out, hist, x

    @triton.jit
    def _short_conv_write(win_ptr, chans, mask, hist, x, WIDTH: tl.constexpr, WPAD: tl.constexpr):
        """Shift the window read by `_short_conv_read` one step and append x (in place)."""
        pool_dtype = win_ptr.dtype.element_ty
        j = tl.arange(0, WPAD)
        mj = mask[:, None] & (j[None, :] < WIDTH - 1)
        tl.store(win_ptr + chans[:, None] * (WIDTH - 1) + j[None, :] - 1, hist.to(pool_dtype),
                 mask=mj & (j[None, :] >= 1))
        tl.store(win_ptr + chans * (WIDTH - 1) + WIDTH - 2, x.to(pool_dtype), mask=mask & (WIDTH > 1))

    @triton.jit
    def _norm_gate(gate_row_ptr, gate_head, wgb_ptr, normw_ptr, head, ov, mv, V: tl.constexpr, G_RANK: tl.constexpr,
                   BV: tl.constexpr, BR: tl.constexpr):
        """norm_weight * sigmoid(gate) for columns `ov` of head `head` (G_RANK > 0: g_b_proj's GEMV here)."""
        if G_RANK > 0:
            gate = _low_rank_rows(gate_row_ptr, wgb_ptr, head * V + ov, mv, G_RANK, BV, BR)
        else:
            gate = tl.load(gate_row_ptr + head * gate_head + ov, mask=mv, other=0.0).to(tl.float32)
        return tl.load(normw_ptr + ov, mask=mv, other=0.0).to(tl.float32) * tl.sigmoid(gate)

    @triton.jit
    def _gain_weights(normw_ptr, wgb_ptr, head, ov, mv, V: tl.constexpr, G_RANK: tl.constexpr,
                      G_TILE: tl.constexpr):
        """The gated norm's weights for columns `ov` of head `head`: (norm weight, g_b_proj's rows as a tile
        when G_TILE > 0, else the norm weight again as a placeholder). Loadable before gdc_wait."""
        nw = tl.load(normw_ptr + ov, mask=mv, other=0.0).to(tl.float32)
        if G_TILE > 0:
            gw = _low_rank_tile(wgb_ptr, head * V + ov, mv, G_RANK, G_TILE)
        else:
            gw = nw
        return nw, gw

    @triton.jit
    def _gain(gate_row_ptr, gate_head, wgb_ptr, head, ov, mv, nw, gw, V: tl.constexpr, G_RANK: tl.constexpr,
              G_TILE: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
        """norm_weight * sigmoid(gate) for columns `ov` from `_gain_weights` (G_RANK > 0: g_b_proj's GEMV here)."""
        if G_TILE > 0:
            gate = _low_rank_apply(gate_row_ptr, gw, G_RANK, G_TILE)
        elif G_RANK > 0:
            gate = _low_rank_rows(gate_row_ptr, wgb_ptr, head * V + ov, mv, G_RANK, BV, BR)
        else:
            gate = tl.load(gate_row_ptr + head * gate_head + ov, mask=mv, other=0.0).to(tl.float32)
        return nw * tl.sigmoid(gate)

    @triton.jit
    def _v_block_taps(s_base, xv_row_ptr, wv_ptr, v_win, normw_ptr, wgb_ptr, head, ok, mk, ov, mv,
                      V: tl.constexpr, WIDTH: tl.constexpr, WPAD: tl.constexpr, G_RANK: tl.constexpr,
                      G_TILE: tl.constexpr):
        """Everything a V block needs that the previous kernel does not write: the [K, BV] state block (this
        kernel's own output one step earlier), v's conv window and weights, the gated norm's weights."""
        s = tl.load(s_base + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        hist, w, w_last = _conv_taps(xv_row_ptr, wv_ptr, v_win, head * V + ov, mv, WIDTH, WPAD)
        nw, gw = _gain_weights(normw_ptr, wgb_ptr, head, ov, mv, V, G_RANK, G_TILE)
        return s, hist, w, w_last, nw, gw

    @triton.jit
    def _fused_kda_decode_kernel(
        xq_ptr, xk_ptr, xv_ptr, xq_row, xk_row, xv_row,
        wq_ptr, wk_ptr, wv_ptr,
        f_ptr, f_row, wfb_ptr, dt_ptr, alog_ptr,
        b_ptr, b_row, b_col,
        gate_ptr, gate_row, gate_head, wgb_ptr,
        normw_ptr,
        conv_ptr, conv_slot_stride, conv_layer_offset,
        ssm_ptr, ssm_slot_stride, ssm_layer_offset,
        slots_ptr, out_ptr, part_ptr, sumsq_ptr, arrivals_ptr,
        lower_bound, norm_eps, scale,
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WIDTH: tl.constexpr, WPAD: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, VPAD: tl.constexpr, V_SPLIT: tl.constexpr, V_PER: tl.constexpr,
        SPLIT_PAD: tl.constexpr,
        N_BLOCKS: tl.constexpr, SOFTPLUS_GATE: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
        F_RANK: tl.constexpr, F_TILE: tl.constexpr, G_RANK: tl.constexpr, G_TILE: tl.constexpr, BR: tl.constexpr,
        L2EPS: tl.constexpr, EARLY: tl.constexpr = False,
    ):
        # Program (request, head, part): the head's q/k conv channels, V_PER = V / V_SPLIT of its V
        # columns (their conv channels, the [K, V_PER] slice of the state, walked in N_BLOCKS [K, BV] blocks,
        # unrolled, each block's loads issued one block ahead).
        # V_SPLIT == 1: the whole head, gated RMSNorm in place at the end. V_SPLIT > 1: each part stores
        # o * norm_weight * sigmoid(gate) in fp32 and its sum of o^2; the last part of the head to arrive
        # (an acq_rel counter, zeroed again by it) shifts the q/k windows (every part has read them by
        # then), and scales the whole head by the RMS into `out`.
        # Conv pool per (slot, layer): [3 * H * K channels, WIDTH - 1] (q, k, v streams stacked, window
        # oldest first); state per (slot, layer): [H, K, V] row-major.
        #
        # PDL (USE_PDL): with PREFETCH everything the previous kernel does not write loads before gdc_wait:
        # the slot index (the step's input buffer, written before the graph), the conv windows, the
        # first state block, all weights. The windows and the state are written only by this same kernel
        # one step (one layer's chain) earlier, which has finished: every kernel of the chain calls
        # gdc_wait before gdc_launch_dependents, so a kernel's start implies all kernels two back have
        # finished, and graph replays are serialized. Without PREFETCH the wait comes first (after A_log
        # and dt_bias): the schedule before the prefetch, kept as the bench's baseline.
        pid = tl.program_id(0)
        part = tl.program_id(1)
        req = (pid // H).to(tl.int64)
        head = pid % H
        C: tl.constexpr = H * K
        ok = tl.arange(0, BK)
        mk = ok < K
        ch = head * K + ok  # channel within a stream

        a = tl.exp(tl.load(alog_ptr + head).to(tl.float32))
        dt = tl.load(dt_ptr + ch, mask=mk, other=0.0).to(tl.float32)
        if USE_PDL and not PREFETCH:
            tl.extra.cuda.gdc_wait()

        slot = tl.load(slots_ptr + req).to(tl.int64)
        conv_base = conv_ptr + slot * conv_slot_stride + conv_layer_offset
        q_win, k_win = conv_base, conv_base + C * (WIDTH - 1)
        v_win = conv_base + 2 * C * (WIDTH - 1)
        q_hist, q_w, q_w_last = _conv_taps(xq_ptr, wq_ptr, q_win, ch, mk, WIDTH, WPAD)
        k_hist, k_w, k_w_last = _conv_taps(xk_ptr, wk_ptr, k_win, ch, mk, WIDTH, WPAD)
        if F_TILE > 0:
            wf = _low_rank_tile(wfb_ptr, ch, mk, F_RANK, F_TILE)
        bh = req * H + head
        s_base = ssm_ptr + slot * ssm_slot_stride + ssm_layer_offset + head * K * V
        xv_row_ptr = xv_ptr + req * xv_row
        v_begin = part * V_PER
        v_end = v_begin + V_PER
        ov = v_begin + tl.arange(0, BV)
        mv = (ov < V) & (ov < v_end)
        s_raw, v_hist, v_w, v_w_last, nw, gw = _v_block_taps(s_base, xv_row_ptr, wv_ptr, v_win, normw_ptr, wgb_ptr,
                                                             head, ok, mk, ov, mv, V, WIDTH, WPAD, G_RANK, G_TILE)
        if USE_PDL and PREFETCH:
            tl.extra.cuda.gdc_wait()
        if USE_PDL and EARLY:  # release the next kernel now (after our wait, as every kernel of the chain)
            tl.extra.cuda.gdc_launch_dependents()

        # ---- q, k: short conv + SiLU, L2 norm (epsilon inside the sqrt, as fla)
        q, q_x = _conv_apply(xq_ptr + req * xq_row, ch, mk, q_hist, q_w, q_w_last)
        k, k_x = _conv_apply(xk_ptr + req * xk_row, ch, mk, k_hist, k_w, k_w_last)
        if V_SPLIT == 1:
            tl.debug_barrier()  # every thread holding a copy of these channels has read the window
            _short_conv_write(q_win, ch, mk, q_hist, q_x, WIDTH, WPAD)
            _short_conv_write(k_win, ch, mk, k_hist, k_x, WIDTH, WPAD)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + L2EPS) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + L2EPS)

        # ---- decay gate (F_RANK > 0: f_b_proj's GEMV here) and beta
        if F_TILE > 0:
            f_raw = _low_rank_apply(f_ptr + req * f_row, wf, F_RANK, F_TILE)
        elif F_RANK > 0:
            f_raw = _low_rank_rows(f_ptr + req * f_row, wfb_ptr, ch, mk, F_RANK, BK, BR)
        else:
            f_raw = tl.load(f_ptr + req * f_row + ch, mask=mk, other=0.0).to(tl.float32)
        fx = f_raw + dt
        if SOFTPLUS_GATE:
            g = -a * tl.where(fx > 20.0, fx, tl.log(1.0 + tl.exp(tl.minimum(fx, 20.0))))
        else:
            g = lower_bound * tl.sigmoid(a * fx)
        decay = tl.where(mk, tl.exp(g), 0.0)
        beta = tl.sigmoid(tl.load(b_ptr + req * b_row + head * b_col).to(tl.float32))

        # ---- per V block: v's conv, the delta rule on the fp32 state in place, o = S^T q
        out_row = out_ptr + bh * V
        out_dtype = out_ptr.dtype.element_ty
        sum_sq = tl.zeros([BV], dtype=tl.float32)
        for blk in tl.static_range(N_BLOCKS):
            ov = v_begin + blk * BV + tl.arange(0, BV)
            mv = (ov < V) & (ov < v_end)
            s_cur, hist_cur, w_cur, w_last_cur, nw_cur, gw_cur = s_raw, v_hist, v_w, v_w_last, nw, gw
            if blk + 1 < N_BLOCKS:  # the next block's loads overlap this block's arithmetic
                ov_next = ov + BV
                s_raw, v_hist, v_w, v_w_last, nw, gw = _v_block_taps(
                    s_base, xv_row_ptr, wv_ptr, v_win, normw_ptr, wgb_ptr, head, ok, mk, ov_next,
                    (ov_next < V) & (ov_next < v_end), V, WIDTH, WPAD, G_RANK, G_TILE)
            v, v_x = _conv_apply(xv_row_ptr, head * V + ov, mv, hist_cur, w_cur, w_last_cur)
            s_ptrs = s_base + ok[:, None] * V + ov[None, :]
            m2 = mk[:, None] & mv[None, :]
            s = s_cur * decay[:, None]
            kv_mem = tl.sum(s * k[:, None], axis=0)  # S^T k: [BV]
            s += k[:, None] * ((v - kv_mem) * beta)[None, :]
            tl.debug_barrier()  # all copies of this block (and of v's window) are read before any is overwritten
            _short_conv_write(v_win, head * V + ov, mv, hist_cur, v_x, WIDTH, WPAD)
            tl.store(s_ptrs, s, mask=m2)
            o = tl.sum(s * q[:, None], axis=0).to(out_dtype)  # k3::kda_decode returns v's dtype
            of = o.to(tl.float32)
            sum_sq += tl.where(mv, of * of, 0.0)
            if V_SPLIT == 1:
                tl.store(out_row + ov, o, mask=mv)
            else:
                gain = _gain(gate_ptr + req * gate_row, gate_head, wgb_ptr, head, ov, mv, nw_cur, gw_cur, V, G_RANK,
                             G_TILE, BV, BR)
                tl.store(part_ptr + bh * V + ov, of * gain, mask=mv)
        if USE_PDL and not EARLY:
            tl.extra.cuda.gdc_launch_dependents()

        if V_SPLIT == 1:
            # ---- gated RMSNorm over V (G_RANK > 0: g_b_proj's GEMV here), rewriting o in place
            inv_rms = tl.rsqrt(tl.sum(sum_sq, axis=0) / V + norm_eps)
            tl.debug_barrier()  # o's blocks, stored above by other threads, are visible
            for v0 in range(0, V, BV):
                ov = v0 + tl.arange(0, BV)
                mv = ov < V
                gain = _norm_gate(gate_ptr + req * gate_row, gate_head, wgb_ptr, normw_ptr, head, ov, mv, V, G_RANK, BV,
                                  BR)
                o_blk = tl.load(out_row + ov, mask=mv, other=0.0).to(tl.float32)  # not `o`: that one is v's dtype
                y = o_blk * inv_rms * gain                                         # (Triton 3.6: one type per name)
                tl.debug_barrier()
                tl.store(out_row + ov, y.to(out_dtype), mask=mv)
        else:
            # ---- the head's last part to arrive: q/k windows, then the RMS over all parts
            tl.store(sumsq_ptr + bh * V_SPLIT + part, tl.sum(sum_sq, axis=0))
            tl.debug_barrier()  # this program's stores (and window reads) precede its arrival
            arrived = tl.atomic_add(arrivals_ptr + bh, 1, sem="acq_rel")
            if arrived == V_SPLIT - 1:
                tl.atomic_xchg(arrivals_ptr + bh, 0)  # zero again for the next launch
                _short_conv_write(q_win, ch, mk, q_hist, q_x, WIDTH, WPAD)
                _short_conv_write(k_win, ch, mk, k_hist, k_x, WIDTH, WPAD)
                # the whole head's gated outputs and the parts' sums of squares as two loads issued back to back
                # (not a loop over V blocks: this tail is the kernel's last serial step). Fresh names: in a
                # runtime `if`, reassigning a name from before it with another shape fails to compile
                head_cols = tl.arange(0, VPAD)
                head_mask = head_cols < V
                y_head = tl.load(part_ptr + bh * V + head_cols, mask=head_mask, other=0.0, cache_modifier=".cg")
                sp = tl.arange(0, SPLIT_PAD)
                parts = tl.load(sumsq_ptr + bh * V_SPLIT + sp, mask=sp < V_SPLIT, other=0.0, cache_modifier=".cg")
                inv_rms = tl.rsqrt(tl.sum(parts, axis=0) / V + norm_eps)
                tl.store(out_row + head_cols, (y_head * inv_rms).to(out_dtype), mask=head_mask)


def kernel_supports(head_dim: int, value_dim: int) -> bool:
    return (triton is not None and head_dim == value_dim
            and triton.next_power_of_2(head_dim) * triton.next_power_of_2(value_dim) <= KERNEL_MAX_TILE)


def _row_major_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows may be strided (column blocks of a merged GEMM's output); elements within a row must not."""
    return t if t.stride(-1) == 1 else t.contiguous()


# NO_FMA_WHY: P5, the verify-inputs kernel and the ReplaySSM fold (runtime/spec/fold_kernel.py) are compiled without
# FMA contraction (enable_fp_fusion=False). They spell the recurrence alike, but the compiler contracts a*b+c into
# one FMA (one rounding instead of two) depending on the code around it, so the fold's state differed from P5's
# by one ulp on the H200 (fp32, K = 16); with every mul and add rounded as written, the same expressions give the
# same bits, as under TRITON_INTERPRET. These kernels are latency-bound: the extra instructions cost little.


def fused_kda_decode_triton(q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias, a_log,
                            beta_logits, gate, norm_weight, conv_pool, ssm_pool, layer, slots, lower_bound,
                            norm_eps, f_b_weight=None, g_b_weight=None, use_pdl: bool = False,
                            num_warps: int | None = None, v_split: int | None = None, prefetch: bool = True,
                            block_v: int | None = None, layout: str = DEFAULT_LAYOUT,
                            early_release: bool = False) -> torch.Tensor:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). v_split: parts
    per head along V, block_v (columns per state block, a power of 2) and num_warps default to what the
    launch `layout` (model_def/ops/kda_launch.py) picks for this batch; v_split 1 = one program per (request,
    head). prefetch: with PDL, load what the previous kernel does not write before gdc_wait (False: wait
    first). The fold (runtime/spec/fold_kernel.py) and the verify-inputs kernel use the same layout's blocks:
    overriding block_v / num_warps changes the reduction order they reproduce bit for bit. early_release: with PDL,
    release the next kernel right after the wait instead of after the state loop (same arithmetic)."""
    if triton is None:
        raise RuntimeError("fused_kda_decode: triton is not installed")
    b, h, kd, vd, width = check_args(q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias,
                                     a_log, beta_logits, gate, norm_weight, conv_pool, ssm_pool, layer, slots,
                                     f_b_weight, g_b_weight)
    if not kernel_supports(kd, vd):
        raise ValueError(f"fused_kda_decode kernel: needs K == V and a K x V tile <= {KERNEL_MAX_TILE}, "
                         f"got K={kd}, V={vd}")
    # the pools are written in place, so they cannot be copied: their inner blocks must be dense
    if conv_pool.stride(3) != 1 or conv_pool.stride(2) != width - 1:
        raise ValueError("fused_kda_decode kernel: conv pool [slot, layer] blocks must be row-major")
    if ssm_pool.stride(4) != 1 or ssm_pool.stride(3) != vd or ssm_pool.stride(2) != kd * vd:
        raise ValueError("fused_kda_decode kernel: ssm pool [slot, layer] blocks must be row-major")
    check_layout(layout)
    split = v_split_for(layout, b, h, vd) if v_split is None else int(v_split)
    if split < 1 or vd % split:
        raise ValueError(f"fused_kda_decode kernel: v_split {split} must be >= 1 and divide V = {vd}")
    q_in, k_in, v_in, f, gate = (_row_major_rows(t) for t in (q_in, k_in, v_in, f, gate))
    wq, wk, wv = (w.contiguous() for w in (q_conv_weight, k_conv_weight, v_conv_weight))
    dt_bias, a_log, norm_weight = dt_bias.contiguous(), a_log.contiguous(), norm_weight.contiguous()
    f_rank = 0 if f_b_weight is None else f_b_weight.shape[1]
    g_rank = 0 if g_b_weight is None else g_b_weight.shape[1]
    wfb = f if f_b_weight is None else f_b_weight.contiguous()  # (unused pointer when the rank is 0)
    wgb = gate if g_b_weight is None else g_b_weight.contiguous()
    out = torch.empty(b, h, vd, dtype=v_in.dtype, device=v_in.device)
    if b == 0:
        return out
    if split > 1:  # fp32 gated-but-unscaled outputs and per-part sums of squares (no zero fill needed)
        part = torch.empty(b * h * vd, dtype=torch.float32, device=v_in.device)
        sumsq = torch.empty(b * h * split, dtype=torch.float32, device=v_in.device)
        arrivals = arrival_counters(v_in.device, b * h, ARRIVALS_OWNER)
    else:
        part = sumsq = arrivals = out  # unused
    use_pdl = pdl_for(use_pdl, v_in)
    v_per = vd // split
    bk = triton.next_power_of_2(kd)
    bv = block_v_for(layout, split, vd) if block_v is None else int(block_v)
    if bv < 1 or bv & (bv - 1):
        raise ValueError(f"fused_kda_decode kernel: block_v {bv} must be a power of 2")
    # the low-rank weights load as one tile (before gdc_wait) while it is small; else in chunks after it
    # (g_b_proj's rows are read inside the V loop only when the head is split; else in the norm's loop, in chunks)
    f_tile, g_tile = (triton.next_power_of_2(r) if r and rows * triton.next_power_of_2(r) <= LOW_RANK_TILE_MAX
                      else 0 for r, rows in ((f_rank, bk), (g_rank if split > 1 else 0, bv)))
    if num_warps is None:
        num_warps = warps_for(layout, kd, bv)
    extra = {"launch_pdl": True} if use_pdl else {}
    if use_pdl and early_release:
        extra["EARLY"] = True
    _fused_kda_decode_kernel[(b * h, split)](
        q_in, k_in, v_in, q_in.stride(0), k_in.stride(0), v_in.stride(0),
        wq, wk, wv,
        f, f.stride(0), wfb, dt_bias, a_log,
        beta_logits, beta_logits.stride(0), beta_logits.stride(1),
        gate, gate.stride(0), gate.stride(1) if g_b_weight is None else 0, wgb,
        norm_weight,
        conv_pool, conv_pool.stride(0), layer * conv_pool.stride(1),
        ssm_pool, ssm_pool.stride(0), layer * ssm_pool.stride(1),
        slots, out, part, sumsq, arrivals,
        float(lower_bound) if lower_bound is not None else 0.0, float(norm_eps), kd ** -0.5,
        H=h, K=kd, V=vd, WIDTH=width, WPAD=triton.next_power_of_2(max(width - 1, 1)), BK=bk, BV=bv,
        VPAD=triton.next_power_of_2(vd), V_SPLIT=split, V_PER=v_per, SPLIT_PAD=max(2, triton.next_power_of_2(split)),
        N_BLOCKS=-(-v_per // bv),
        SOFTPLUS_GATE=lower_bound is None, USE_PDL=bool(use_pdl), PREFETCH=bool(prefetch),
        F_RANK=f_rank, F_TILE=f_tile, G_RANK=g_rank, G_TILE=g_tile,
        BR=min(32, triton.next_power_of_2(max(f_rank, g_rank, 1))), L2EPS=L2_EPS,
        num_warps=num_warps, enable_fp_fusion=False, **extra,  # see NO_FMA_WHY
    )
    return out


# --------------------------------------------------------------------------- the k3 op

@custom_op("k3::fused_kda_decode", mutates_args=("conv_pool", "ssm_pool"))
def fused_kda_decode(q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor, q_conv_weight: torch.Tensor,
                     k_conv_weight: torch.Tensor, v_conv_weight: torch.Tensor, f: torch.Tensor,
                     dt_bias: torch.Tensor, a_log: torch.Tensor, beta_logits: torch.Tensor, gate: torch.Tensor,
                     norm_weight: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, layer: int,
                     slots: torch.Tensor, lower_bound: float | None, norm_eps: float,
                     f_b_weight: torch.Tensor | None = None, g_b_weight: torch.Tensor | None = None,
                     use_pdl: bool = False, prefetch: bool = True, launch: str = DEFAULT_LAYOUT,
                     early_release: bool = False) -> torch.Tensor:
    """A KDA layer's decode step after its input GEMM: [B, H, V] gated-norm output. See module doc.
    launch: the kernel's launch layout, a name in model_def/ops/kda_launch.py."""
    check_layout(launch)
    return fused_kda_decode_reference(q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias,
                                      a_log, beta_logits, gate, norm_weight, conv_pool, ssm_pool, layer, slots,
                                      lower_bound, norm_eps, f_b_weight, g_b_weight)


@fused_kda_decode.register_kernel("cuda")
def _fused_kda_decode_cuda(q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias, a_log,
                           beta_logits, gate, norm_weight, conv_pool, ssm_pool, layer, slots, lower_bound, norm_eps,
                           f_b_weight=None, g_b_weight=None, use_pdl=False, prefetch=True, launch=DEFAULT_LAYOUT,
                           early_release=False):
    h = a_log.shape[0]
    if q_in.shape[0] > LOW_RANK_IN_KERNEL_MAX_BATCH:  # cuBLAS reads each weight once for the whole batch
        f, gate = expand_low_rank(f, gate, f_b_weight, g_b_weight, h)
        f_b_weight = g_b_weight = None
    args = (q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits, gate,
            norm_weight, conv_pool, ssm_pool, layer, slots, lower_bound, norm_eps, f_b_weight, g_b_weight)
    vd = gate.shape[-1] if g_b_weight is None else g_b_weight.shape[0] // h
    if kernel_supports(q_in.shape[-1] // h, vd):
        with torch.cuda.device(q_in.device):  # Triton launches on the current device
            return fused_kda_decode_triton(*args, use_pdl=use_pdl, prefetch=prefetch, layout=launch,
                                           early_release=early_release)
    return fused_kda_decode_reference(*args)


@fused_kda_decode.register_fake
def _fused_kda_decode_fake(q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias, a_log,
                           beta_logits, gate, norm_weight, conv_pool, ssm_pool, layer, slots, lower_bound, norm_eps,
                           f_b_weight=None, g_b_weight=None, use_pdl=False, prefetch=True, launch=DEFAULT_LAYOUT,
                           early_release=False):
    check_layout(launch)
    b, h, _, vd, _ = check_args(q_in, k_in, v_in, q_conv_weight, k_conv_weight, v_conv_weight, f, dt_bias, a_log,
                                beta_logits, gate, norm_weight, conv_pool, ssm_pool, layer, slots, f_b_weight,
                                g_b_weight)
    return v_in.new_empty(b, h, vd)
