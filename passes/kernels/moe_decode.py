"""Fused MoE decode: the routed experts as per-(token, expert) GEMVs, the shared expert in the epilogue.

The op pass P6 puts in place of a decode step's `k3::moe_experts` (+ the shared expert's
down-projection and the add that combines the two):

    u[t] = Σ_j w[t, j] · W2[e_tj] · act(W1[e_tj] x[t], W3[e_tj] x[t])      e_tj = topk_ids[t, j]
    y[t] = u[t]  |  Wup · RMSNorm(u[t])  |  Wup · u[t]                      latent MoE (K3): norm, up-proj
           (+ Ws2 · act(sg[t], su[t]))                                      the shared expert
           (+ Ws2 · a[t])                                                   ... or its activated input

`torch.ops.k3.fused_moe_decode(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
shared_in, shared_up, shared_w2, act, beta, linear_beta, crossover, latent_up_w=None,
latent_norm_w=None, latent_eps=1e-5)`:

  * x [N, D]; topk_ids [N, k] (int); topk_weights [N, k] (fp32).
  * w13 [E, 2I, D] (rows [0, I) gate, [I, 2I) up) and w2 [E, Do, I] in a float dtype, or, with
    w13_scale / w2_scale given, MXFP4: uint8 codes [E, 2I, D/2] / [E, Do, I/2] and E8M0 scales
    [E, 2I, D/32] / [E, Do, I/32] (layout: `model_def.ops.mxfp4`).
  * shared_w2 [Do, Is] with shared_in [N, Is] and shared_up [N, Is]: the shared expert's gate and
    up pre-activations, activated here; shared_up None: shared_in is already activated.
  * shared_w13 [2 Is, D] (rows [0, Is) gate, [Is, 2Is) up; dense, x's width) instead of shared_in /
    shared_up: the shared expert's gate/up GEMM on x itself, which kernel A then runs as one more slot
    (full-width MoE only: a latent MoE's shared expert reads the hidden state, not the op's x).
  * act "silu" or "situ" with its beta / linear_beta (model_def.ops.moe_math.glu_act).
  * latent_up_w [D, Do] (K3's routed_expert_up_proj) and optionally latent_norm_w [Do] (its
    routed_expert_norm, eps latent_eps; RMSNorm as model_def.layers.common.RMSNorm); the shared
    expert then adds on the D side.
  * crossover: from this many tokens on, CUDA runs the grouped-GEMM path (moe_math.moe_experts_
    grouped, weights read once per expert) instead of the GEMVs (weights read once per token).

CPU (the reference) is the exact composition of the unfused graph: moe_experts_loop, then
`glu_act` + `linear` for the shared expert, then the add. CUDA below the crossover runs two
Triton kernels:

  A `_expert_up_kernel`, one program per (token, expert slot, column block of I): GEMV of x[t]
    with the gate and up rows of the expert, activation in registers, h [N, k, I] in fp32. With
    shared_w13, N more programs per column block (the shared slot, grid rows N k .. N (k+1)) run the
    shared expert's gate/up rows and store its activated input hs [N, Is] (fp32), which B reads as an
    already activated shared input: the shared gate/up GEMM is no separate kernel. The slot runs the
    routed rows' own loop (so the kernel's register budget stays theirs) and waits for x under PDL.
    Option shared_l2_prefetch: the grid is transposed so the shared slot's programs launch first (resident while
    the router kernel before A runs), and under PDL each asks L2 for its static gate/up rows before its wait
    (kernels.l2_prefetch); down_l2_prefetch does the same for B''s shared slot (W2 rows). Same output bits.
  B `_expert_down_kernel`, one program per (token, column block of Do): for each of the token's k
    experts the GEMV of W2's block with h, scaled by its routing weight and summed in registers;
    then the shared expert's GEMV over the same block; one store.
  B' `_expert_down_split_kernel` (the "split" design of B, for small batches): one program per (token x
    column block of Do, slot, K chunk), the slots being the token's k experts and the shared expert, each
    slot's K cut into k_split chunks (launch per shape: moe_launch.SPLIT_TUNED / split_config, or the op's
    down_split);
    each stores its fp32 partial, and the group's last program to arrive (an atomic counter that it zeroes
    again, from kernels.arrivals: the one atomic in these kernels) sums them in (slot, chunk) order and stores
    the block. Option flag_deps (the op's only, for tools/bench_moe11.py; no pass sets it): instead of B''s grid-wide
    wait for kernel A (PDL's gdc_wait), A releases B' right after its own wait and counts the h columns it stores per
    B' K chunk in counters (release); each B' program waits (acquire spin) only for its own chunk, so B' overlaps A's
    tail. The argument for deadlock freedom: PDL launches B' only once every A program has called
    gdc_launch_dependents, i.e. all of A is resident, and A never waits for B'. Yet a whole 48B engine with it (and
    the 8-warp kernel A) never came back from its set-up on the H200 (traces/h200_s11/call2), while one layer replayed
    fine: unexplained. The chunk's last reader zeroes its counter (no memset in a CUDA graph). Same output bits.
  C `_latent_out_kernel` (latent MoE only; B then stores u in fp32 and adds no shared expert): one
    program per (token, column block of D): the RMSNorm statistics of u's row, the up-projection's
    GEMV on the normalized row, the shared expert's GEMV; one store.

A and B each come in two designs, picked per batch by `kernel_designs` from measured H200 times (the table
above DENSE_DESIGNS in kernels/moe_launch.py, where every per-shape launch choice of these kernels lives): "tiles"
(the kernels described here) and, for dense weights, "rows"
(`_expert_up_rows_kernel` / `_expert_down_rows_kernel`: a row block per program reduced every K step, the
design before issue 9, faster for the bf16 up-projection at every batch and the down-projection from batch 8);
B also has "split" (B' above), which the H200 measurement made the down-projection of every batch below the
grouped-GEMM crossover. The choice is a static per-batch table (moe_launch.DENSE_DESIGNS / MXFP4_DESIGNS).

MXFP4 weights are decoded in registers (E2M1 code -> value, times 2^(scale - 127)); the fp32
accumulation is the same as for bf16 weights. Under TRITON_INTERPRET=1 (set before import) the
kernels run on CPU tensors (`fused_moe_triton`), which is how they are tested without a GPU.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from k3compile.model_def.ops import mxfp4
from k3compile.model_def.ops.moe_math import glu_act, moe_experts_gather, moe_experts_grouped, moe_experts_loop

from . import l2_prefetch
from .arrivals import arrival_counters
from .graph_timing import replay_us
from .moe_launch import (DESIGNS, DOWN_DESIGNS, L2_PREFETCH_MAX_TOKENS, SplitConfig, check_pow2, check_split_config,
                         check_up_launch, flag_chunks, gemv_config, kernel_designs, latent_config, rows_config,
                         shared_block_k, shared_l2_launch, split_config, split_from_list)
from .pdl import pdl_for

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through the reference
    triton = None

ACTS = {"silu": 0, "situ": 1}
CPU_CROSSOVER = 16  # fixed on CPU (the reference runs there whatever it says); CUDA measures it at build
CROSSOVER_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # what the build-time measurement tries
NO_CROSSOVER = 1 << 30  # "the GEMV path always wins"
ARRIVALS_OWNER = "moe_decode"  # the split down-projection's counters in kernels.arrivals (one per column group)
FLAGS_OWNER = "moe_decode_flags"  # flag_deps: kernel A -> B' chunk counters (kernels.arrivals), one per h row x K chunk
FLAG_STRIDE = 32  # int32s between two flag_deps counters: one 128-byte line each, so their polls hit different lines
# flag_deps: B' polls its counters on the GPU; the interpreter runs A to its end before B', so there it does not (a
# wrong count then leaves a counter non-zero, which the tests check, instead of hanging them)
_SPIN = os.environ.get("TRITON_INTERPRET") != "1"


# --------------------------------------------------------------------------- argument checks

def check_args(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up, shared_w2,
               act, latent_up_w=None, latent_norm_w=None, shared_w13=None) -> tuple[int, int, int, int]:
    """Raise ValueError naming the first thing wrong; returns (E, I, D, output width)."""
    if act not in ACTS:
        raise ValueError(f"fused_moe_decode: unknown activation {act!r} (known: {', '.join(ACTS)})")
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"fused_moe_decode: x must be a float [tokens, width] tensor, got {x.dtype} "
                         f"{list(x.shape)}")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe_decode: topk_ids {list(topk_ids.shape)} and topk_weights "
                         f"{list(topk_weights.shape)} must both be [tokens = {x.shape[0]}, k]")
    if topk_ids.dtype.is_floating_point:
        raise ValueError(f"fused_moe_decode: topk_ids must be integer, got {topk_ids.dtype}")
    quantized = w13_scale is not None
    if quantized != (w2_scale is not None):
        raise ValueError("fused_moe_decode: give both MXFP4 scale tensors (w13_scale, w2_scale) or neither")
    if quantized:
        s13 = mxfp4.check_mxfp4(w13, w13_scale, "fused_moe_decode w13")
        s2 = mxfp4.check_mxfp4(w2, w2_scale, "fused_moe_decode w2")
    else:
        if not (w13.dtype.is_floating_point and w2.dtype.is_floating_point):
            raise ValueError(f"fused_moe_decode: float expert weights expected, got {w13.dtype} / {w2.dtype} "
                             f"(MXFP4 weights need their scales)")
        s13, s2 = tuple(w13.shape), tuple(w2.shape)
    if len(s13) != 3 or len(s2) != 3 or s13[1] % 2 or s13[0] != s2[0] or s2[2] * 2 != s13[1]:
        raise ValueError(f"fused_moe_decode: expert weights must be w13 [E, 2I, D] and w2 [E, Do, I], got "
                         f"{list(s13)} and {list(s2)} (dequantized shapes)")
    if s13[2] != x.shape[1]:
        raise ValueError(f"fused_moe_decode: x width {x.shape[1]} != expert input width {s13[2]}")
    out_width = s2[1]
    if latent_up_w is not None:
        if latent_up_w.dim() != 2 or latent_up_w.shape[1] != s2[1]:
            raise ValueError(f"fused_moe_decode: latent_up_w must be [D, Do = {s2[1]}], got {list(latent_up_w.shape)}")
        out_width = latent_up_w.shape[0]
    if latent_norm_w is not None and (latent_up_w is None or tuple(latent_norm_w.shape) != (s2[1],)):
        raise ValueError(f"fused_moe_decode: latent_norm_w must be [Do = {s2[1]}] and come with latent_up_w")
    if shared_w13 is not None:
        if shared_in is not None or shared_up is not None:
            raise ValueError("fused_moe_decode: give the shared expert's gate/up as shared_w13 or as "
                             "shared_in / shared_up, not both")
        if shared_w2 is None or latent_up_w is not None:
            raise ValueError("fused_moe_decode: shared_w13 needs shared_w2 and a full-width MoE (no latent_up_w: "
                             "a latent MoE's shared expert does not read the op's x)")
        want = [2 * shared_w2.shape[1], x.shape[1]] if shared_w2.dim() == 2 else None
        if shared_w13.dtype != x.dtype or list(shared_w13.shape) != want:
            raise ValueError(f"fused_moe_decode: shared_w13 must be [2 Is, D] = {want} in x's dtype {x.dtype} (gate "
                             f"rows then up rows), got {shared_w13.dtype} {list(shared_w13.shape)}")
        shared_in = x  # stands for the [tokens, Is] gate rows in the checks below
    if shared_w2 is not None:
        if shared_in is None or shared_w2.dim() != 2 or shared_w2.shape[0] != out_width:
            raise ValueError(f"fused_moe_decode: shared_w2 must be [{out_width}, Is] and come with shared_in")
        want = (x.shape[0], shared_w2.shape[1])
        for name, t in (("shared_in", shared_in if shared_w13 is None else None), ("shared_up", shared_up)):
            if t is not None and tuple(t.shape) != want:
                raise ValueError(f"fused_moe_decode: {name} must be {list(want)}, got {list(t.shape)}")
    elif shared_in is not None or shared_up is not None:
        raise ValueError("fused_moe_decode: shared_in / shared_up given without shared_w2")
    return s13[0], s13[1] // 2, s13[2], out_width


def _dense_weights(w13, w2, w13_scale, w2_scale, dtype, check_nan_scales=True):
    if w13_scale is None:
        return w13, w2
    return (mxfp4.dequantize(w13, w13_scale, dtype, check_nan_scales),
            mxfp4.dequantize(w2, w2_scale, dtype, check_nan_scales))


def _latent(u, latent_up_w, latent_norm_w, eps):
    """K3's latent tail, op for op as model_def's RMSNorm and linear compute it."""
    if latent_up_w is None:
        return u
    if latent_norm_w is not None:
        uf = u.float()
        u = latent_norm_w * (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps)).to(u.dtype)
    return F.linear(u, latent_up_w)


def _shared_gate_up(x, shared_in, shared_up, shared_w13):
    """(shared_in, shared_up): given, or the shared_w13 GEMM's gate and up columns (as P1's merged GEMM + split)."""
    if shared_w13 is None:
        return shared_in, shared_up
    return F.linear(x, shared_w13).split(shared_w13.shape[0] // 2, dim=1)


def _shared(y, shared_in, shared_up, shared_w2, act, beta, linear_beta, glu=glu_act):
    if shared_w2 is None:
        return y
    a = shared_in if shared_up is None else glu(shared_in, shared_up, act, beta, linear_beta)
    return y + F.linear(a, shared_w2)


# --------------------------------------------------------------------------- CPU reference

def fused_moe_reference(x, topk_ids, topk_weights, w13, w2, w13_scale=None, w2_scale=None, shared_in=None,
                        shared_up=None, shared_w2=None, act="silu", beta=4.0, linear_beta=25.0, latent_up_w=None,
                        latent_norm_w=None, latent_eps=1e-5, shared_w13=None):
    """The unfused graph's computation, op for op (MXFP4 weights dequantized to x's dtype first)."""
    check_args(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up, shared_w2, act,
               latent_up_w, latent_norm_w, shared_w13)
    shared_in, shared_up = _shared_gate_up(x, shared_in, shared_up, shared_w13)
    w13, w2 = _dense_weights(w13, w2, w13_scale, w2_scale, x.dtype)
    y = moe_experts_loop(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta)
    y = _latent(y, latent_up_w, latent_norm_w, latent_eps)
    return _shared(y, shared_in, shared_up, shared_w2, act, beta, linear_beta)


def fused_moe_grouped(x, topk_ids, topk_weights, w13, w2, w13_scale=None, w2_scale=None, shared_in=None,
                      shared_up=None, shared_w2=None, act="silu", beta=4.0, linear_beta=25.0, latent_up_w=None,
                      latent_norm_w=None, latent_eps=1e-5, shared_w13=None, grouped_sorted=False,
                      sorted_finish=False):
    """Above the crossover on CUDA: the routed experts by kernels.moe_sorted (grouped_sorted: four launches, each
    expert's weights read once, MXFP4 decoded in them; sorted_finish: its sum and the latent RMSNorm in one kernel),
    else grouped GEMM (sm90, bf16) or the gather path on weights dequantized first; the rest of the latent tail and
    the shared expert in torch."""
    shared_in, shared_up = _shared_gate_up(x, shared_in, shared_up, shared_w13)
    if grouped_sorted and triton is not None:
        from .moe_sorted import moe_experts_sorted  # here: moe_sorted imports this module's GLU
        norm_in_kernel = sorted_finish and latent_up_w is not None and latent_norm_w is not None
        y = moe_experts_sorted(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta, w13_scale=w13_scale,
                               w2_scale=w2_scale, finish=sorted_finish,  # MXFP4 decoded in its kernels
                               norm_w=latent_norm_w if norm_in_kernel else None, eps=latent_eps)
        y = _latent(y, latent_up_w, None if norm_in_kernel else latent_norm_w, latent_eps)
        from . import glu_act as glu_kernel  # here: it imports this module's GLU
        # the shared expert's GLU as one kernel (k3.glu_act, P17's; SiTU is 12 ATen kernels), rounded as glu_act
        return _shared(y, shared_in, shared_up, shared_w2, act, beta, linear_beta, glu=glu_kernel.glu_act)
    w13, w2 = _dense_weights(w13, w2, w13_scale, w2_scale, x.dtype, check_nan_scales=False)  # no host sync
    grouped = (x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
               and torch.cuda.get_device_capability(x.device)[0] >= 9)
    run = moe_experts_grouped if grouped else moe_experts_gather
    y = run(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta)
    y = _latent(y, latent_up_w, latent_norm_w, latent_eps)
    return _shared(y, shared_in, shared_up, shared_w2, act, beta, linear_beta)


# --------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _tanh(x):
        # tanh from exp (tl has no tanh in every Triton we run on); exp of -2|x| never overflows
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _glu(g, u, beta, linear_beta, ACT: tl.constexpr):
        if ACT == 0:  # SiLU-GLU
            return g * tl.sigmoid(g) * u
        else:  # SiTU-GLU (spec §4.3)
            return beta * _tanh(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh(u / linear_beta))

    @triton.jit
    def _e2m1_x2p14(code):
        # 4-bit E2M1 code (int32: bit 3 sign, bits 2..1 exponent e with bias 1, bit 0 mantissa m) -> its value
        # times 2^-14, in 4 integer ops: the code's low 3 bits placed at fp16 bits 11..9 make fp16 exponent e
        # and top mantissa bit m, i.e. 2^(e-15) (1 + m/2) for e >= 1 and m 2^-15 (subnormal) for e = 0,
        # which is the E2M1 value 2^(e-1) (1 + m/2) | m/2 times 2^-14 in both cases. The caller folds the
        # 2^14 into the block scale.
        bits = ((code & 7) << 9) | ((code & 8) << 12)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _mxfp4_tile(w_ptr, s_ptr, rows, row_mask, v_ptr, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    V_SPLIT: tl.constexpr):
        """[BLOCK_N, BLOCK_K // 32]: for each row and 32-input scale group of the tile at k0, Σ W[row, k] v[k]
        with W in MXFP4 (codes [*, K/2] at w_ptr, E8M0 scales [*, K/32] at s_ptr); v: K values, in order, or
        (V_SPLIT, how kernel A stores h for kernel B) each group of 32 as its 16 even then its 16 odd inputs,
        so both halves are contiguous loads.
        A group's 16 code bytes are one 16-byte load and sum inside one thread; the caller accumulates the
        [rows, groups] tile over its loop and reduces it once at the end."""
        G: tl.constexpr = BLOCK_K // 32
        grp = tl.arange(0, G)
        j = tl.arange(0, 16)
        b = (k0 // 2 + grp[:, None] * 16 + j[None, :])[None, :, :]  # [1, G, 16] byte index in the row
        tmask = row_mask[:, None, None] & (b < K // 2)
        byte = tl.load(w_ptr + rows[:, None, None] * (K // 2) + b, mask=tmask, other=0).to(tl.int32)
        # the inputs through pointer tiles shaped like the codes' (same register layout: no shuffle through
        # shared memory); even inputs meet the low nibbles, odd the high ones
        lanes = 0 * rows[:, None, None]
        if V_SPLIT:
            even = (k0 + grp[:, None] * 32 + j[None, :])[None, :, :]  # group start + j: contiguous in j
            v_even = tl.load(v_ptr + even + lanes, mask=tmask, other=0.0).to(tl.float32)
            v_odd = tl.load(v_ptr + even + 16 + lanes, mask=tmask, other=0.0).to(tl.float32)
        else:
            v_even = tl.load(v_ptr + 2 * b + lanes, mask=tmask, other=0.0).to(tl.float32)
            v_odd = tl.load(v_ptr + 2 * b + 1 + lanes, mask=tmask, other=0.0).to(tl.float32)
        part = tl.sum(_e2m1_x2p14(byte & 15) * v_even + _e2m1_x2p14(byte >> 4) * v_odd, axis=2)
        g = k0 // 32 + grp
        sc = tl.load(s_ptr + rows[:, None] * (K // 32) + g[None, :], mask=row_mask[:, None] & (g[None, :] < K // 32),
                     other=127)
        return part * tl.exp2(sc.to(tl.float32) - (127.0 - 14.0))

    @triton.jit
    def _shared_block(in_row, up_row, w_ptr, cols, cmask, IS, beta, linear_beta, ACT: tl.constexpr,
                      GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The shared expert's down-projection for a block of output columns: W[cols] · act(in, up)
        (GLU) or W[cols] · in (already activated), the whole K (_gemv_chunk below)."""
        return _gemv_chunk(in_row, up_row, w_ptr, cols, cmask, IS, 0, IS, beta, linear_beta, ACT, GLU, BLOCK_N,
                           BLOCK_K, False, False, w_ptr, 1, False, False)

    # flag_deps (fine-grained A -> B' dependencies): one int32 counter per (h row, K chunk of B'), h rows being the
    # (token, slot) pairs and then, with A's shared slot, the tokens' hs rows. Its low 16 bits count the columns kernel
    # A has stored in the chunk (release), its high bits the B' programs that have read it (acquire); the last reader
    # sets it back to 0, so the counters are zero between launches (a CUDA graph replays them with no memset).
    @triton.jit
    def _publish_h(flags_ptr, row, c0, c1, CHUNK, KSPLIT: tl.constexpr, STRIDE: tl.constexpr):
        """Kernel A stored columns [c0, c1) of h row `row`: add to each of the row's K chunks (CHUNK columns each) the
        count of those columns in it. The barrier orders every thread's store before the release."""
        if c1 > c0:
            tl.debug_barrier()
            for ch in range(c0 // CHUNK, (c1 - 1) // CHUNK + 1):
                cols = tl.minimum(c1, ch * CHUNK + CHUNK) - tl.maximum(c0, ch * CHUNK)
                tl.atomic_add(flags_ptr + (row * KSPLIT + ch) * STRIDE, cols, sem="release", scope="gpu")

    @triton.jit
    def _nap(x):
        """x, after a ~0.1 us pause (PTX nanosleep): a spinning program leaves its counter's L2 line to A's atomics."""
        return tl.inline_asm_elementwise("nanosleep.u32 100;\n mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                         is_pure=False, pack=1)

    @triton.jit
    def _await_h(counter, need, readers, SPIN: tl.constexpr):
        """Kernel B' is about to read `need` columns of one h row chunk: wait until kernel A has published them all
        (SPIN; the interpreter runs A to its end first: no wait, and a wrong count leaves the counter non-zero, which
        the tests check), then acquire (every thread's later loads of the chunk see A's
        stores: the RMW reads the end of A's release sequence, and a barrier orders the other threads after it). The
        chunk's last reader of `readers` zeroes the counter for the next launch."""
        if need > 0:
            if SPIN:
                seen = tl.load(counter, volatile=True) & 0xFFFF
                while seen < need:
                    seen = _nap(tl.load(counter, volatile=True)) & 0xFFFF
            old = tl.atomic_add(counter, 1 << 16, sem="acq_rel", scope="gpu")
            tl.debug_barrier()  # every thread's loads of the chunk after the acquire
            if old == need + (readers - 1) * (1 << 16):
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _wait_input(counter, need, readers, WAIT: tl.constexpr, FLAG: tl.constexpr, SPIN: tl.constexpr,
                    EARLY: tl.constexpr = False):
        """Before B' reads its input chunk: the chunk's counter (FLAG, flag_deps), else gdc_wait under PDL (WAIT);
        EARLY (down_early_release): the next kernel is released right after that wait."""
        if FLAG:
            _await_h(counter, need, readers, SPIN)
        elif WAIT:
            tl.extra.cuda.gdc_wait()
            if EARLY:
                tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _shared_up_slot(x_row, sw13_ptr, hs_row, col_block, D, IS, beta, linear_beta, ACT: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                        L2_PREFETCH: tl.constexpr, PIECES: tl.constexpr, flags_ptr, flag_row, CHUNK,
                        FLAGS: tl.constexpr, KSPLIT: tl.constexpr, STRIDE: tl.constexpr, EARLY: tl.constexpr = False):
        """Kernel A's shared slot: hs[cols] = act(Wg[cols] . x, Wu[cols] . x) for one column block of the shared
        expert's [2 Is, D] gate/up weight (dense), with the routed rows' own loop (`_rows_dot`, reduced every K
        step): a slot that kept [BLOCK_N, BLOCK_K] fp32 products for the whole loop set the kernel's register
        budget for every program, and A ran 21.7 -> 31.6 us at the 48B shape, batch 1 (H200, bench_moe8).
        L2_PREFETCH (with PDL only): the block's gate rows and up rows (two contiguous ranges of the static weight)
        are asked of L2 before the wait, so they stream while the router kernel before A runs; the loads after
        the wait are the same, so are the sums. FLAGS (flag_deps): B' is released right after the wait and told per
        K chunk when hs is stored (_publish_h, h row flag_row)."""
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < IS
        if L2_PREFETCH:
            elem: tl.constexpr = sw13_ptr.dtype.element_ty.primitive_bitwidth // 8
            rows = tl.minimum(tl.maximum(IS - col_block * BLOCK_N, 0), BLOCK_N)  # 0 past Is: nothing asked
            # two ranges (gate rows, up rows) Is x D apart (int32 bytes: half a shared expert's weight, < 2 GiB)
            l2_prefetch.prefetch_rows_l2(sw13_ptr + (col_block * BLOCK_N).to(tl.int64) * D, 2, rows * D * elem,
                                         IS * D * elem, PIECES)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # x comes from an earlier kernel
            if FLAGS or EARLY:  # released right after the wait (flag_deps, early_release)
                tl.extra.cuda.gdc_launch_dependents()
        g = _rows_dot(sw13_ptr, cols, cmask, x_row, D, BLOCK_N, BLOCK_K)
        u = _rows_dot(sw13_ptr, cols + IS, cmask, x_row, D, BLOCK_N, BLOCK_K)
        if USE_PDL and not (FLAGS or EARLY):
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(hs_row + cols, _glu(g, u, beta, linear_beta, ACT), mask=cmask)
        if FLAGS:
            _publish_h(flags_ptr, flag_row, col_block * BLOCK_N, tl.minimum(col_block * BLOCK_N + BLOCK_N, IS), CHUNK,
                       KSPLIT, STRIDE)

    @triton.jit
    def _up_program(PAIRS, TOP_K: tl.constexpr, SHARED_FIRST: tl.constexpr):
        """(pair, column block) of a kernel A program. Default grid (pairs + tokens, column blocks): pair is axis 0,
        the shared slot's programs from PAIRS on, i.e. one in every k + 1 programs of the launch order. SHARED_FIRST:
        grid (column blocks, tokens + pairs), axis 1's first `tokens` rows being the shared slot: its programs are
        the first ones launched (the first wave, resident while the kernel before A runs, where they prefetch)."""
        if SHARED_FIRST:
            row = tl.program_id(1).to(tl.int64)
            tokens = PAIRS // TOP_K
            pair = tl.where(row < tokens, row + PAIRS, row - tokens)
            return pair, tl.program_id(0)
        return tl.program_id(0).to(tl.int64), tl.program_id(1)

    @triton.jit
    def _expert_up_kernel(x_ptr, ids_ptr, w13_ptr, s13_ptr, h_ptr, sw13_ptr, hs_ptr, flags_ptr, x_row_stride, D, I,
                          IS, PAIRS, CHUNK, CHUNK_S, beta, linear_beta, TOP_K: tl.constexpr, ACT: tl.constexpr,
                          MXFP4: tl.constexpr, SHARED_SLOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_PDL: tl.constexpr, SHARED_FIRST: tl.constexpr = False,
                          SHARED_L2_PREFETCH: tl.constexpr = False, PIECES: tl.constexpr = 128,
                          FLAGS: tl.constexpr = False, KSPLIT: tl.constexpr = 1,
                          FLAG_STRIDE: tl.constexpr = 32, EARLY: tl.constexpr = False):
        # pair: token * TOP_K + slot; from PAIRS on (SHARED_SLOT) the shared slot. FLAGS (flag_deps): kernel B' is
        # released right after the wait (it reads ids and weights of the router, which every program of ours has then
        # waited for) and learns per K chunk of h when its columns are stored (_publish_h)
        pair, col_block = _up_program(PAIRS, TOP_K, SHARED_FIRST)
        if SHARED_SLOT:
            if pair >= PAIRS:
                token = pair - PAIRS
                _shared_up_slot(x_ptr + token * x_row_stride, sw13_ptr, hs_ptr + token * IS, col_block, D,
                                IS, beta, linear_beta, ACT, BLOCK_N, BLOCK_K, USE_PDL, SHARED_L2_PREFETCH, PIECES,
                                flags_ptr, pair, CHUNK_S, FLAGS, KSPLIT, FLAG_STRIDE, EARLY)
                return
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < I
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # the ids (routing) and x come from earlier kernels
            if FLAGS or EARLY:  # released right after the wait (flag_deps, early_release)
                tl.extra.cuda.gdc_launch_dependents()
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        token = pair // TOP_K
        x_row = x_ptr + token * x_row_stride
        if MXFP4:
            w_base = w13_ptr + expert * (2 * I) * (D // 2)
            s_base = s13_ptr + expert * (2 * I) * (D // 32)
            g2 = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
            u2 = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
            # gate and up rows in the same iteration: two independent tiles in flight, not two K loops in a row
            for k0 in range(0, D, BLOCK_K):
                g2 += _mxfp4_tile(w_base, s_base, cols, cmask, x_row, k0, D, BLOCK_N, BLOCK_K, False)
                u2 += _mxfp4_tile(w_base, s_base, cols + I, cmask, x_row, k0, D, BLOCK_N, BLOCK_K, False)
            g = tl.sum(g2, axis=1)
            u = tl.sum(u2, axis=1)
        else:
            # one [gate/up, BLOCK_N, BLOCK_K] tile per iteration, products summed in place; reduced after the loop
            half = tl.arange(0, 2)
            rows = w13_ptr + expert * (2 * I) * D + (half[:, None] * I + cols[None, :])[:, :, None] * D
            rmask = (half[:, None] < 2) & cmask[None, :]
            kk = tl.arange(0, BLOCK_K)
            acc = tl.zeros([2, BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                k = k0 + kk
                kmask = k < D
                tmask = rmask[:, :, None] & kmask[None, None, :]
                w = tl.load(rows + k[None, None, :], mask=tmask, other=0.0)
                # x through a pointer tile shaped like the weights' (same register layout, no shuffle through
                # shared memory and no barrier per iteration); the copies come from L1
                v = tl.load(x_row + k[None, None, :] + 0 * rmask[:, :, None], mask=tmask, other=0.0)
                acc += w.to(tl.float32) * v.to(tl.float32)
            both = tl.sum(acc, axis=2)
            g = tl.sum(tl.where(half[:, None] == 0, both, 0.0), axis=0)
            u = tl.sum(tl.where(half[:, None] == 1, both, 0.0), axis=0)
        if USE_PDL and not (FLAGS or EARLY):
            tl.extra.cuda.gdc_launch_dependents()
        h_cols = cols
        if MXFP4:  # kernel B's MXFP4 tiles read each group of 32 as its even inputs, then its odd ones
            within = cols % 32
            h_cols = cols - within + (within % 2) * 16 + within // 2
        tl.store(h_ptr + pair * I + h_cols, _glu(g, u, beta, linear_beta, ACT), mask=cmask)
        if FLAGS:  # (MXFP4's reorder stays inside a group of 32, and chunks are whole groups: same counts)
            _publish_h(flags_ptr, pair, col_block * BLOCK_N, tl.minimum(col_block * BLOCK_N + BLOCK_N, I), CHUNK,
                       KSPLIT, FLAG_STRIDE)

    @triton.jit
    def _expert_down_kernel(h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr,
                            I, DO, IS, sin_row_stride, sup_row_stride, out_row_stride, beta, linear_beta,
                            TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, ACT: tl.constexpr, MXFP4: tl.constexpr,
                            SHARED: tl.constexpr, SHARED_GLU: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr, USE_PDL: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < DO
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # h (kernel A), the routing and the shared expert's input
        if MXFP4:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
            # one flat loop over the token's k experts x their K tiles (not a loop per expert)
            tiles = tl.cdiv(I, BLOCK_K)
            for t in range(0, TOP_K * tiles):
                slot = t // tiles
                k0 = (t - slot * tiles) * BLOCK_K
                pair = token * TOP_K + slot
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                weight = tl.load(wts_ptr + pair).to(tl.float32)
                acc2 += weight * _mxfp4_tile(w2_ptr + expert * DO * (I // 2), s2_ptr + expert * DO * (I // 32), cols,
                                             cmask, h_ptr + pair * I, k0, I, BLOCK_N, BLOCK_K, True)
            acc = tl.sum(acc2, axis=1)
        else:
            # all k experts in one [expert, BLOCK_N, BLOCK_K] tile per iteration: the ids are read once, the loop
            # has no dependent loads and no reductions (done once at the end), so a tile's loads all issue at once
            slot = tl.arange(0, TOP_K_PAD)
            smask = slot < TOP_K
            pair = token * TOP_K + slot
            expert = tl.load(ids_ptr + pair, mask=smask, other=0).to(tl.int64)
            weight = tl.load(wts_ptr + pair, mask=smask, other=0.0).to(tl.float32)
            rows = w2_ptr + (expert[:, None] * DO + cols[None, :])[:, :, None] * I
            rmask = smask[:, None] & cmask[None, :]
            h_rows = h_ptr + pair[:, None] * I
            kk = tl.arange(0, BLOCK_K)
            acc3 = tl.zeros([TOP_K_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                k = k0 + kk
                kmask = k < I
                w = tl.load(rows + k[None, None, :], mask=rmask[:, :, None] & kmask[None, None, :], other=0.0)
                # h read through a pointer tile shaped like the weights' (same register layout: no shuffle
                # through shared memory); each thread's copies come from L1
                a = tl.load(h_rows[:, :, None] + k[None, None, :] + 0 * cols[None, :, None],
                            mask=rmask[:, :, None] & kmask[None, None, :], other=0.0)
                acc3 += w.to(tl.float32) * a
            acc3 = acc3 * weight[:, None, None]
            acc = tl.sum(tl.sum(acc3, axis=2), axis=0)
        if SHARED:
            acc += _shared_block(sin_ptr + token * sin_row_stride, sup_ptr + token * sup_row_stride, sw2_ptr, cols,
                                 cmask, IS, beta, linear_beta, ACT, SHARED_GLU, BLOCK_N, BLOCK_K)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr + token * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _gemv_chunk(in_row, up_row, w_ptr, cols, cmask, K, k_lo, k_hi, beta, linear_beta, ACT: tl.constexpr,
                    GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAIT: tl.constexpr,
                    PREFETCH: tl.constexpr, counter, readers, FLAG: tl.constexpr, SPIN: tl.constexpr,
                    EARLY: tl.constexpr = False):
        """Σ_{k_lo <= k < k_hi} W[cols, k] act(in, up)[k] (GLU) or W[cols, k] in[k], dense W [*, K], fp32 [BLOCK_N]:
        B''s GEMV over one K chunk of one slot. The first weight tile loads before the gdc_wait (WAIT: launched
        with PDL, its input written by the previous kernel, the weights static), so it streams while that kernel
        ends. PREFETCH: each iteration issues the next tile's loads before it multiplies the current one (a
        register double buffer: two tiles in flight per program instead of one; nothing in these loops is
        software-pipelined by Triton, their loads feed no dot). Products summed in a [BLOCK_N, BLOCK_K] tile,
        reduced once; the same sums in the same order with or without PREFETCH. FLAG (flag_deps): instead of the
        grid-wide wait, the chunk's own counter (_await_h: `counter`, read by `readers` programs)."""
        kk = tl.arange(0, BLOCK_K)
        k = k_lo + kk
        w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=cmask[:, None] & (k < k_hi)[None, :], other=0.0)
        _wait_input(counter, k_hi - k_lo, readers, WAIT, FLAG, SPIN, EARLY)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PREFETCH:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                kn = k0 + BLOCK_K + kk
                w_next = tl.load(w_ptr + cols[:, None] * K + kn[None, :], mask=cmask[:, None] & (kn < k_hi)[None, :],
                                 other=0.0)
                acc += w.to(tl.float32) * _gemv_input(in_row, up_row, k0 + kk, k_hi, beta, linear_beta, ACT, GLU)[None, :]
                w = w_next
        else:
            acc += w.to(tl.float32) * _gemv_input(in_row, up_row, k, k_hi, beta, linear_beta, ACT, GLU)[None, :]
            for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
                k = k0 + kk
                kmask = k < k_hi
                w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
                acc += w.to(tl.float32) * _gemv_input(in_row, up_row, k, k_hi, beta, linear_beta, ACT, GLU)[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _gemv_input(in_row, up_row, k, k_hi, beta, linear_beta, ACT: tl.constexpr, GLU: tl.constexpr):
        """The GEMV's input at positions k (fp32, 0 from k_hi on): in[k], or act(in[k], up[k]) with GLU."""
        kmask = k < k_hi
        a = tl.load(in_row + k, mask=kmask, other=0.0).to(tl.float32)
        if GLU:
            a = _glu(a, tl.load(up_row + k, mask=kmask, other=0.0).to(tl.float32), beta, linear_beta, ACT)
        return a

    @triton.jit
    def _chunk(ks, K, KSPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
        """[k_lo, k_hi) of K chunk ks of KSPLIT: equal chunks of whole BLOCK_K tiles (so no tile straddles two),
        the last one cut at K; a chunk past K is empty."""
        size = tl.cdiv(tl.cdiv(K, KSPLIT), BLOCK_K) * BLOCK_K
        k_lo = ks * size
        return k_lo, tl.minimum(k_lo + size, K)

    # The "split" design of kernel B (issue 9, small batches): one program per (token x column block, slot, K
    # chunk), slot running over the token's k routed experts and then the shared expert (slot k), so every
    # program reads one expert's contiguous [BLOCK_N, K / KSPLIT] rows: many short, equal programs (the tile
    # design runs k + 1 GEMVs in a row per program, 288 of them at the 48B shape on 132 SMs). Each program stores
    # its fp32 partial (routed: times its routing weight) in a workspace; the last of the group's PARTS = SLOTS x
    # KSPLIT programs to arrive (acq_rel counter from kernels.arrivals, zeroed again by it: no memset node in a
    # CUDA graph) sums the partials in (slot, chunk) order (the same bits whatever the arrival order) and stores
    # the output row block. KSPLIT and PREFETCH come from moe_launch.SPLIT_TUNED (split_config).
    @triton.jit
    def _expert_down_split_kernel(h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr,
                                  part_ptr, arrivals_ptr, flags_ptr, PAIRS, I, DO, IS, sin_row_stride, sup_row_stride,
                                  out_row_stride,
                                  beta, linear_beta, TOP_K: tl.constexpr, SLOTS: tl.constexpr, ACT: tl.constexpr,
                                  MXFP4: tl.constexpr, SHARED: tl.constexpr, SHARED_GLU: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr,
                                  USE_PDL: tl.constexpr, KSPLIT: tl.constexpr = 1, PREFETCH: tl.constexpr = False,
                                  SHARED_L2_PREFETCH: tl.constexpr = False, PIECES: tl.constexpr = 128,
                                  FLAGS: tl.constexpr = False,
                                  FLAG_SHARED: tl.constexpr = False, SPIN: tl.constexpr = True,
                                  FLAG_STRIDE: tl.constexpr = 32, EARLY: tl.constexpr = False,
                                  ROUTED_L2_PREFETCH: tl.constexpr = False):
        # FLAGS (flag_deps): the routed slots (and, FLAG_SHARED, the shared slot: hs from kernel A) wait for their
        # own K chunk of h (_await_h) instead of all of kernel A (gdc_wait)
        PARTS: tl.constexpr = SLOTS * KSPLIT
        group = tl.program_id(0).to(tl.int64)  # token * column blocks + column block
        part_id = tl.program_id(1)  # slot * KSPLIT + K chunk
        slot = part_id // KSPLIT  # < TOP_K: the token's routed expert slot; TOP_K (SHARED only): the shared expert
        ks = part_id - slot * KSPLIT
        blocks = tl.cdiv(DO, BLOCK_N)
        token = group // blocks
        lanes = tl.arange(0, BLOCK_N)
        cols = (group - token * blocks) * BLOCK_N + lanes
        cmask = cols < DO
        # under PDL every slot waits for the previous kernel (kernel A: h, the shared input) before reading what it
        # wrote; dense slots load their first weight tile (static) before that: the shared slot's weights are
        # fixed, and the routed slots' expert ids and weights come from the router, two kernels back (kernel A
        # waited for it before releasing us), so their first W2 tile streams while kernel A finishes
        if slot == TOP_K:  # the shared slot (never reached without SHARED: then slot < SLOTS = TOP_K)
            k_lo, k_hi = _chunk(ks, IS, KSPLIT, BLOCK_KS)
            if SHARED_L2_PREFETCH:  # (PDL only) the rest of the slot's static rows asked of L2 before the wait
                elem: tl.constexpr = sw2_ptr.dtype.element_ty.primitive_bitwidth // 8
                c0 = (group - token * blocks) * BLOCK_N
                l2_prefetch.prefetch_rows_l2(sw2_ptr + c0 * IS + k_lo, tl.minimum(DO - c0, BLOCK_N),
                                             tl.maximum(k_hi - k_lo, 0) * elem, IS * elem, PIECES)
            part = _gemv_chunk(sin_ptr + token * sin_row_stride, sup_ptr + token * sup_row_stride, sw2_ptr, cols,
                               cmask, IS, k_lo, k_hi, beta, linear_beta, ACT, SHARED_GLU, BLOCK_N, BLOCK_KS, USE_PDL,
                               PREFETCH, flags_ptr + ((PAIRS + token) * KSPLIT + ks) * FLAG_STRIDE, blocks,
                               FLAG_SHARED, SPIN, EARLY and not FLAG_SHARED)
        else:
            pair = token * TOP_K + slot
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            weight = tl.load(wts_ptr + pair).to(tl.float32)
            k_lo, k_hi = _chunk(ks, I, KSPLIT, BLOCK_K)
            counter = flags_ptr + (pair * KSPLIT + ks) * FLAG_STRIDE
            if ROUTED_L2_PREFETCH:  # (PDL, dense) the slot's W2 rows of this chunk asked of L2 before the wait
                elem_w: tl.constexpr = w2_ptr.dtype.element_ty.primitive_bitwidth // 8
                c0 = (group - token * blocks) * BLOCK_N
                l2_prefetch.prefetch_rows_l2(w2_ptr + expert * DO * I + c0 * I + k_lo, tl.minimum(DO - c0, BLOCK_N),
                                             tl.maximum(k_hi - k_lo, 0) * elem_w, I * elem_w, PIECES)
            if MXFP4:  # h in kernel A's MXFP4 order (each group of 32: even inputs, then odd)
                _wait_input(counter, k_hi - k_lo, blocks, USE_PDL, FLAGS, SPIN, EARLY and not FLAGS)
                acc2 = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    acc2 += _mxfp4_tile(w2_ptr + expert * DO * (I // 2), s2_ptr + expert * DO * (I // 32), cols,
                                        cmask, h_ptr + pair * I, k0, I, BLOCK_N, BLOCK_K, True)
                part = tl.sum(acc2, axis=1) * weight
            else:
                part = _gemv_chunk(h_ptr + pair * I, h_ptr + pair * I, w2_ptr + expert * DO * I, cols, cmask, I, k_lo,
                                   k_hi, beta, linear_beta, ACT, False, BLOCK_N, BLOCK_K, USE_PDL, PREFETCH, counter,
                                   blocks, FLAGS, SPIN, EARLY and not FLAGS) * weight
        if USE_PDL and not (EARLY and not FLAGS):  # (EARLY: released right after the wait, in _wait_input)
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(part_ptr + (group * PARTS + part_id) * BLOCK_N + lanes, part)
        tl.debug_barrier()  # every thread's partial is stored before the arrival
        arrived = tl.atomic_add(arrivals_ptr + group, 1, sem="acq_rel")
        if arrived == PARTS - 1:
            tl.atomic_xchg(arrivals_ptr + group, 0)  # zero again for the next launch
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(PARTS):  # fixed order: deterministic whichever program came last
                acc += tl.load(part_ptr + (group * PARTS + j) * BLOCK_N + lanes, cache_modifier=".cg")
            tl.store(out_ptr + token * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    # The "rows" design (the kernels as they were before issue 9's rework, bf16/fp32 weights only): a block of
    # rows per program, reduced every K iteration, the gate's K loop then the up's. Measured faster than the
    # tile design above for the up-projection at every batch and for the down-projection from batch 8 on
    # (moe_launch.DESIGNS); kept beside it and chosen by kernel_designs().
    @triton.jit
    def _rows_dot(w_ptr, rows, row_mask, v_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Σ_k W[row, k] v[k] for a block of dense rows of W [*, K] (fp32); v: K contiguous values."""
        return _rows_dot_from(tl.zeros([BLOCK_N], dtype=tl.float32), w_ptr, rows, row_mask, v_ptr, K, 0, BLOCK_K)

    @triton.jit
    def _rows_dot_first(w_first, v_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """_rows_dot's first K step on a weight tile loaded earlier (`_rows_tile`): the same sum, so the same bits."""
        kk = tl.arange(0, BLOCK_K)
        v = tl.load(v_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc += tl.sum(w_first.to(tl.float32) * v[None, :], axis=1)
        return acc

    @triton.jit
    def _rows_tile(w_ptr, rows, row_mask, K, BLOCK_K: tl.constexpr):
        """The first K step's [rows, BLOCK_K] tile of W [*, K]: loadable before gdc_wait (weights are constants)."""
        kk = tl.arange(0, BLOCK_K)
        return tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)

    @triton.jit
    def _rows_dot_from(acc, w_ptr, rows, row_mask, v_ptr, K, K0, BLOCK_K: tl.constexpr):
        """acc + Σ_{k >= K0} W[row, k] v[k], one tl.sum per K step in order (_rows_dot from its step K0 on)."""
        kk = tl.arange(0, BLOCK_K)
        for k0 in range(K0, K, BLOCK_K):
            k = k0 + kk
            kmask = k < K
            w = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=row_mask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            v = tl.load(v_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            acc += tl.sum(w * v[None, :], axis=1)
        return acc

    @triton.jit
    def _expert_up_rows_kernel(x_ptr, ids_ptr, w13_ptr, h_ptr, sw13_ptr, hs_ptr, flags_ptr, x_row_stride, D, I, IS,
                               PAIRS, CHUNK, CHUNK_S, beta, linear_beta, TOP_K: tl.constexpr, ACT: tl.constexpr,
                               SHARED_SLOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               USE_PDL: tl.constexpr, SHARED_FIRST: tl.constexpr = False,
                               SHARED_L2_PREFETCH: tl.constexpr = False, PIECES: tl.constexpr = 128,
                               FLAGS: tl.constexpr = False, KSPLIT: tl.constexpr = 1, FLAG_STRIDE: tl.constexpr = 32,
                               EARLY: tl.constexpr = False, PREWAIT: tl.constexpr = False):
        # pair: token * TOP_K + slot; from PAIRS on (SHARED_SLOT) the shared slot; FLAGS: as in _expert_up_kernel
        pair, col_block = _up_program(PAIRS, TOP_K, SHARED_FIRST)
        if SHARED_SLOT:
            if pair >= PAIRS:
                token = pair - PAIRS
                _shared_up_slot(x_ptr + token * x_row_stride, sw13_ptr, hs_ptr + token * IS, col_block, D,
                                IS, beta, linear_beta, ACT, BLOCK_N, BLOCK_K, USE_PDL, SHARED_L2_PREFETCH, PIECES,
                                flags_ptr, pair, CHUNK_S, FLAGS, KSPLIT, FLAG_STRIDE, EARLY)
                return
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < I
        if PREWAIT:
            # (up_prewait, a latent MoE: the router ran two kernels back, before the front GEMV that makes x, and a
            # program of this kernel starts only once every front program has waited for it, so the ids are final)
            # the expert and its first K step of gate and up rows load before the wait; only x waits
            expert = tl.load(ids_ptr + pair, cache_modifier=".cg").to(tl.int64)
            w_base = w13_ptr + expert * (2 * I) * D
            g_first = _rows_tile(w_base, cols, cmask, D, BLOCK_K)
            u_first = _rows_tile(w_base, cols + I, cmask, D, BLOCK_K)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # the ids (routing) and x come from earlier kernels
            if FLAGS or EARLY:  # released right after the wait (flag_deps, early_release)
                tl.extra.cuda.gdc_launch_dependents()
        x_row = x_ptr + (pair // TOP_K) * x_row_stride
        if PREWAIT:  # the same sums in the same order as below: the same bits
            g = _rows_dot_from(_rows_dot_first(g_first, x_row, D, BLOCK_N, BLOCK_K), w_base, cols, cmask, x_row, D,
                               BLOCK_K, BLOCK_K)
            u = _rows_dot_from(_rows_dot_first(u_first, x_row, D, BLOCK_N, BLOCK_K), w_base, cols + I, cmask, x_row,
                               D, BLOCK_K, BLOCK_K)
        else:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            w_base = w13_ptr + expert * (2 * I) * D
            g = _rows_dot(w_base, cols, cmask, x_row, D, BLOCK_N, BLOCK_K)
            u = _rows_dot(w_base, cols + I, cmask, x_row, D, BLOCK_N, BLOCK_K)
        if USE_PDL and not (FLAGS or EARLY):
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(h_ptr + pair * I + cols, _glu(g, u, beta, linear_beta, ACT), mask=cmask)
        if FLAGS:
            _publish_h(flags_ptr, pair, col_block * BLOCK_N, tl.minimum(col_block * BLOCK_N + BLOCK_N, I), CHUNK,
                       KSPLIT, FLAG_STRIDE)

    @triton.jit
    def _expert_down_rows_kernel(h_ptr, ids_ptr, wts_ptr, w2_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr,
                                 I, DO, IS, sin_row_stride, sup_row_stride, out_row_stride, beta, linear_beta,
                                 TOP_K: tl.constexpr, ACT: tl.constexpr, SHARED: tl.constexpr,
                                 SHARED_GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 USE_PDL: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < DO
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # h (kernel A), the routing and the shared expert's input
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(TOP_K):
            pair = token * TOP_K + j
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            weight = tl.load(wts_ptr + pair).to(tl.float32)
            acc += weight * _rows_dot(w2_ptr + expert * DO * I, cols, cmask, h_ptr + pair * I, I, BLOCK_N, BLOCK_K)
        if SHARED:
            acc += _shared_block(sin_ptr + token * sin_row_stride, sup_ptr + token * sup_row_stride, sw2_ptr, cols,
                                 cmask, IS, beta, linear_beta, ACT, SHARED_GLU, BLOCK_N, BLOCK_K)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr + token * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _latent_out_cols(u_ptr, nw_ptr, upw_ptr, sin_ptr, sup_ptr, sw2_ptr, token, cols, cmask, L, IS,
                         sin_row_stride, sup_row_stride, eps, beta, linear_beta,
                         ACT: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, SHARED_GLU: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr,
                         USE_PDL: tl.constexpr, PREWAIT: tl.constexpr, PREWAIT_W: tl.constexpr):
        """Kernel C's columns `cols` of token's output row (fp32, [BLOCK_N]), PDL wait and release included; through
        `_latent_out_block`, shared by `_latent_out_kernel` and kernels.moe_out_norm's kernel C with the next norm as
        its tail."""
        # PREWAIT (latent_prewait): the shared expert's down-projection before gdc_wait (its input comes from a kernel
        # at least two back, which has finished once this kernel runs: B' released it after its own wait, which followed
        # all of A, which waited for what came before); PREWAIT_W (one K step covers the latent row): the W_up tile too.
        # Only the routed part waits for u. Same loads, same sums in the same order: the same bits.
        kk = tl.arange(0, BLOCK_K)
        u_row = u_ptr + token * L
        if PREWAIT:
            if SHARED:
                shared_acc = _shared_block(sin_ptr + token * sin_row_stride, sup_ptr + token * sup_row_stride, sw2_ptr,
                                           cols, cmask, IS, beta, linear_beta, ACT, SHARED_GLU, BLOCK_N, BLOCK_KS)
            if PREWAIT_W:
                w_first = tl.load(upw_ptr + cols[:, None] * L + kk[None, :], mask=cmask[:, None] & (kk < L)[None, :],
                                  other=0.0).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # u from kernel B
        rstd = 1.0
        if NORM:  # every program recomputes the row's statistics: u is one short fp32 row
            sq = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, L, BLOCK_K):
                v = tl.load(u_row + k0 + kk, mask=k0 + kk < L, other=0.0)
                sq += v * v
            rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / L + eps)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            k = k0 + kk
            kmask = k < L
            v = tl.load(u_row + k, mask=kmask, other=0.0) * rstd
            if NORM:
                v = v * tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            if PREWAIT_W:  # (the loop's only step)
                w = w_first
            else:
                w = tl.load(upw_ptr + cols[:, None] * L + k[None, :], mask=cmask[:, None] & kmask[None, :],
                            other=0.0).to(tl.float32)
            acc2 += w * v[None, :]
        acc = tl.sum(acc2, axis=1)
        if SHARED:
            if PREWAIT:
                acc += shared_acc
            else:
                acc += _shared_block(sin_ptr + token * sin_row_stride, sup_ptr + token * sup_row_stride, sw2_ptr, cols,
                                     cmask, IS, beta, linear_beta, ACT, SHARED_GLU, BLOCK_N, BLOCK_KS)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        return acc

    @triton.jit
    def _latent_out_block(u_ptr, nw_ptr, upw_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr, L, DOUT, IS,
                          sin_row_stride, sup_row_stride, out_row_stride, eps, beta, linear_beta,
                          ACT: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, SHARED_GLU: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr,
                          USE_PDL: tl.constexpr, PREWAIT: tl.constexpr, PREWAIT_W: tl.constexpr):
        """Kernel C's program: its (token, column block) of the output row computed and stored; returns the token
        (kernels.moe_out_norm's kernel runs the next norm of that row after it)."""
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < DOUT
        acc = _latent_out_cols(u_ptr, nw_ptr, upw_ptr, sin_ptr, sup_ptr, sw2_ptr, token, cols, cmask, L, IS,
                               sin_row_stride, sup_row_stride, eps, beta, linear_beta, ACT, NORM, SHARED, SHARED_GLU,
                               BLOCK_N, BLOCK_K, BLOCK_KS, USE_PDL, PREWAIT, PREWAIT_W)
        tl.store(out_ptr + token * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)
        return token

    @triton.jit
    def _latent_out_kernel(u_ptr, nw_ptr, upw_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr, L, DOUT, IS,
                           sin_row_stride, sup_row_stride, out_row_stride, eps, beta, linear_beta,
                           ACT: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, SHARED_GLU: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr,
                           USE_PDL: tl.constexpr, PREWAIT: tl.constexpr = False, PREWAIT_W: tl.constexpr = False):
        _latent_out_block(u_ptr, nw_ptr, upw_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr, L, DOUT, IS, sin_row_stride,
                          sup_row_stride, out_row_stride, eps, beta, linear_beta, ACT, NORM, SHARED, SHARED_GLU,
                          BLOCK_N, BLOCK_K, BLOCK_KS, USE_PDL, PREWAIT, PREWAIT_W)



def fused_moe_triton(x, topk_ids, topk_weights, w13, w2, w13_scale=None, w2_scale=None, shared_in=None,
                     shared_up=None, shared_w2=None, act="silu", beta=4.0, linear_beta=25.0, latent_up_w=None,
                     latent_norm_w=None, latent_eps=1e-5, shared_w13=None, block_k: int | None = None,
                     block_n: int | None = None, num_warps: int | None = None,
                     use_pdl: bool = False, designs: tuple[str, str] | None = None,
                     split: SplitConfig | None = None, shared_l2_prefetch: bool = False,
                     down_l2_prefetch: bool = False, up_launch: tuple[int, int, int] | None = None,
                     flag_deps: bool = False, early_release: bool = False,
                     down_early_release: bool = False, latent_prewait: bool = False, latent_tail=None,
                     routed_l2_prefetch: bool = False, up_prewait: bool = False):
    """Launch kernels A, B (and C) (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). block_n / block_k
    / num_warps override the tile rule's choice for every kernel (tests, tile sweeps). use_pdl: launch with
    programmatic dependent launch where available (sm90+, Triton >= 3.4; ignored elsewhere). designs: (up,
    down), up "rows" or "tiles", down also "split", overrides kernel_designs() (tests, benches; "rows" needs
    dense weights). split: kernel B''s launch (SplitConfig) instead of split_config()'s (benches, tests); block_n /
    block_k / num_warps still override its fields. shared_l2_prefetch (with shared_w13): kernel A's grid puts the
    shared slot's programs first in launch order, and with PDL they ask L2 for their static gate/up rows before
    gdc_wait (`shared_l2_launch`); down_l2_prefetch: with PDL, B' (split)'s shared slot asks L2 for its W2 rows before
    the wait. Neither changes a loaded value or the order of a sum: the same output bits either way.
    up_launch: kernel A's (BLOCK_N, BLOCK_K, num_warps), either design, instead of ROWS_TUNED / the rules' (P6's
    up_launch; block_n / block_k / num_warps still override it). flag_deps (B' design only, else ignored): kernel A
    releases B' right after its wait and counts the h columns it stores per B' K chunk; each B' program waits for its
    own chunk's count instead of all of A (see "flag_deps" above `_publish_h`). Same loads, same sums: same bits.
    early_release: with PDL, kernel A releases the next kernel (B) right after its wait instead of after its K loop,
    so B's programs are resident and load their first weight tiles while A streams (B still waits for all of A).
    down_early_release: the same for B' (split design, without flag_deps) and the kernel after the op.
    latent_prewait (latent MoE): kernel C runs the shared expert's down-projection, and where one K step covers the
    latent row loads its W_up tile, before its gdc_wait; only the routed part waits for B''s u (same bits).
    routed_l2_prefetch: with PDL, B' (split, dense)'s routed slots ask L2 for their W2 rows (the experts the router
    chose, two kernels back) before the wait, while kernel A streams (same bits).
    up_prewait (latent MoE, kernel A's "rows" design; ignored otherwise): A's routed programs read their expert and
    load their first K step of gate and up rows before gdc_wait. The router ran two kernels back (the front GEMV that
    makes x comes between), so the ids are final once A's programs run; only x waits (same bits).
    latent_tail (latent MoE): a callable (grid, kernel C's arguments, its constexprs and launch options, launch) that
    launches kernel C in its stead and whose result this function returns (kernels.moe_out_norm: C with the next
    AttnRes norm as its last program's tail); None: C as above, the output returned."""
    if triton is None:
        raise RuntimeError("fused_moe_decode: triton is not installed")
    num_experts, inter, width, out_width = check_args(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                                                      shared_in, shared_up, shared_w2, act, latent_up_w,
                                                      latent_norm_w, shared_w13)
    if latent_tail is not None and latent_up_w is None:
        raise ValueError("fused_moe_decode: latent_tail needs a latent MoE (latent_up_w)")
    n, k = topk_ids.shape
    quantized = w13_scale is not None
    if block_k is not None:
        check_pow2("block_k", block_k, 32)
    if block_n is not None:
        check_pow2("block_n", block_n, 1)
    if split is not None:
        split = check_split_config(split)
    if up_launch is not None:
        up_launch = check_up_launch(up_launch)
    up_design, down_design = designs or kernel_designs(n, quantized)
    for design, known in ((up_design, DESIGNS), (down_design, DOWN_DESIGNS)):
        if design not in known:
            raise ValueError(f"fused_moe_decode: unknown kernel design {design!r} (known: {', '.join(known)})")
        if design == "rows" and quantized:
            raise ValueError("fused_moe_decode: the \"rows\" kernel design takes dense weights, not MXFP4")
    out = torch.empty(n, out_width, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    pdl = pdl_for(use_pdl, x)
    launch = {"launch_pdl": True} if pdl else {}

    def config(kernel, programs, rows, kk, design="tiles"):
        if kernel == "up" and up_launch is not None:
            bn, bk, warps = up_launch
        elif design == "rows":
            bn, bk, warps = rows_config(programs, rows, n * k, kernel, kk)
        else:
            bn, bk, warps = gemv_config(kernel, programs, rows, kk, quantized, k)
        return block_n or bn, block_k or bk, num_warps or warps

    x = x if x.stride(1) == 1 else x.contiguous()
    ids, wts = topk_ids.contiguous(), topk_weights.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    s13 = w13_scale.contiguous() if quantized else w13  # unused pointer when dense
    s2 = w2_scale.contiguous() if quantized else w2
    h = torch.empty(n * k, inter, dtype=torch.float32, device=x.device)
    act_id = ACTS[act]
    shared = shared_w2 is not None
    shared_width = shared_w2.shape[-1] if shared else 0
    latent = latent_up_w is not None
    shared_in_b = shared and not latent  # B adds the shared expert (latent: kernel C does, after the up-projection)
    routed_width = w2.shape[1]
    slot_a = shared_w13 is not None
    shared_width_a = shared_w13.shape[0] // 2 if slot_a else 0
    if down_design == "split":  # B''s launch first: with flag_deps kernel A counts h's columns per B' K chunk
        slots = k + int(shared_in_b)
        launch_b = split or split_config(n * slots, routed_width, inter, quantized)
        launch_b = SplitConfig(block_n or launch_b.block_n, block_k or launch_b.block_k,
                               num_warps or launch_b.num_warps, launch_b.k_split, launch_b.prefetch and not quantized)
        block_ks = block_k or shared_block_k(launch_b.block_n, max(shared_width, 1))
    flags = flag_deps and down_design == "split"
    flag_buf, chunk, chunk_s, a_flags = h, 1, 1, {}  # unused pointer and sizes without flag_deps
    if flags:
        chunk, chunk_s = flag_chunks(inter, shared_width_a, routed_width, launch_b, block_ks)
        flag_buf = arrival_counters(x.device, n * (k + int(slot_a)) * launch_b.k_split * FLAG_STRIDE, FLAGS_OWNER)
        a_flags = dict(FLAGS=True, KSPLIT=launch_b.k_split, FLAG_STRIDE=FLAG_STRIDE)
    # the routed slots' tile (the rule counts them only); the shared slot (shared_w13) adds n programs per column
    # block, over max(I, Is) columns, each slot masking what lies past its own width
    bn, bk, warps = config("up", n * k, inter, width, up_design)
    hs = torch.empty(n, shared_width_a, dtype=torch.float32, device=x.device) if slot_a else h
    sw13 = shared_w13.contiguous() if slot_a else h  # unused pointer without the shared slot
    grid_a = (n * (k + int(slot_a)), triton.cdiv(max(inter, shared_width_a), bn))
    # the shared-slot prefetches at batch 1 only: there they made the 48B step 1% faster, at batch 8 the op 10%
    # slower (traces/h200_s10/call4: 7.619 vs 7.090 ms with fold in both)
    shared_l2_prefetch = shared_l2_prefetch and n <= L2_PREFETCH_MAX_TOKENS
    down_l2_prefetch = down_l2_prefetch and n <= L2_PREFETCH_MAX_TOKENS
    routed_l2_prefetch = routed_l2_prefetch and n <= L2_PREFETCH_MAX_TOKENS
    first, prefetch_a = shared_l2_launch(shared_l2_prefetch and slot_a, pdl, sw13, width)
    if first:
        grid_a = grid_a[::-1]  # (column blocks, tokens + pairs): the shared slot's programs launch first
    a_opts = dict(SHARED_FIRST=first, SHARED_L2_PREFETCH=prefetch_a, PIECES=32 * warps) if first else {}
    if pdl and early_release:
        a_opts["EARLY"] = True
    if up_prewait and latent and up_design == "rows":
        a_opts["PREWAIT"] = True
    if up_design == "rows":
        _expert_up_rows_kernel[grid_a](
            x, ids, w13, h, sw13, hs, flag_buf, x.stride(0), width, inter, shared_width_a, n * k, chunk, chunk_s,
            float(beta), float(linear_beta), TOP_K=k, ACT=act_id, SHARED_SLOT=slot_a, BLOCK_N=bn, BLOCK_K=bk,
            USE_PDL=pdl, num_warps=warps, **a_opts, **a_flags, **launch)
    else:
        _expert_up_kernel[grid_a](
            x, ids, w13, s13, h, sw13, hs, flag_buf, x.stride(0), width, inter, shared_width_a, n * k, chunk, chunk_s,
            float(beta), float(linear_beta), TOP_K=k, ACT=act_id, MXFP4=quantized, SHARED_SLOT=slot_a, BLOCK_N=bn,
            BLOCK_K=bk, USE_PDL=pdl, num_warps=warps, **a_opts, **a_flags, **launch)
    if slot_a:  # B (any design) reads the shared expert's input already activated, from kernel A
        shared_in, shared_up = hs, None
    sin = shared_in if shared else h
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    sup = shared_up if shared_up is not None else sin
    sup = sup if sup.stride(-1) == 1 else sup.contiguous()
    sw2 = shared_w2.contiguous() if shared else h
    # latent: B leaves u in fp32 for C; the shared expert joins in C, on the output side of the up-projection
    u = torch.empty(n, routed_width, dtype=torch.float32, device=x.device) if latent else out
    if down_design == "split":
        bn, warps = launch_b.block_n, launch_b.num_warps
        groups = n * triton.cdiv(routed_width, bn)
        parts = slots * launch_b.k_split
        partials = torch.empty(groups * parts * bn, dtype=torch.float32, device=x.device)
        prefetch_b = (down_l2_prefetch and shared_in_b and pdl
                      and l2_prefetch.region_ok(sw2, shared_width * sw2.element_size()))
        b_opts = dict(SHARED_L2_PREFETCH=True, PIECES=32 * warps) if prefetch_b else {}
        if routed_l2_prefetch and pdl and not quantized and l2_prefetch.region_ok(w2, inter * w2.element_size()):
            b_opts.update(ROUTED_L2_PREFETCH=True, PIECES=32 * warps)
        if flags:
            b_opts.update(FLAGS=True, FLAG_SHARED=slot_a, SPIN=_SPIN, FLAG_STRIDE=FLAG_STRIDE)
        elif pdl and down_early_release:
            b_opts["EARLY"] = True
        _expert_down_split_kernel[(groups, parts)](
            h, ids, wts, w2, s2, sin, sup, sw2, u, partials, arrival_counters(x.device, groups, ARRIVALS_OWNER),
            flag_buf, n * k, inter, routed_width, shared_width, sin.stride(0), sup.stride(0), u.stride(0),
            float(beta), float(linear_beta), TOP_K=k, SLOTS=slots, ACT=act_id, MXFP4=quantized, SHARED=shared_in_b,
            SHARED_GLU=shared_up is not None, BLOCK_N=bn, BLOCK_K=launch_b.block_k, BLOCK_KS=block_ks, USE_PDL=pdl,
            KSPLIT=launch_b.k_split, PREFETCH=launch_b.prefetch, num_warps=warps, **b_opts, **launch)
    elif down_design == "rows":
        bn, bk, warps = config("down", n, routed_width, inter, down_design)
        _expert_down_rows_kernel[(n, triton.cdiv(routed_width, bn))](
            h, ids, wts, w2, sin, sup, sw2, u, inter, routed_width, shared_width,
            sin.stride(0), sup.stride(0), u.stride(0), float(beta), float(linear_beta),
            TOP_K=k, ACT=act_id, SHARED=shared_in_b, SHARED_GLU=shared_up is not None,
            BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl, num_warps=warps, **launch)
    else:
        bn, bk, warps = config("down", n, routed_width, inter, down_design)
        _expert_down_kernel[(n, triton.cdiv(routed_width, bn))](
            h, ids, wts, w2, s2, sin, sup, sw2, u, inter, routed_width, shared_width,
            sin.stride(0), sup.stride(0), u.stride(0), float(beta), float(linear_beta),
            TOP_K=k, TOP_K_PAD=triton.next_power_of_2(k), ACT=act_id, MXFP4=quantized,
            SHARED=shared_in_b, SHARED_GLU=shared_up is not None, BLOCK_N=bn, BLOCK_K=bk,
            BLOCK_KS=block_k or shared_block_k(bn, max(shared_width, 1)), USE_PDL=pdl, num_warps=warps, **launch)
    if latent:
        upw = latent_up_w.contiguous()
        nw = latent_norm_w.contiguous() if latent_norm_w is not None else upw
        launch_c = latent_config(n, out_width, routed_width, shared_width, quantized, block_n)
        bn, bk_c = launch_c.block_n, block_k or launch_c.block_k
        c_opts = dict(PREWAIT=True, PREWAIT_W=bk_c >= routed_width) if latent_prewait else {}
        grid_c = (n, triton.cdiv(out_width, bn))
        c_args = (u, nw, upw, sin, sup, sw2, out, routed_width, out_width, shared_width,
                  sin.stride(0), sup.stride(0), out.stride(0), float(latent_eps), float(beta), float(linear_beta))
        c_consts = dict(ACT=act_id, NORM=latent_norm_w is not None, SHARED=shared, SHARED_GLU=shared_up is not None,
                        BLOCK_N=bn, BLOCK_K=bk_c, BLOCK_KS=block_k or launch_c.block_ks, USE_PDL=pdl,
                        PREWAIT=bool(c_opts), PREWAIT_W=c_opts.get("PREWAIT_W", False),
                        num_warps=num_warps or launch_c.num_warps)
        if latent_tail is not None:  # kernel C with a tail: kernels.moe_out_norm launches it, returns its outputs
            return latent_tail(grid_c, c_args, c_consts, launch)
        _latent_out_kernel[grid_c](*c_args, **c_consts, **launch)
    return out


# --------------------------------------------------------------------------- the k3 op

@torch.library.custom_op("k3::fused_moe_decode", mutates_args=())
def fused_moe_decode(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                     shared_in: torch.Tensor | None, shared_up: torch.Tensor | None,
                     shared_w2: torch.Tensor | None, act: str, beta: float, linear_beta: float,
                     crossover: int, latent_up_w: torch.Tensor | None = None,
                     latent_norm_w: torch.Tensor | None = None, latent_eps: float = 1e-5,
                     use_pdl: bool = False, shared_w13: torch.Tensor | None = None,
                     down_split: list[int] | None = None, shared_l2_prefetch: bool = False,
                     down_l2_prefetch: bool = False, up_launch: list[int] | None = None,
                     flag_deps: bool = False, early_release: bool = False,
                     down_early_release: bool = False, latent_prewait: bool = False,
                     grouped_sorted: bool = False, sorted_finish: bool = False,
                     routed_l2_prefetch: bool = False, up_prewait: bool = False) -> torch.Tensor:
    """Routed experts (+ latent tail, + shared expert) of a decode step in one node; see the module doc.
    down_split: kernel B''s launch (SplitConfig's fields, prefetch as 0/1) at every batch below the crossover,
    instead of split_config()'s per-shape choice (P6's down_split option; the CPU reference ignores it).
    shared_l2_prefetch / down_l2_prefetch / up_launch / flag_deps / early_release / down_early_release /
    latent_prewait: fused_moe_triton's options of the same names (P6's; same values). grouped_sorted: from the
    crossover on, the routed experts by kernels.moe_sorted instead of torch._grouped_mm; sorted_finish: its sum and
    latent RMSNorm in one kernel; routed_l2_prefetch, up_prewait: fused_moe_triton's (P6's options of the same
    names)."""
    return fused_moe_reference(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up,
                               shared_w2, act, beta, linear_beta, latent_up_w, latent_norm_w, latent_eps, shared_w13)


@fused_moe_decode.register_kernel("cuda")
def _fused_moe_decode_cuda(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up,
                           shared_w2, act, beta, linear_beta, crossover, latent_up_w=None, latent_norm_w=None,
                           latent_eps=1e-5, use_pdl=False, shared_w13=None, down_split=None,
                           shared_l2_prefetch=False, down_l2_prefetch=False, up_launch=None, flag_deps=False,
                           early_release=False, down_early_release=False, latent_prewait=False,
                           grouped_sorted=False, sorted_finish=False, routed_l2_prefetch=False, up_prewait=False):
    args = (x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up, shared_w2, act, beta,
            linear_beta, latent_up_w, latent_norm_w, latent_eps, shared_w13)
    if triton is None or x.shape[0] >= crossover:
        with torch.cuda.device(x.device):
            return fused_moe_grouped(*args, grouped_sorted=grouped_sorted, sorted_finish=sorted_finish)
    split = None if down_split is None else split_from_list(down_split)
    with torch.cuda.device(x.device):  # Triton launches on the current device
        return fused_moe_triton(*args, use_pdl=use_pdl, split=split, shared_l2_prefetch=shared_l2_prefetch,
                                down_l2_prefetch=down_l2_prefetch, up_launch=up_launch, flag_deps=flag_deps,
                                early_release=early_release, down_early_release=down_early_release,
                                latent_prewait=latent_prewait, routed_l2_prefetch=routed_l2_prefetch,
                                up_prewait=up_prewait)


@fused_moe_decode.register_fake
def _fused_moe_decode_fake(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up,
                           shared_w2, act, beta, linear_beta, crossover, latent_up_w=None, latent_norm_w=None,
                           latent_eps=1e-5, use_pdl=False, shared_w13=None, down_split=None,
                           shared_l2_prefetch=False, down_l2_prefetch=False, up_launch=None, flag_deps=False,
                           early_release=False, down_early_release=False, latent_prewait=False,
                           grouped_sorted=False, sorted_finish=False, routed_l2_prefetch=False, up_prewait=False):
    _, _, _, out_width = check_args(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up,
                                    shared_w2, act, latent_up_w, latent_norm_w, shared_w13)
    return x.new_empty(x.shape[0], out_width)


# --------------------------------------------------------------------------- build-time crossover

def _time_us(fn, iters: int = 20) -> float:
    """Mean µs per call of `fn`, `iters` calls replayed from one CUDA graph (what the engine runs; graph_timing)."""
    return replay_us([fn] * iters)


def random_routing(n: int, num_experts: int, top_k: int, device, seed: int = 0):
    """Uniformly random distinct experts per token (what a balanced router gives), weights summing to 1."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(n, num_experts, generator=gen).argsort(-1)[:, :top_k]
    wts = torch.rand(n, top_k, generator=gen)
    return ids.to(device), (wts / wts.sum(-1, keepdim=True)).to(device)


def crossover_case(n: int, w13, w2, w13_scale, w2_scale, shared_w2, shared_glu: bool, top_k: int, act: str,
                   beta: float, linear_beta: float, dtype, latent_up_w=None, latent_norm_w=None,
                   latent_eps: float = 1e-5, shared_w13=None) -> tuple:
    """Random op arguments for a batch of n tokens on this layer's weights. The shared expert's input is
    as wide as shared_w2's columns (not the experts' width: in a latent MoE they differ), and the latent
    tail comes along, so the measured op has the layer's shapes (and check_args accepts it); with shared_w13
    the op computes the shared expert's gate/up itself (kernel A's shared slot)."""
    width = w13.shape[2] * (2 if w13_scale is not None else 1)
    ids, wts = random_routing(n, w13.shape[0], top_k, w13.device, seed=n)
    x = torch.randn(n, width, device=w13.device, dtype=dtype)
    shared = (None, None)
    if shared_w2 is not None and shared_w13 is None:
        s = torch.randn(n, shared_w2.shape[1], device=w13.device, dtype=dtype)
        shared = (s, s if shared_glu else None)
    return (x, ids, wts, w13, w2, w13_scale, w2_scale, *shared, shared_w2, act, beta, linear_beta, latent_up_w,
            latent_norm_w, latent_eps, shared_w13)


@torch.no_grad()
def measure_crossover(w13, w2, w13_scale=None, w2_scale=None, shared_w2=None, top_k: int = 8, act: str = "silu",
                      beta: float = 4.0, linear_beta: float = 25.0, dtype=torch.bfloat16,
                      batches=CROSSOVER_BATCHES, shared_glu: bool = True, latent_up_w=None, latent_norm_w=None,
                      latent_eps: float = 1e-5, shared_w13=None, grouped_sorted: bool = False,
                      sorted_finish: bool = False) -> tuple[int, dict]:
    """Smallest batch in `batches` at which the grouped path is at least as fast as the GEMV kernels,
    timed on this layer's weights (CUDA) with the same tail the layer's op has (latent up-projection and
    norm, shared expert with or without its GLU, its gate/up in the op with shared_w13); NO_CROSSOVER if it
    never is. grouped_sorted / sorted_finish: the grouped path the op will run (kernels.moe_sorted). Returns
    (crossover, timings µs)."""
    timings = {}
    for n in batches:
        args = crossover_case(n, w13, w2, w13_scale, w2_scale, shared_w2, shared_glu, top_k, act, beta,
                              linear_beta, dtype, latent_up_w, latent_norm_w, latent_eps, shared_w13)
        fused = _time_us(lambda: fused_moe_triton(*args))
        grouped = _time_us(lambda: fused_moe_grouped(*args, grouped_sorted=grouped_sorted,
                                                     sorted_finish=sorted_finish))
        timings[n] = {"fused_us": round(fused, 2), "grouped_us": round(grouped, 2)}
        if grouped <= fused:
            return n, timings
    return NO_CROSSOVER, timings
