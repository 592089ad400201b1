"""MLA decode kernels that pass P15 puts into decode graphs: the prologue and paged latent attention.

`torch.ops.k3.mla_decode_prologue(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc,
q_a, q_norm_weight, q_eps) -> q_a_normed`, one program per token:

    c   = kv_norm_weight * rmsnorm(ckv[:, :r])            (`kv_a_layernorm`, model_def's RMSNorm order)
    kv_pool[loc // page, layer, loc % page] = [c ; ckv[:, r:]]    (`k3::kv_write`: the k_r slot as is)
    q_a_normed = q_norm_weight * rmsnorm(q_a)             (`q_a_layernorm`, K3's q-LoRA; when q_a is None
                                                           the op returns an empty [0] tensor nothing reads)

`ckv` and `q_a` may be column blocks of the merged input GEMM's output (row stride > width).

`torch.ops.k3.mla_decode_fused(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, pdl)
-> o_lat [B, H, r]`: absorbed NoPE-MLA decode (spec §6.1) with the query in latent space, given as
its two halves (no concatenation): q_nope [B, H, r] = W_UK^T q_n and q_rope [B, H, 64]. Scores over
request b's first seq_lens[b] cache rows [c ; k_r] (576 wide in K3, read through page_table) are
(q_nope · c + q_rope · k_r) * scale; the output is softmax(scores) @ c. No rotation anywhere (NoPE).

The kernel splits each request's context over NUM_SPLITS programs (split-K, chosen from the
static shapes so CUDA-graph replays never see a different grid); each writes an fp32 partial output
and its log-sum-exp, and a second kernel merges them exactly (spec §6.3): lse = log Σ e^{lse_s},
o = Σ e^{lse_s - lse} o_s; an empty split has lse = -inf and weight 0 (one program per (request, head) and
block of latent columns; `mla_decode_fused_out` also applies W_UV there, see LAUNCH_TABLE). One program of the first
kernel handles BLOCK_H heads of one request, so every KV tile it loads serves all of them (the
rows are shared by all heads: MQA in latent space, as in FlashMLA).

PDL (`pdl=True`, CUDA sm90+): both attention kernels launch with programmatic dependent launch and
call `gdc_wait` before touching anything an earlier kernel produced (q, the pool, the partials),
and the split kernel calls `gdc_launch_dependents` once its loop is done so the merge kernel's
launch overlaps its tail; the prologue (`pdl` argument) waits before reading ckv / q_a and releases
its dependents once they are read. Off by default in the ops; P15's config turns it on (its default).

MLA's output gate (`gate`, P15's `gate_out`, off by default): the merge + W_UV kernels also compute
out * sigmoid(gate) where they store out (the last-arriving program, with column blocks), so the two elementwise
kernels after the attention (K3's `o * sigmoid(g_proj(x))`) leave the decode step; rounded as those ops round.

W_UV L2 prefetch (`prefetch_w`, P15's `prefetch_w_uv`, off by default): each column-block merge + W_UV program asks
L2 for its W_UV block (dv rows x merge_cols, kernels/l2_prefetch.py) before gdc_wait, so the 4 MB a layer (48B)
streams while the latency-bound split kernel runs; only with PDL and 16-byte aligned blocks (`w_uv_prefetch_ok`),
same values either way. The query's W_UK absorption before the split kernel: kernels/mla_absorb.py.

CPU (and any device without Triton) runs the references, which are the exact compositions of
`model_def` ops (`attention_math.mla_decode_latent`, `k3::kv_write`). Testing without a GPU:
TRITON_INTERPRET=1 before this module is imported runs the kernels on CPU tensors
(tests/passes/kernels/interpret_mla_decode.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from k3compile.model_def.ops import attention_math

from . import l2_prefetch
from .pdl import pdl_for

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the ops still work through the references
    triton = None

BLOCK_N = 32  # cache rows per tile
TARGET_PROGRAMS = 264  # split until the grid fills ~2 waves of an H200's 132 SMs
BLOCK_DV = 64  # W_UV rows per program of the merge kernel that applies it (64 x 512 bf16: 64 KB of weight)
OUT_MAX_TOKENS = 8  # up to this many tokens the merge kernel applies W_UV; above, cuBLAS's batched GEMM (W_UV read
                    # once per head rather than once per token and head) after the plain merge. The ops take another
                    # bound (`w_uv_max_tokens`, P15's option of that name): at batch 8 the GEMM path is 3 kernels
                    # (merge, batched GEMM, the [H, B, dv] -> [B, H * dv] copy) where the merge + W_UV is 1: 14 of the
                    # 42 kernels the 48B step had more at batch 8 than at 1 (traces/h200_s13/call2). 8 since session
                    # 15: 48B batch 8, 6.947 vs 6.938 ms with 4 (same time), 236 vs 250 kernels (traces/h200_s15)
# Per-shape launch choices, recorded by P15 into each decode node (the ops' launch_table): rows (largest batch,
# num_splits (0: from the shapes, `num_splits_for`), merge_cols); the first row covering the batch applies. A merge
# program handles one (request, head) and merge_cols of the r latent columns, loading all of its splits' partials
# for them in one 2-D load (the whole-row kernel, merge_cols 0, walks the splits one L2 round trip at a time), and
# with W_UV that column block of W_UV [dv, merge_cols]: at batch 1 the grid is H x r / 64 = 256 programs instead of
# H x 2, and each (request, head)'s last-arriving program sums the column blocks' dv partials.
# H200, 48B shape (tools/bench_mla9.py, session 9 call 1: split + merge µs per layer, fastest summed over context 512
# and 4096): batch 1 the shape's splits with 64 columns; batch 2-4 32 splits, 64 columns; above, the whole-row merge.
ANY_BATCH = 1 << 30  # the last row's largest batch, spelled '*' in P15's option
LAUNCH_TABLE = ((1, 0, 64), (4, 32, 64), (ANY_BATCH, 0, 0))


# --------------------------------------------------------------------------- argument checks

def check_decode_args(q_nope, q_rope, kv_pool, layer, page_table, seq_lens) -> None:
    if q_nope.dim() != 3 or q_rope.dim() != 3 or q_nope.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"mla_decode_fused: q_nope [B, H, r] and q_rope [B, H, rope] must agree on B, H; got "
                         f"{tuple(q_nope.shape)} and {tuple(q_rope.shape)}")
    if kv_pool.dim() != 4:
        raise ValueError(f"mla_decode_fused: kv_pool must be [pages, layers, page_size, width], got "
                         f"{tuple(kv_pool.shape)}")
    width = q_nope.shape[-1] + q_rope.shape[-1]
    if kv_pool.shape[-1] != width:
        raise ValueError(f"mla_decode_fused: cache rows are {kv_pool.shape[-1]} wide but the query is "
                         f"{q_nope.shape[-1]} + {q_rope.shape[-1]} = {width}")
    if not 0 <= layer < kv_pool.shape[1]:
        raise ValueError(f"mla_decode_fused: layer {layer} out of range (pool has {kv_pool.shape[1]} MLA layers)")
    if page_table.dim() != 2 or page_table.shape[0] != q_nope.shape[0] or seq_lens.shape != (q_nope.shape[0],):
        raise ValueError(f"mla_decode_fused: page_table [B, max_pages] and seq_lens [B] must match B = "
                         f"{q_nope.shape[0]}; got {tuple(page_table.shape)}, {tuple(seq_lens.shape)}")


def check_prologue_args(ckv, kv_norm_weight, kv_pool, layer, out_cache_loc, q_a, q_norm_weight) -> None:
    r = kv_norm_weight.shape[0]
    if ckv.dim() != 2 or kv_pool.dim() != 4 or ckv.shape[1] != kv_pool.shape[-1] or r >= ckv.shape[1]:
        raise ValueError(f"mla_decode_prologue: ckv [N, r + rope] must match the pool's row width "
                         f"{kv_pool.shape[-1] if kv_pool.dim() == 4 else '?'} with r = {r}; got {tuple(ckv.shape)}")
    if out_cache_loc.shape != (ckv.shape[0],):
        raise ValueError(f"mla_decode_prologue: out_cache_loc must be [{ckv.shape[0]}], got {tuple(out_cache_loc.shape)}")
    if not 0 <= layer < kv_pool.shape[1]:
        raise ValueError(f"mla_decode_prologue: layer {layer} out of range (pool has {kv_pool.shape[1]} MLA layers)")
    if (q_a is None) != (q_norm_weight is None):
        raise ValueError("mla_decode_prologue: q_a and q_norm_weight come together")
    if q_a is not None and (q_a.dim() != 2 or q_a.shape[0] != ckv.shape[0] or q_norm_weight.shape != q_a.shape[1:]):
        raise ValueError(f"mla_decode_prologue: q_a [N, q_lora] with q_norm_weight [q_lora]; got "
                         f"{tuple(q_a.shape)}, {tuple(q_norm_weight.shape)}")


# --------------------------------------------------------------------------- CPU references

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def prologue_reference(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_a=None, q_norm_weight=None,
                       q_eps=0.0) -> torch.Tensor:
    check_prologue_args(ckv, kv_norm_weight, kv_pool, layer, out_cache_loc, q_a, q_norm_weight)
    r = kv_norm_weight.shape[0]
    rows = torch.cat([_rms_norm(ckv[:, :r], kv_norm_weight, kv_eps), ckv[:, r:]], -1)
    page = kv_pool.shape[2]
    kv_pool[out_cache_loc // page, layer, out_cache_loc % page] = rows.to(kv_pool.dtype)
    if q_a is None:
        return ckv.new_empty(0)
    return _rms_norm(q_a, q_norm_weight, q_eps)


def check_w_uv(w_uv, heads: int, r: int) -> None:
    if w_uv.dim() != 3 or w_uv.shape[0] != heads or w_uv.shape[2] != r or w_uv.stride(-1) != 1:
        raise ValueError(f"mla_decode_fused_out: W_UV must be [H={heads}, dv, r={r}] with contiguous rows, got "
                         f"{tuple(w_uv.shape)} (strides {w_uv.stride()})")


def w_uv_of(kv_b_weight: torch.Tensor, heads: int, nope: int) -> torch.Tensor:
    """W_UV [H, dv, r] as a view of kv_b_proj's weight [H * (nope + dv), r] (what MLAMixer slices)."""
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] % heads or not 0 <= nope < kv_b_weight.shape[0] // heads:
        raise ValueError(f"mla_decode_fused_out: kv_b_proj weight {tuple(kv_b_weight.shape)} is not "
                         f"[{heads} heads x (nope={nope} + dv), r]")
    return kv_b_weight.unflatten(0, (heads, -1))[:, nope:]


def decode_out_reference(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, w_uv,
                         gate: torch.Tensor | None = None) -> torch.Tensor:
    """The decode attention, then MLAMixer's einsum("bhr,hdr->bhd", o_lat, W_UV) and flatten: [B, H * dv]; with
    `gate` [B, H * dv] also MLAMixer's output gate, `o * sigmoid(gate)`."""
    o_lat = decode_reference(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale)
    check_w_uv(w_uv, o_lat.shape[1], o_lat.shape[2])
    o = torch.einsum("bhr,hdr->bhd", o_lat, w_uv).flatten(-2)
    return o if gate is None else o * torch.sigmoid(check_gate(gate, o))


def check_gate(gate: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if gate.shape != out.shape or gate.dtype != out.dtype:
        raise ValueError(f"mla_decode_fused_out: the output gate must be {tuple(out.shape)} {out.dtype} like the "
                         f"output, got {tuple(gate.shape)} {gate.dtype}")
    return gate


def decode_reference(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale) -> torch.Tensor:
    check_decode_args(q_nope, q_rope, kv_pool, layer, page_table, seq_lens)
    q_lat = torch.cat([q_nope, q_rope], -1)
    return attention_math.mla_decode_latent(q_lat, kv_pool[:, layer].to(q_lat.dtype), page_table, seq_lens, scale,
                                            q_nope.shape[-1])


# --------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _rms_row(x_ptr, w_ptr, n, eps, BLOCK: tl.constexpr):
        """w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) in fp32, like model_def's RMSNorm (the caller
        rounds it to the product's dtype)."""
        cols = tl.arange(0, BLOCK)
        m = cols < n
        x = tl.load(x_ptr + cols, mask=m, other=0.0)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        normed = (xf * inv).to(x.dtype).to(tl.float32)
        return tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32) * normed

    @triton.jit
    def prologue_row(tok, ckv_ptr, ckv_stride, kv_w_ptr, kv_eps, pool_ptr, pool_stride_page, pool_stride_slot, loc_ptr,
                     R: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, ROW_DTYPE: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_ROPE: tl.constexpr):
        """Token `tok`'s kv norm and KV page write (after the caller's gdc_wait); pool_ptr at layer `layer`."""
        loc = tl.load(loc_ptr + tok).to(tl.int64)
        dst = pool_ptr + (loc // PAGE) * pool_stride_page + (loc % PAGE) * pool_stride_slot
        src = ckv_ptr + tok * ckv_stride
        # the normed latent takes the graph's cat dtype (ROW_DTYPE) first, then the pool's
        c = _rms_row(src, kv_w_ptr, R, kv_eps, BLOCK_R).to(ROW_DTYPE)
        cols = tl.arange(0, BLOCK_R)
        tl.store(dst + cols, c.to(pool_ptr.dtype.element_ty), mask=cols < R)
        rc = tl.arange(0, BLOCK_ROPE)
        k_r = tl.load(src + R + rc, mask=rc < ROPE, other=0.0)
        tl.store(dst + R + rc, k_r.to(ROW_DTYPE).to(pool_ptr.dtype.element_ty), mask=rc < ROPE)

    @triton.jit
    def _prologue_kernel(
        ckv_ptr, ckv_stride, kv_w_ptr, kv_eps, pool_ptr, pool_stride_page, pool_stride_slot, loc_ptr,
        qa_ptr, qa_stride, q_w_ptr, q_eps, q_out_ptr,
        R: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, Q_DIM: tl.constexpr, ROW_DTYPE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_ROPE: tl.constexpr, BLOCK_Q: tl.constexpr, HAS_Q: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # ckv / q_a come from the GEMM before; the pool is read after us
        prologue_row(tok, ckv_ptr, ckv_stride, kv_w_ptr, kv_eps, pool_ptr, pool_stride_page, pool_stride_slot, loc_ptr,
                     R, ROPE, PAGE, ROW_DTYPE, BLOCK_R, BLOCK_ROPE)
        if HAS_Q:
            qc = tl.arange(0, BLOCK_Q)
            q = _rms_row(qa_ptr + tok * qa_stride, q_w_ptr, Q_DIM, q_eps, BLOCK_Q)
            if USE_PDL:
                tl.extra.cuda.gdc_launch_dependents()  # inputs read; only our store remains
            tl.store(q_out_ptr + tok * Q_DIM + qc, q.to(q_out_ptr.dtype.element_ty), mask=qc < Q_DIM)
        elif USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _decode_split_kernel(
        qn_ptr, qn_sb, qn_sh, qr_ptr, qr_sb, qr_sh,
        pool_ptr, pool_stride_page, pool_stride_slot, pt_ptr, pt_stride, seq_ptr,
        part_ptr, lse_ptr, H, scale,
        R: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROPE: tl.constexpr, USE_PDL: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = heads < H
        seq_len = tl.load(seq_ptr + b).to(tl.int32)  # a step input: written before the step, not by a kernel
        chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # q and the pool row written by the prologue come from earlier kernels
        rcols = tl.arange(0, R)
        pcols = tl.arange(0, BLOCK_ROPE)
        pm = pcols < ROPE
        qn = tl.load(qn_ptr + b * qn_sb + heads[:, None] * qn_sh + rcols[None, :], mask=hm[:, None], other=0.0)
        qr = tl.load(qr_ptr + b * qr_sb + heads[:, None] * qr_sh + pcols[None, :], mask=hm[:, None] & pm[None, :],
                     other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, R], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            nm = pos < end
            page = tl.load(pt_ptr + b * pt_stride + pos // PAGE, mask=nm, other=0).to(tl.int64)
            row = pool_ptr + page * pool_stride_page + (pos % PAGE).to(tl.int64) * pool_stride_slot
            c = tl.load(row[:, None] + rcols[None, :], mask=nm[:, None], other=0.0)  # [BLOCK_N, R]
            kr = tl.load(row[:, None] + R + pcols[None, :], mask=nm[:, None] & pm[None, :], other=0.0)
            s = tl.dot(qn, tl.trans(c.to(qn.dtype)), input_precision=DOT_PRECISION)
            s += tl.dot(qr, tl.trans(kr.to(qr.dtype)), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
            s = tl.where(nm[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(qn.dtype), c.to(qn.dtype), input_precision=DOT_PRECISION)
            m_i = m_new
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if start < end:  # a split past the context stores nothing: the merge reads only the used ones
            out = b * H * NUM_SPLITS + heads * NUM_SPLITS + split  # [B, H, NUM_SPLITS] flattened
            o = acc / l_i[:, None]
            tl.store(part_ptr + out[:, None] * R + rcols[None, :], o, mask=hm[:, None])
            tl.store(lse_ptr + out, m_i + tl.log(l_i), mask=hm)

    @triton.jit
    def _used_splits(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """How many of a request's splits hold rows (the split kernel's chunking): the others stored nothing."""
        chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        return tl.where(seq_len > 0, tl.cdiv(seq_len, tl.maximum(chunk, 1)), 0)

    @triton.jit
    def _merged_row(part_ptr, lse_ptr, bh, used, R: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    SPLITS_PAD: tl.constexpr):
        """The exact merge of one (request, head)'s used splits (spec §6.3), fp32 [R]; 0 when none is used."""
        sp = tl.arange(0, SPLITS_PAD)
        sm = sp < used
        lse = tl.load(lse_ptr + bh * NUM_SPLITS + sp, mask=sm, other=float("-inf"))
        top = tl.max(lse, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # no split used: weights 0, output 0
        w = tl.where(sm, tl.exp(lse - top), 0.0)
        total = tl.sum(w, axis=0)
        w = w / tl.where(total == 0.0, 1.0, total)
        rcols = tl.arange(0, R)
        o = tl.zeros([R], tl.float32)
        for s in range(0, used):  # fixed order: the result does not depend on which split finished first
            w_s = tl.sum(tl.where(sp == s, w, 0.0), axis=0)
            o += w_s * tl.load(part_ptr + (bh * NUM_SPLITS + s) * R + rcols)
        return o

    @triton.jit
    def _decode_merge_kernel(part_ptr, lse_ptr, seq_ptr, out_ptr, H, R: tl.constexpr, NUM_SPLITS: tl.constexpr,
                             SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)  # one (request, head)
        used = _used_splits(tl.load(seq_ptr + bh // H).to(tl.int32), NUM_SPLITS, BLOCK_N)  # a step input
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        o = _merged_row(part_ptr, lse_ptr, bh, used, R, NUM_SPLITS, SPLITS_PAD)
        tl.store(out_ptr + bh * R + tl.arange(0, R), o.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _gated(y, gate_ptrs, mask, OUT_DTYPE: tl.constexpr):
        """MLA's output gate on the attention output y (fp32): o * sigmoid(g) rounded as the unfused graph rounds it
        (o and sigmoid(g) each in the output dtype, then their product), in fp32."""
        g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g).to(OUT_DTYPE).to(tl.float32)
        return y.to(OUT_DTYPE).to(tl.float32) * s

    @triton.jit
    def _decode_merge_out_kernel(part_ptr, lse_ptr, seq_ptr, w_ptr, w_sh, w_sd, out_ptr, H,
                                 R: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
                                 SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, LAT_DTYPE: tl.constexpr,
                                 USE_PDL: tl.constexpr, gate_ptr=None, gate_stride=0, HAS_GATE: tl.constexpr = False):
        # Program (request x head, block of W_UV's output rows): the merge above, rounded to the latent output's
        # dtype as mla_decode_fused returns it, then o[b, h, d] = sum_r o_lat[r] W_UV[h, d, r] (fp32 sums),
        # stored at out[b, h * DV + d]: the einsum "bhr,hdr->bhd" and the flatten after it, in one kernel.
        bh = tl.program_id(0).to(tl.int64)
        h = bh % H
        d = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        dm = d < DV
        rcols = tl.arange(0, R)
        # W_UV is a weight: with PDL its block loads while the split kernel finishes
        w = tl.load(w_ptr + h * w_sh + d[:, None] * w_sd + rcols[None, :], mask=dm[:, None], other=0.0)
        used = _used_splits(tl.load(seq_ptr + bh // H).to(tl.int32), NUM_SPLITS, BLOCK_N)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        o = _merged_row(part_ptr, lse_ptr, bh, used, R, NUM_SPLITS, SPLITS_PAD).to(LAT_DTYPE).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * o[None, :], axis=1)
        if HAS_GATE:
            y = _gated(y, gate_ptr + (bh // H) * gate_stride + h * DV + d, dm, out_ptr.dtype.element_ty)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr + (bh // H) * H * DV + h * DV + d, y.to(out_ptr.dtype.element_ty), mask=dm)

    @triton.jit
    def _merged_cols(part_ptr, lse_ptr, bh, used, cols, R: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     SPLITS_PAD: tl.constexpr):
        """The exact merge (spec §6.3) of one (request, head)'s used splits at latent columns `cols`, fp32; all
        splits' partials in one masked 2-D load (one L2 round trip); 0 when no split is used."""
        sp = tl.arange(0, SPLITS_PAD)
        sm = sp < used
        lse = tl.load(lse_ptr + bh * NUM_SPLITS + sp, mask=sm, other=float("-inf"))
        top = tl.max(lse, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.where(sm, tl.exp(lse - top), 0.0)
        total = tl.sum(w, axis=0)
        w = w / tl.where(total == 0.0, 1.0, total)
        parts = tl.load(part_ptr + (bh * NUM_SPLITS + sp)[:, None] * R + cols[None, :], mask=sm[:, None], other=0.0)
        return tl.sum(w[:, None] * parts, axis=0)

    @triton.jit
    def _decode_merge_cols_kernel(part_ptr, lse_ptr, seq_ptr, out_ptr, H, R: tl.constexpr,
                                  NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                                  MERGE_COLS: tl.constexpr, USE_PDL: tl.constexpr):
        # program (request x head, block of MERGE_COLS latent columns)
        bh = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * MERGE_COLS + tl.arange(0, MERGE_COLS)
        used = _used_splits(tl.load(seq_ptr + bh // H).to(tl.int32), NUM_SPLITS, BLOCK_N)  # a step input
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        o = _merged_cols(part_ptr, lse_ptr, bh, used, cols, R, NUM_SPLITS, SPLITS_PAD)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr + bh * R + cols, o.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _decode_merge_out_cols_kernel(part_ptr, lse_ptr, seq_ptr, w_ptr, w_sh, w_sd, ws_ptr, count_ptr, out_ptr, H,
                                      R: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                                      MERGE_COLS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                                      BLOCK_N: tl.constexpr, LAT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr,
                                      PREFETCH_W: tl.constexpr = False, W_BYTES: tl.constexpr = 2,
                                      PIECES: tl.constexpr = 128, gate_ptr=None, gate_stride=0,
                                      HAS_GATE: tl.constexpr = False):
        # Program (request x head, block kb of MERGE_COLS latent columns): the merge at those columns, rounded to the
        # latent output's dtype (as mla_decode_fused returns it), times W_UV[h, :, those columns]: a [DV] fp32
        # partial of the einsum "bhr,hdr->bhd". With one block it is the result; otherwise each program stores its
        # partial in ws [B*H, KB, DV_PAD] and counts itself in count[bh] (zero between launches); the last to arrive
        # sums the KB partials in a fixed order (deterministic), stores out[b, h * DV + d] and resets the count.
        KB: tl.constexpr = R // MERGE_COLS
        bh = tl.program_id(0).to(tl.int64)
        kb = tl.program_id(1)
        h = bh % H
        d = tl.arange(0, DV_PAD)
        dm = d < DV
        cols = kb * MERGE_COLS + tl.arange(0, MERGE_COLS)
        if PREFETCH_W:  # ask L2 for the whole W_UV block at once (DV rows of MERGE_COLS) before anything else
            l2_prefetch.prefetch_rows_l2(w_ptr + h * w_sh + kb * MERGE_COLS, DV, MERGE_COLS * W_BYTES, w_sd * W_BYTES,
                                         PIECES)
        # W_UV is a weight: with PDL its block loads while the split kernel finishes
        w = tl.load(w_ptr + h * w_sh + d[:, None] * w_sd + cols[None, :], mask=dm[:, None], other=0.0)
        used = _used_splits(tl.load(seq_ptr + bh // H).to(tl.int32), NUM_SPLITS, BLOCK_N)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        o = _merged_cols(part_ptr, lse_ptr, bh, used, cols, R, NUM_SPLITS, SPLITS_PAD).to(LAT_DTYPE).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * o[None, :], axis=1)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        dst = out_ptr + (bh // H) * H * DV + h * DV + d
        if KB == 1:
            if HAS_GATE:  # MLA's output gate, on the finished sum
                y = _gated(y, gate_ptr + (bh // H) * gate_stride + h * DV + d, dm, out_ptr.dtype.element_ty)
            tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=dm)
        else:
            tl.store(ws_ptr + (bh * KB + kb) * DV_PAD + d, y)
            tl.debug_barrier()  # every thread's partial is stored before the (releasing) count below
            arrived = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel")
            if arrived == KB - 1:  # the others' partials are visible: sum them in block order
                kbs = tl.arange(0, KB)
                ys = tl.load(ws_ptr + (bh * KB + kbs)[:, None] * DV_PAD + d[None, :], cache_modifier=".cg")
                y = tl.sum(ys, axis=0)
                if HAS_GATE:
                    y = _gated(y, gate_ptr + (bh // H) * gate_stride + h * DV + d, dm, out_ptr.dtype.element_ty)
                tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=dm)
                tl.store(count_ptr + bh, 0)  # ready for the next launch (the next layer's, or the next replay)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if triton else {}


def kernel_supports_decode(r: int, rope: int) -> bool:
    return triton is not None and r == triton.next_power_of_2(r) and r >= 16 and rope <= 128


def num_splits_for(batch: int, heads: int, capacity: int, block_h: int, block_n: int = BLOCK_N) -> int:
    """Split-K factor from static shapes only (CUDA-graph safe): fill ~TARGET_PROGRAMS programs,
    never more splits than block_n tiles of the page-table capacity."""
    programs = batch * triton.cdiv(heads, block_h)
    tiles = max(1, triton.cdiv(capacity, block_n))
    return int(max(1, min(tiles, triton.cdiv(TARGET_PROGRAMS, programs), 64)))


def check_launch_table(table) -> None:
    last = 0
    for row in table:
        if len(row) != 3 or not all(isinstance(v, int) for v in row):
            raise ValueError(f"mla decode launch table: rows are (largest batch, num_splits, merge_cols) ints, "
                             f"got {row!r}")
        largest, splits, cols = row
        if largest <= last or splits < 0 or cols < 0 or (cols and cols & (cols - 1)):
            raise ValueError(f"mla decode launch table: row {row!r} needs a largest batch above the previous row's, "
                             f"num_splits >= 0 and merge_cols 0 or a power of two")
        last = largest


def parse_launch_table(text: str) -> tuple:
    """'LARGEST:SPLITS:COLS/.../*:SPLITS:COLS' (P15's option as flags, config files and ladder variants spell it;
    '*' = any batch) -> LAUNCH_TABLE-style rows."""
    try:
        rows = tuple(tuple(ANY_BATCH if i == 0 and v == "*" else int(v) for i, v in enumerate(row.split(":")))
                     for row in text.replace(" ", "").split("/"))
    except ValueError:
        raise ValueError(f"mla decode launch table {text!r}: expected 'largest batch:num_splits:merge_cols/...'") \
            from None
    check_launch_table(rows)
    return rows


def format_launch_table(table) -> str:
    return "/".join(":".join("*" if i == 0 and v >= ANY_BATCH else str(v) for i, v in enumerate(row)) for row in table)


def launch_for(batch: int, r: int, table=LAUNCH_TABLE) -> tuple[int, int]:
    """(num_splits, merge_cols) for `batch` tokens: the first row of `table` whose largest batch covers it
    (merge_cols at most r)."""
    for largest, splits, cols in table:
        if batch <= largest:
            return int(splits), min(int(cols), r)
    raise ValueError(f"mla decode: no row of the launch table {table!r} covers batch {batch}")


def w_uv_prefetch_ok(w_uv: torch.Tensor, merge_cols: int) -> bool:
    """Whether every column-block merge program's W_UV block [dv rows x merge_cols] can be bulk-prefetched: base,
    head and row pitches and the block's width in 16-byte units (kernels/l2_prefetch.py)."""
    eb = w_uv.element_size()
    return (l2_prefetch.region_ok(w_uv, w_uv.stride(1) * eb, w_uv.stride(0) * eb)
            and (merge_cols * eb) % l2_prefetch.ALIGN == 0)


_ARRIVALS: dict = {}


def arrival_counts(device, n: int) -> torch.Tensor:
    """A zeroed int32 counter per (request, head) for the merge kernel's last-arrival sum, kept per device: every
    launch leaves it zero again, so the step's layers (run one after another on one stream) share it and a CUDA
    graph replays without a memset."""
    key = torch.device(device)
    have = _ARRIVALS.get(key)
    if have is None or have.numel() < n:
        have = _ARRIVALS[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=key)
    return have


def decode_triton(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, pdl: bool = False,
                  num_splits: int | None = None, block_h: int | None = None, block_n: int = BLOCK_N,
                  num_warps: int = 4, w_uv: torch.Tensor | None = None, block_dv: int = BLOCK_DV,
                  merge_cols: int | None = None, prefetch_w: bool = False,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the split and merge kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): o_lat [B, H, r];
    with `w_uv` [H, dv, r] (rows contiguous) the merge kernel also applies it: [B, H * dv] (`decode_out_reference`).
    num_splits (None: LAUNCH_TABLE's; 0: from the shapes) / block_h / block_n / num_warps override the defaults
    (tools/bench_mla9.py sweeps them);
    merge_cols: latent columns per merge program (a power of two <= r; None: LAUNCH_TABLE's choice), or 0 for
    the whole-row merge kernels (one program per (request, head) [x block_dv rows of W_UV]: the baseline).
    prefetch_w: the column-block merge + W_UV kernel asks L2 for its W_UV block before gdc_wait (`w_uv_prefetch_ok`:
    only with PDL and 16-byte aligned blocks; otherwise ignored). Same values either way.
    gate [B, H * dv] (with `w_uv` only; rows may be strided): the merge kernel also applies MLA's output gate,
    out * sigmoid(gate), rounded as the unfused ops round it (`decode_out_reference`'s gate)."""
    check_decode_args(q_nope, q_rope, kv_pool, layer, page_table, seq_lens)
    if triton is None:
        raise RuntimeError("mla_decode_fused: triton is not installed")
    B, H, R = q_nope.shape
    rope = q_rope.shape[-1]
    if not kernel_supports_decode(R, rope):
        raise ValueError(f"mla_decode_fused kernel: needs a power-of-two latent width >= 16, got {R}")
    if w_uv is not None:
        check_w_uv(w_uv, H, R)
    elif gate is not None:
        raise ValueError("mla_decode_fused: the output gate needs w_uv (it gates the [B, H * dv] output)")
    if q_nope.stride(-1) != 1:
        q_nope = q_nope.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    if q_rope.dtype != q_nope.dtype:
        q_rope = q_rope.to(q_nope.dtype)
    if kv_pool.stride(-1) != 1:
        raise ValueError("mla_decode_fused: the pool's rows must be contiguous")
    page = kv_pool.shape[2]
    if w_uv is None:
        out = torch.empty(B, H, R, dtype=q_nope.dtype, device=q_nope.device)
    else:
        out = torch.empty(B, H * w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
    if gate is not None:
        check_gate(gate, out)
        if gate.stride(-1) != 1:
            gate = gate.contiguous()
    gate_args = {"gate_ptr": gate, "gate_stride": gate.stride(0), "HAS_GATE": True} if gate is not None else {}
    if B == 0:
        return out
    if block_h is None:  # 16 heads x 512 latent fp32 accumulator = 64 registers a thread at 4 warps
        block_h = max(16, min(16 if R > 256 else 32, triton.next_power_of_2(H)))
    if num_splits is None:
        num_splits = launch_for(B, R)[0]
    splits = num_splits or num_splits_for(B, H, page_table.shape[1] * page, block_h, block_n)
    part = torch.empty(B, H, splits, R, dtype=torch.float32, device=q_nope.device)
    lse = torch.empty(B, H, splits, dtype=torch.float32, device=q_nope.device)
    layer_view = kv_pool[:, layer]  # [P, page, W]: base pointer of this layer, strides of the pool
    pdl = pdl_for(pdl, q_nope)
    extra = {"launch_pdl": True} if pdl else {}
    _decode_split_kernel[(B, triton.cdiv(H, block_h), splits)](
        q_nope, q_nope.stride(0), q_nope.stride(1), q_rope, q_rope.stride(0), q_rope.stride(1),
        layer_view, layer_view.stride(0), layer_view.stride(1), page_table, page_table.stride(0), seq_lens,
        part, lse, H, float(scale),
        R=R, ROPE=rope, PAGE=page, NUM_SPLITS=splits, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)), USE_PDL=pdl,
        DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=2,
        **extra)
    pad = max(2, triton.next_power_of_2(splits))
    if merge_cols is None:
        merge_cols = launch_for(B, R)[1]
    if merge_cols:
        if merge_cols != triton.next_power_of_2(merge_cols) or not 1 <= merge_cols <= R:
            raise ValueError(f"mla_decode_fused: merge_cols must be a power of two <= r = {R}, got {merge_cols}")
        if w_uv is None:
            _decode_merge_cols_kernel[(B * H, R // merge_cols)](
                part, lse, seq_lens, out, H, R=R, NUM_SPLITS=splits, SPLITS_PAD=pad, BLOCK_N=block_n,
                MERGE_COLS=merge_cols, USE_PDL=pdl, num_warps=4, **extra)
            return out
        dv = w_uv.shape[1]
        dv_pad = triton.next_power_of_2(dv)
        blocks = R // merge_cols
        ws = torch.empty(B * H * blocks * dv_pad if blocks > 1 else 1, dtype=torch.float32, device=q_nope.device)
        counts = arrival_counts(q_nope.device, B * H)
        merge_warps = 4 if dv_pad * merge_cols <= 8192 else 8
        _decode_merge_out_cols_kernel[(B * H, blocks)](
            part, lse, seq_lens, w_uv, w_uv.stride(0), w_uv.stride(1), ws, counts, out, H, R=R, DV=dv, DV_PAD=dv_pad,
            MERGE_COLS=merge_cols, NUM_SPLITS=splits, SPLITS_PAD=pad, BLOCK_N=block_n,
            LAT_DTYPE=_TL_DTYPES[q_nope.dtype], USE_PDL=pdl,
            PREFETCH_W=bool(prefetch_w) and pdl and w_uv_prefetch_ok(w_uv, merge_cols), W_BYTES=w_uv.element_size(),
            PIECES=32 * merge_warps, num_warps=merge_warps, **gate_args, **extra)
        return out
    if w_uv is None:
        _decode_merge_kernel[(B * H,)](part, lse, seq_lens, out, H, R=R, NUM_SPLITS=splits, SPLITS_PAD=pad,
                                       BLOCK_N=block_n, USE_PDL=pdl, num_warps=4, **extra)
    else:
        dv = w_uv.shape[1]
        block_dv = min(block_dv, triton.next_power_of_2(dv))
        _decode_merge_out_kernel[(B * H, triton.cdiv(dv, block_dv))](
            part, lse, seq_lens, w_uv, w_uv.stride(0), w_uv.stride(1), out, H, R=R, DV=dv, BLOCK_DV=block_dv,
            NUM_SPLITS=splits, SPLITS_PAD=pad, BLOCK_N=block_n, LAT_DTYPE=_TL_DTYPES[q_nope.dtype], USE_PDL=pdl,
            num_warps=8, **gate_args, **extra)
    return out


def prologue_triton(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_a=None, q_norm_weight=None,
                    q_eps=0.0, pdl: bool = False) -> torch.Tensor:
    check_prologue_args(ckv, kv_norm_weight, kv_pool, layer, out_cache_loc, q_a, q_norm_weight)
    if triton is None:
        raise RuntimeError("mla_decode_prologue: triton is not installed")
    n, width = ckv.shape
    r = kv_norm_weight.shape[0]
    if ckv.stride(-1) != 1:
        ckv = ckv.contiguous()
    if kv_pool.stride(-1) != 1:
        raise ValueError("mla_decode_prologue: the pool's rows must be contiguous")
    has_q = q_a is not None
    if has_q:
        if q_a.stride(-1) != 1:
            q_a = q_a.contiguous()
        q_out = torch.empty(q_a.shape, dtype=torch.promote_types(q_norm_weight.dtype, q_a.dtype), device=q_a.device)
    else:
        q_out = ckv.new_empty(0)
    if n == 0:
        return q_out
    layer_view = kv_pool[:, layer]
    q_dim = q_a.shape[1] if has_q else 1
    pdl = pdl_for(pdl, ckv)
    extra = {"launch_pdl": True} if pdl else {}
    _prologue_kernel[(n,)](
        ckv, ckv.stride(0), kv_norm_weight, float(kv_eps), layer_view, layer_view.stride(0), layer_view.stride(1),
        out_cache_loc,
        q_a if has_q else ckv, q_a.stride(0) if has_q else 0, q_norm_weight if has_q else kv_norm_weight,
        float(q_eps), q_out if has_q else ckv,
        R=r, ROPE=width - r, PAGE=kv_pool.shape[2], Q_DIM=q_dim,
        ROW_DTYPE=_TL_DTYPES[torch.promote_types(kv_norm_weight.dtype, ckv.dtype)], BLOCK_R=triton.next_power_of_2(r),
        BLOCK_ROPE=triton.next_power_of_2(width - r), BLOCK_Q=triton.next_power_of_2(q_dim), HAS_Q=has_q,
        USE_PDL=pdl, num_warps=4, **extra)
    return q_out


# --------------------------------------------------------------------------- the k3 ops

@torch.library.custom_op("k3::mla_decode_prologue", mutates_args=("kv_pool",))
def mla_decode_prologue(ckv: torch.Tensor, kv_norm_weight: torch.Tensor, kv_eps: float, kv_pool: torch.Tensor,
                        layer: int, out_cache_loc: torch.Tensor, q_a: torch.Tensor | None,
                        q_norm_weight: torch.Tensor | None, q_eps: float, pdl: bool = False) -> torch.Tensor:
    """kv norm + KV page write (+ q_a norm); see module doc."""
    return prologue_reference(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_a, q_norm_weight, q_eps)


@mla_decode_prologue.register_kernel("cuda")
def _prologue_cuda(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_a, q_norm_weight, q_eps,
                   pdl=False):
    if triton is not None:
        with torch.cuda.device(ckv.device):
            return prologue_triton(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_a, q_norm_weight,
                                   q_eps, pdl)
    return prologue_reference(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_a, q_norm_weight, q_eps)


@mla_decode_prologue.register_fake
def _prologue_fake(ckv, kv_norm_weight, kv_eps, kv_pool, layer, out_cache_loc, q_a, q_norm_weight, q_eps,
                   pdl=False):
    if q_a is None:
        return ckv.new_empty(0)
    return q_a.new_empty(q_a.shape, dtype=torch.promote_types(q_norm_weight.dtype, q_a.dtype))


@torch.library.custom_op("k3::mla_decode_fused", mutates_args=())
def mla_decode_fused(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                     page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, pdl: bool,
                     launch_table: Optional[list[int]] = None) -> torch.Tensor:
    """Absorbed paged latent decode attention, [B, H, r] + [B, H, rope] -> [B, H, r]; see module doc.
    launch_table: P15's launch choice per batch, LAUNCH_TABLE's rows flattened (None: LAUNCH_TABLE); the token
    count is symbolic in a decode graph, so the row is picked here, once per captured shape. No value changes
    beyond fp32 summation order."""
    return decode_reference(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale)


def flat_launch_table(table) -> list[int]:
    """LAUNCH_TABLE-style rows as the ops' launch_table argument (an int list in the graph)."""
    check_launch_table(table)
    return [int(v) for row in table for v in row]


def _launch_choice(launch_table, batch: int, r: int) -> dict:
    """The op's recorded table as decode_triton arguments for this batch (LAUNCH_TABLE's when none is recorded)."""
    rows = LAUNCH_TABLE if launch_table is None else tuple(tuple(launch_table[i:i + 3])
                                                           for i in range(0, len(launch_table), 3))
    num_splits, merge_cols = launch_for(batch, r, rows)
    return {"num_splits": num_splits, "merge_cols": merge_cols}


@mla_decode_fused.register_kernel("cuda")
def _decode_cuda(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, pdl, launch_table=None):
    if kernel_supports_decode(q_nope.shape[-1], q_rope.shape[-1]):
        use_pdl = pdl_for(pdl, q_nope)
        with torch.cuda.device(q_nope.device):
            return decode_triton(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, use_pdl,
                                 **_launch_choice(launch_table, q_nope.shape[0], q_nope.shape[-1]))
    return decode_reference(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale)


@mla_decode_fused.register_fake
def _decode_fake(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, pdl, launch_table=None):
    return q_nope.new_empty(q_nope.shape)


@torch.library.custom_op("k3::mla_decode_fused_out", mutates_args=())
def mla_decode_fused_out(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, kv_b_weight: torch.Tensor,
                         nope: int, pdl: bool, launch_table: Optional[list[int]] = None,
                         prefetch_w: bool = False, gate: Optional[torch.Tensor] = None,
                         w_uv_max_tokens: int = OUT_MAX_TOKENS) -> torch.Tensor:
    """mla_decode_fused, then W_UV (the v rows of kv_b_proj's weight, per head) and the flatten: [B, H * dv].
    prefetch_w: the merge kernel L2-prefetches its W_UV block before gdc_wait (P15's prefetch_w_uv; same values).
    gate [B, H * dv]: MLA's output gate applied too, `out * sigmoid(gate)` (P15's gate_out).
    w_uv_max_tokens: up to this many tokens the merge kernel applies W_UV (and the gate), above it cuBLAS after
    the plain merge (P15's option; OUT_MAX_TOKENS where not recorded)."""
    check_w_uv_max_tokens(w_uv_max_tokens)
    return decode_out_reference(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale,
                                w_uv_of(kv_b_weight, q_nope.shape[1], nope), gate)


def check_w_uv_max_tokens(w_uv_max_tokens: int) -> None:
    if w_uv_max_tokens < 0:
        raise ValueError(f"mla_decode_fused_out: w_uv_max_tokens must be >= 0, got {w_uv_max_tokens}")


def decode_out_run(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, w_uv, pdl, launch_table=None,
                   prefetch_w=False, gate=None, w_uv_max_tokens=OUT_MAX_TOKENS):
    """What k3.mla_decode_fused_out launches (CUDA, or CPU tensors under TRITON_INTERPRET=1): up to w_uv_max_tokens
    tokens the split kernel + the merge kernel applying W_UV (and the gate); above, the plain merge, then cuBLAS's
    batched GEMM, the flatten's copy (and the gate's two kernels). The token count is a static shape: a captured graph
    always takes the same branch."""
    choice = _launch_choice(launch_table, q_nope.shape[0], q_nope.shape[-1])
    if q_nope.shape[0] <= w_uv_max_tokens:
        return decode_triton(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, pdl, w_uv=w_uv,
                             prefetch_w=prefetch_w, gate=gate, **choice)
    o_lat = decode_triton(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, pdl, **choice)
    o = torch.einsum("bhr,hdr->bhd", o_lat, w_uv).flatten(-2)
    return o if gate is None else o * torch.sigmoid(check_gate(gate, o))


@mla_decode_fused_out.register_kernel("cuda")
def _decode_out_cuda(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, kv_b_weight, nope, pdl,
                     launch_table=None, prefetch_w=False, gate=None, w_uv_max_tokens=OUT_MAX_TOKENS):
    check_w_uv_max_tokens(w_uv_max_tokens)
    w_uv = w_uv_of(kv_b_weight, q_nope.shape[1], nope)
    if not kernel_supports_decode(q_nope.shape[-1], q_rope.shape[-1]):
        return decode_out_reference(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, w_uv, gate)
    with torch.cuda.device(q_nope.device):
        return decode_out_run(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, w_uv,
                              pdl_for(pdl, q_nope), launch_table, prefetch_w, gate, w_uv_max_tokens)


@mla_decode_fused_out.register_fake
def _decode_out_fake(q_nope, q_rope, kv_pool, layer, page_table, seq_lens, scale, kv_b_weight, nope, pdl,
                     launch_table=None, prefetch_w=False, gate=None, w_uv_max_tokens=OUT_MAX_TOKENS):
    check_w_uv_max_tokens(w_uv_max_tokens)
    heads = q_nope.shape[1]
    return q_nope.new_empty(q_nope.shape[0], heads * (kv_b_weight.shape[0] // heads - nope))
