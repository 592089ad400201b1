"""ReplaySSM window inputs on the GPU with the fused decode kernel's arithmetic (issue 13, item 4).

For a verify step, KDA stores each draft position's raw recurrence inputs (k after the conv and
before the L2 norm, v, the log-decay g after the gate activation, beta after the sigmoid) and the
fold (runtime/spec/fold_kernel.py) later replays the accepted prefix. For that state to be
bit-identical to what P5's fused decode kernel (kda_decode.py) writes, the stored inputs must be the
values P5 computes in its registers -- Triton's sigmoid/exp differ from torch's in the last bits. This
kernel computes them with P5's own code: its `_short_conv_step` jit helper (on a scratch copy of the
committed conv windows, so the pool is not written) and P5's gate and beta expressions, in P5's
column blocks for a decode step of the same batch (`decode_batch`).

One program per (request, head); positions in order. Inputs are P5's (the op's inputs after the
projections, one [B, L, ...] block per request), with f already up-projected (no low-rank absorb).
`kda_verify_inputs_triton` is what a verify-graph pass would put in front of the verify recurrence;
today the GPU bit-identity test (tests/runtime/spec/test_fold_gpu.py) uses it.
"""
from __future__ import annotations

import torch

from .kda_decode import triton

if triton is not None:
    import triton.language as tl

    from .kda_decode import V_BLOCK, _short_conv_read, _short_conv_write, default_v_split

    @triton.jit
    def _verify_inputs_kernel(xk_ptr, xv_ptr, wk_ptr, wv_ptr, f_ptr, dt_ptr, alog_ptr, b_ptr,
                              scratch_ptr, scratch_row,
                              wink_ptr, winv_ptr, wing_ptr, winb_ptr, w_row, w_pos, wb_row, wb_pos,
                              lower_bound, L,
                              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WIDTH: tl.constexpr,
                              WPAD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SOFTPLUS_GATE: tl.constexpr):
        pid = tl.program_id(0)
        req = (pid // H).to(tl.int64)
        head = pid % H
        C: tl.constexpr = H * K
        ok = tl.arange(0, BK)
        mk = ok < K
        ch = head * K + ok
        a = tl.exp(tl.load(alog_ptr + head).to(tl.float32))
        dt = tl.load(dt_ptr + ch, mask=mk, other=0.0).to(tl.float32)
        conv_base = scratch_ptr + req * scratch_row
        out_dtype = wink_ptr.dtype.element_ty
        for t in range(0, L):
            tok = req * L + t  # inputs are [B, L, ...] row-major: token rows of C (or H) values
            k_win = conv_base + C * (WIDTH - 1)
            k, k_hist, k_x = _short_conv_read(xk_ptr + tok * C, wk_ptr, k_win, ch, mk, WIDTH, WPAD)
            tl.debug_barrier()
            _short_conv_write(k_win, ch, mk, k_hist, k_x, WIDTH, WPAD)
            f_raw = tl.load(f_ptr + tok * C + ch, mask=mk, other=0.0).to(tl.float32)
            fx = f_raw + dt
            if SOFTPLUS_GATE:
                g = -a * tl.where(fx > 20.0, fx, tl.log(1.0 + tl.exp(tl.minimum(fx, 20.0))))
            else:
                g = lower_bound * tl.sigmoid(a * fx)
            beta = tl.sigmoid(tl.load(b_ptr + tok * H + head).to(tl.float32))
            base = req * w_row + t * w_pos + head * K
            tl.store(wink_ptr + base + ok, k.to(out_dtype), mask=mk)
            tl.store(wing_ptr + base + ok, g, mask=mk)
            tl.store(winb_ptr + req * wb_row + t * wb_pos + head, beta)
            for v0 in range(0, V, BV):
                ov = v0 + tl.arange(0, BV)
                mv = ov < V
                v_win = conv_base + 2 * C * (WIDTH - 1)
                v, v_hist, v_x = _short_conv_read(xv_ptr + tok * C, wv_ptr, v_win, head * V + ov, mv, WIDTH, WPAD)
                tl.debug_barrier()
                _short_conv_write(v_win, head * V + ov, mv, v_hist, v_x, WIDTH, WPAD)
                tl.store(winv_ptr + base + ov, v.to(out_dtype), mask=mv)


def kda_verify_inputs_triton(x_k, x_v, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits, conv_pool,
                             layer: int, slots, win_k, win_v, win_g, win_beta, lower_bound,
                             decode_batch: int | None = None) -> None:
    """x_k, x_v, f [B, L, H*K]; beta_logits [B, L, H]; writes win_* [B, n_kda, L, H, ...] at `layer` (rows 0..B-1).
    The pool's committed conv windows are read (a scratch copy advances), never written."""
    if triton is None:
        raise RuntimeError("kda_verify_inputs: triton is not installed")
    b, length, c = x_k.shape
    h = a_log.shape[0]
    kd = c // h
    width = k_conv_weight.shape[1]
    scratch = conv_pool[slots, layer].contiguous()  # [B, 3C, W-1]
    x_k, x_v, f, beta_logits = (t.contiguous() for t in (x_k, x_v, f, beta_logits))
    wk, wv, wg, wb = (t[:, layer] for t in (win_k, win_v, win_g, win_beta))
    bk = triton.next_power_of_2(kd)
    bv = min(triton.next_power_of_2(kd // default_v_split(decode_batch or b, h, kd)), V_BLOCK)
    _verify_inputs_kernel[(b * h,)](
        x_k, x_v, k_conv_weight.contiguous(), v_conv_weight.contiguous(), f, dt_bias.contiguous(), a_log.contiguous(),
        beta_logits, scratch, scratch.stride(0),
        wk, wv, wg, wb, wk.stride(0), wk.stride(1), wb.stride(0), wb.stride(1),
        float(lower_bound) if lower_bound is not None else 0.0, length,
        H=h, K=kd, V=kd, WIDTH=width, WPAD=triton.next_power_of_2(max(width - 1, 1)), BK=bk, BV=bv,
        SOFTPLUS_GATE=lower_bound is None, num_warps=4 if bk * bv >= 64 * 32 else 1,
        enable_fp_fusion=False)  # as P5 (kda_decode.NO_FMA_WHY)
