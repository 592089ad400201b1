"""The fused MoE decode kernels as they were before issue 9's rework (commit d232049), frozen for
tools/bench_moe_kernels.py so one GPU call times old and new kernels side by side. Not used by the
compiler; kept as the "before" arm of the bench."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3compile.passes.kernels.moe_decode import ACTS, check_args

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
    def _e2m1(code):
        # 4-bit code (int32) -> fp32 by building the float's bits (integer ops only): bit 3 sign, bits
        # 2..1 exponent e (bias 1), bit 0 mantissa m. e >= 1: 2^(e-1) (1 + m/2) = fp32 exponent e + 126,
        # mantissa m << 22; code 1 (subnormal 0.5) = fp32 exponent 126; code 0 = 0
        mag = code & 7
        bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 126 << 23, 0))
        return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _row_block_dot(w_ptr, s_ptr, rows, row_mask, v_ptr, K, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        """Σ_k W[row, k] v[k] for a block of rows (fp32). W dense [*, K] at w_ptr, or MXFP4: codes
        [*, K/2] at w_ptr and E8M0 scales [*, K/32] at s_ptr. v: K contiguous values."""
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if MXFP4:
            j = tl.arange(0, BLOCK_K // 2)
            grp = tl.arange(0, BLOCK_K // 32)
            for k0 in range(0, K, BLOCK_K):
                b = k0 // 2 + j
                bmask = b < K // 2
                byte = tl.load(w_ptr + rows[:, None] * (K // 2) + b[None, :], mask=row_mask[:, None] & bmask[None, :],
                               other=0).to(tl.int32)
                v_even = tl.load(v_ptr + 2 * b, mask=bmask, other=0.0).to(tl.float32)
                v_odd = tl.load(v_ptr + 2 * b + 1, mask=bmask, other=0.0).to(tl.float32)
                part = _e2m1(byte & 15) * v_even[None, :] + _e2m1(byte >> 4) * v_odd[None, :]
                # one scale per 16 bytes (32 inputs): sum each group first, scale once per group
                part = tl.sum(tl.reshape(part, [BLOCK_N, BLOCK_K // 32, 16]), axis=2)
                g = k0 // 32 + grp
                sc = tl.load(s_ptr + rows[:, None] * (K // 32) + g[None, :],
                             mask=row_mask[:, None] & (g[None, :] < K // 32), other=127)
                acc += tl.sum(part * tl.exp2(sc.to(tl.float32) - 127.0), axis=1)
        else:
            kk = tl.arange(0, BLOCK_K)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + kk
                kmask = k < K
                w = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=row_mask[:, None] & kmask[None, :],
                            other=0.0).to(tl.float32)
                v = tl.load(v_ptr + k, mask=kmask, other=0.0).to(tl.float32)
                acc += tl.sum(w * v[None, :], axis=1)
        return acc

    @triton.jit
    def _shared_block(in_row, up_row, w_ptr, cols, cmask, IS, beta, linear_beta, ACT: tl.constexpr,
                      GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The shared expert's down-projection for a block of output columns: W[cols] · act(in, up)
        (GLU) or W[cols] · in (already activated)."""
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        kk = tl.arange(0, BLOCK_K)
        for k0 in range(0, IS, BLOCK_K):
            k = k0 + kk
            kmask = k < IS
            a = tl.load(in_row + k, mask=kmask, other=0.0).to(tl.float32)
            if GLU:
                up = tl.load(up_row + k, mask=kmask, other=0.0).to(tl.float32)
                a = _glu(a, up, beta, linear_beta, ACT)
            w = tl.load(w_ptr + cols[:, None] * IS + k[None, :], mask=cmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
        return acc

    @triton.jit
    def _expert_up_kernel(x_ptr, ids_ptr, w13_ptr, s13_ptr, h_ptr, x_row_stride, D, I, beta, linear_beta,
                          TOP_K: tl.constexpr, ACT: tl.constexpr, MXFP4: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)  # token * TOP_K + slot
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < I
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        token = pair // TOP_K
        if MXFP4:
            w_base = w13_ptr + expert * (2 * I) * (D // 2)
        else:
            w_base = w13_ptr + expert * (2 * I) * D
        s_base = s13_ptr + expert * (2 * I) * (D // 32)
        x_row = x_ptr + token * x_row_stride
        g = _row_block_dot(w_base, s_base, cols, cmask, x_row, D, MXFP4, BLOCK_N, BLOCK_K)
        u = _row_block_dot(w_base, s_base, cols + I, cmask, x_row, D, MXFP4, BLOCK_N, BLOCK_K)
        tl.store(h_ptr + pair * I + cols, _glu(g, u, beta, linear_beta, ACT), mask=cmask)

    @triton.jit
    def _expert_down_kernel(h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr,
                            I, DO, IS, sin_row_stride, sup_row_stride, out_row_stride, beta, linear_beta,
                            TOP_K: tl.constexpr, ACT: tl.constexpr, MXFP4: tl.constexpr,
                            SHARED: tl.constexpr, SHARED_GLU: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < DO
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(TOP_K):
            pair = token * TOP_K + j
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            weight = tl.load(wts_ptr + pair).to(tl.float32)
            if MXFP4:
                w_base = w2_ptr + expert * DO * (I // 2)
            else:
                w_base = w2_ptr + expert * DO * I
            part = _row_block_dot(w_base, s2_ptr + expert * DO * (I // 32), cols, cmask, h_ptr + pair * I, I,
                                  MXFP4, BLOCK_N, BLOCK_K)
            acc += weight * part
        if SHARED:
            acc += _shared_block(sin_ptr + token * sin_row_stride, sup_ptr + token * sup_row_stride, sw2_ptr, cols,
                                 cmask, IS, beta, linear_beta, ACT, SHARED_GLU, BLOCK_N, BLOCK_K)
        tl.store(out_ptr + token * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _latent_out_kernel(u_ptr, nw_ptr, upw_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr, L, DOUT, IS,
                           sin_row_stride, sup_row_stride, out_row_stride, eps, beta, linear_beta,
                           ACT: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, SHARED_GLU: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < DOUT
        kk = tl.arange(0, BLOCK_K)
        u_row = u_ptr + token * L
        rstd = 1.0
        if NORM:  # every program recomputes the row's statistics: u is one short fp32 row
            sq = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, L, BLOCK_K):
                v = tl.load(u_row + k0 + kk, mask=k0 + kk < L, other=0.0)
                sq += v * v
            rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / L + eps)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            k = k0 + kk
            kmask = k < L
            v = tl.load(u_row + k, mask=kmask, other=0.0) * rstd
            if NORM:
                v = v * tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(upw_ptr + cols[:, None] * L + k[None, :], mask=cmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * v[None, :], axis=1)
        if SHARED:
            acc += _shared_block(sin_ptr + token * sin_row_stride, sup_ptr + token * sup_row_stride, sw2_ptr, cols,
                                 cmask, IS, beta, linear_beta, ACT, SHARED_GLU, BLOCK_N, BLOCK_K)
        tl.store(out_ptr + token * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def _block_n(rows: int, programs_per_row: int, target: int = 264) -> int:
    """Columns per program: the widest power of two in 8..64 that still gives >= `target` programs
    (2 per SM on an H200), so batch 1 fills the GPU."""
    for bn in (64, 32, 16):
        if programs_per_row * triton.cdiv(rows, bn) >= target:
            return bn
    return 8


def fused_moe_triton(x, topk_ids, topk_weights, w13, w2, w13_scale=None, w2_scale=None, shared_in=None,
                     shared_up=None, shared_w2=None, act="silu", beta=4.0, linear_beta=25.0, latent_up_w=None,
                     latent_norm_w=None, latent_eps=1e-5, block_k: int | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """Launch kernels A, B (and C) (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). block_n
    (columns per program, a power of two) defaults to a choice that fills an H200 at batch 1."""
    if triton is None:
        raise RuntimeError("fused_moe_decode: triton is not installed")
    num_experts, inter, width, out_width = check_args(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                                                      shared_in, shared_up, shared_w2, act, latent_up_w,
                                                      latent_norm_w)
    n, k = topk_ids.shape
    quantized = w13_scale is not None
    if block_k is None:
        # H200 tile sweep at the 48B shape (bf16): 256 fastest at batch 1 (52 vs 73 us per layer with 128),
        # 128 at batch 8; MXFP4 rows are half as many bytes per input, so twice the inputs per load
        block_k = (256 if n * k <= 16 else 128) * (2 if quantized else 1)
    if block_k < 32 or block_k & (block_k - 1):
        raise ValueError(f"fused_moe_decode: block_k must be a power of two >= 32, got {block_k}")
    if block_n is not None and (block_n < 1 or block_n & (block_n - 1)):
        raise ValueError(f"fused_moe_decode: block_n must be a power of two, got {block_n}")
    out = torch.empty(n, out_width, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    ids, wts = topk_ids.contiguous(), topk_weights.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    s13 = w13_scale.contiguous() if quantized else w13  # unused pointer when dense
    s2 = w2_scale.contiguous() if quantized else w2
    h = torch.empty(n * k, inter, dtype=torch.float32, device=x.device)
    act_id = ACTS[act]
    bn = block_n or _block_n(inter, n * k)
    _expert_up_kernel[(n * k, triton.cdiv(inter, bn))](
        x, ids, w13, s13, h, x.stride(0), width, inter, float(beta), float(linear_beta),
        TOP_K=k, ACT=act_id, MXFP4=quantized, BLOCK_N=bn, BLOCK_K=block_k, num_warps=4)
    shared = shared_w2 is not None
    sin = shared_in if shared else h
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    sup = shared_up if shared_up is not None else sin
    sup = sup if sup.stride(-1) == 1 else sup.contiguous()
    sw2 = shared_w2.contiguous() if shared else h
    latent = latent_up_w is not None
    routed_width = w2.shape[1]
    # latent: B leaves u in fp32 for C; the shared expert joins in C, on the output side of the up-projection
    u = torch.empty(n, routed_width, dtype=torch.float32, device=x.device) if latent else out
    bn = block_n or _block_n(routed_width, n)
    _expert_down_kernel[(n, triton.cdiv(routed_width, bn))](
        h, ids, wts, w2, s2, sin, sup, sw2, u, inter, routed_width, sw2.shape[-1] if shared else 0,
        sin.stride(0), sup.stride(0), u.stride(0), float(beta), float(linear_beta),
        TOP_K=k, ACT=act_id, MXFP4=quantized, SHARED=shared and not latent, SHARED_GLU=shared_up is not None,
        BLOCK_N=bn, BLOCK_K=block_k, num_warps=4)
    if latent:
        upw = latent_up_w.contiguous()
        nw = latent_norm_w.contiguous() if latent_norm_w is not None else upw
        bn = block_n or _block_n(out_width, n)
        _latent_out_kernel[(n, triton.cdiv(out_width, bn))](
            u, nw, upw, sin, sup, sw2, out, routed_width, out_width, sw2.shape[-1] if shared else 0,
            sin.stride(0), sup.stride(0), out.stride(0), float(latent_eps), float(beta), float(linear_beta),
            ACT=act_id, NORM=latent_norm_w is not None, SHARED=shared, SHARED_GLU=shared_up is not None,
            BLOCK_N=bn, BLOCK_K=block_k, num_warps=4)
    return out
