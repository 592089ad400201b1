"""ReplaySSM window inputs on the GPU with the fused decode kernel's arithmetic (issue 13, item 4).

For a verify step, KDA stores each draft position's raw recurrence inputs (k after the conv and
before the L2 norm, v, the log-decay g after the gate activation, beta after the sigmoid) and the
fold (runtime/spec/fold_kernel.py) later replays the accepted prefix. For that state to be
bit-identical to what P5's fused decode kernel (kda_decode.py) writes, the stored inputs must be the
values P5 computes in its registers -- Triton's sigmoid/exp differ from torch's in the last bits. This
kernel computes them with P5's own code: its `_short_conv_step` jit helper (on a scratch copy of the
committed conv windows, so the pool is not written) and P5's gate and beta expressions, in P5's
column blocks for a decode step of the same batch (`decode_batch`) under the same launch layout
(`launch`, model_def/ops/kda_launch.py).

One program per (request, head); positions in order. Inputs are P5's (the op's inputs after the
projections, one [B, L, ...] block per request), with f already up-projected (no low-rank absorb).

`torch.ops.k3.kda_verify_inputs(...)` is the graph node pass P16 (p16_kda_verify_inputs.py) puts after
each KDA layer's `k3::kda_verify` in verify graphs: it rewrites that layer's window rows. CPU (and any
shape the kernel does not take) runs the reference: the arithmetic `k3::short_conv_verify`,
`kda_gate`, the sigmoid and `k3::kda_verify` use, so a CPU engine's window is unchanged by the pass
(bit for bit). CUDA runs the Triton kernel with `decode_batch` = the verify step's rows
(`slots.shape[0]`): the executor pads a verify batch of b requests to next_bucket(b) of the decode
buckets (the engine sizes the draft window to the bucket of max_running, so every decode bucket is a
verify bucket), which is the bucket the decode step it replaces pads to, and the number
spec_decode.py hands the fold as its `decode_batch`; batches above every bucket run unpadded in both.
"""
from __future__ import annotations

import torch

from torch.library import custom_op

from k3compile.model_def.ops import library as k3ops  # noqa: F401  (registers the unfused k3 ops)
from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, block_v_for, check_layout, v_split_for, warps_for
from k3compile.model_def.ops.kda_math import kda_gate
from k3compile.model_def.ops.verify import conv_from_window, store_window_inputs

from .kda_decode import kernel_supports, triton

if triton is not None:
    import triton.language as tl

    from .kda_decode import _short_conv_read, _short_conv_write

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
                             decode_batch: int | None = None, layout: str = DEFAULT_LAYOUT) -> None:
    """x_k, x_v, f [B, L, H*K]; beta_logits [B, L, H]; writes win_* [B, n_kda, L, H, ...] at `layer` (rows 0..B-1).
    The pool's committed conv windows are read (a scratch copy advances), never written. The column blocks
    and warps are those P5's launch `layout` uses for a decode step of `decode_batch` (default B) requests."""
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
    bv = block_v_for(layout, v_split_for(layout, decode_batch or b, h, kd), kd)
    _verify_inputs_kernel[(b * h,)](
        x_k, x_v, k_conv_weight.contiguous(), v_conv_weight.contiguous(), f, dt_bias.contiguous(), a_log.contiguous(),
        beta_logits, scratch, scratch.stride(0),
        wk, wv, wg, wb, wk.stride(0), wk.stride(1), wb.stride(0), wb.stride(1),
        float(lower_bound) if lower_bound is not None else 0.0, length,
        H=h, K=kd, V=kd, WIDTH=width, WPAD=triton.next_power_of_2(max(width - 1, 1)), BK=bk, BV=bv,
        SOFTPLUS_GATE=lower_bound is None, num_warps=warps_for(layout, kd, bv),
        enable_fp_fusion=False)  # as P5 (kda_decode.NO_FMA_WHY)


# --------------------------------------------------------------------------- the k3 op

def kda_verify_inputs_reference(x_k, x_v, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits, conv_pool,
                                layer, slots, win_k, win_v, win_g, win_beta, lower_bound) -> None:
    """What the unfused verify graph writes into the window (KDAMixer.forward in verify mode)."""
    h = a_log.shape[0]
    c = x_k.shape[1]
    k = conv_from_window(x_k, k_conv_weight, conv_pool, layer, c, slots).unflatten(-1, (h, -1))
    v = conv_from_window(x_v, v_conv_weight, conv_pool, layer, 2 * c, slots).unflatten(-1, (h, -1))
    if dt_bias is None:  # f holds f + dt_bias already (P11's addmm); adding zeros changes no value
        dt_bias = torch.zeros(c, dtype=torch.float32, device=f.device)
    g = kda_gate(f, a_log, dt_bias, c // h, lower_bound)
    beta = torch.sigmoid(beta_logits.float())
    store_window_inputs(k, v, g, beta, layer, slots, win_k, win_v, win_g, win_beta)


def _check(x_k, x_v, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits, conv_pool, layer, slots,
           win_k, win_v, win_g, win_beta):
    h = a_log.shape[0]
    n_tok, c = x_k.shape[0], x_k.shape[-1]
    b = slots.shape[0]
    problems = []
    if x_k.dim() != 2 or x_v.shape != x_k.shape or f.shape != x_k.shape:
        problems.append(f"x_k, x_v, f must be [B*n, H*K] alike, got {tuple(x_k.shape)}, {tuple(x_v.shape)}, "
                        f"{tuple(f.shape)}")
    bad_dt = dt_bias is not None and tuple(dt_bias.shape) != (c,)
    if h == 0 or c % h or tuple(beta_logits.shape) != (n_tok, h) or bad_dt:
        problems.append(f"H = {h} heads (a_log) do not fit x_k [{n_tok}, {c}], beta_logits {tuple(beta_logits.shape)}, "
                        f"dt_bias {None if dt_bias is None else tuple(dt_bias.shape)}")
    if k_conv_weight.shape != v_conv_weight.shape or tuple(k_conv_weight.shape[:1]) != (c,):
        problems.append(f"conv weights must be [{c}, W], got {tuple(k_conv_weight.shape)}, {tuple(v_conv_weight.shape)}")
    if b == 0 or n_tok % b:
        problems.append(f"{n_tok} tokens do not split into {b} requests of the same length")
    elif n_tok // b > win_k.shape[2] or b > win_k.shape[0] or layer >= win_k.shape[1]:
        problems.append(f"window {tuple(win_k.shape)} has no room for {b} requests x {n_tok // b} positions "
                        f"at layer {layer}")
    if conv_pool.shape[2] < 3 * c:
        problems.append(f"conv pool has {conv_pool.shape[2]} channels, the k and v streams need {3 * c}")
    if problems:
        raise ValueError("kda_verify_inputs: " + "; ".join(problems))


@custom_op("k3::kda_verify_inputs", mutates_args=("win_k", "win_v", "win_g", "win_beta"))
def kda_verify_inputs(x_k: torch.Tensor, x_v: torch.Tensor, k_conv_weight: torch.Tensor, v_conv_weight: torch.Tensor,
                      f: torch.Tensor, dt_bias: torch.Tensor | None, a_log: torch.Tensor, beta_logits: torch.Tensor,
                      conv_pool: torch.Tensor, layer: int, slots: torch.Tensor, win_k: torch.Tensor,
                      win_v: torch.Tensor, win_g: torch.Tensor, win_beta: torch.Tensor,
                      lower_bound: float | None, launch: str = DEFAULT_LAYOUT) -> None:
    """A KDA layer's ReplaySSM window rows from its pre-conv inputs x_k, x_v [B*n, H*K], the up-projected
    forget input f [B*n, H*K] (dt_bias None: f already includes it) and the beta logits [B*n, H]. launch: P5's
    launch layout (model_def/ops/kda_launch.py), whose blocks the kernel uses. See module doc."""
    check_layout(launch)
    _check(x_k, x_v, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits, conv_pool, layer, slots,
           win_k, win_v, win_g, win_beta)
    kda_verify_inputs_reference(x_k, x_v, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits, conv_pool,
                                layer, slots, win_k, win_v, win_g, win_beta, lower_bound)


def _kernel_takes(x_k, a_log, win_k, win_v, win_g, win_beta) -> bool:
    h = a_log.shape[0]
    kd = x_k.shape[-1] // h
    return (kernel_supports(kd, kd) and win_k.stride() == win_v.stride() == win_g.stride()
            and win_k.stride(-1) == 1 and win_k.stride(-2) == kd and win_beta.stride(-1) == 1)


@kda_verify_inputs.register_kernel("cuda")
def _kda_verify_inputs_cuda(x_k, x_v, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits, conv_pool,
                            layer, slots, win_k, win_v, win_g, win_beta, lower_bound, launch=DEFAULT_LAYOUT):
    _check(x_k, x_v, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits, conv_pool, layer, slots,
           win_k, win_v, win_g, win_beta)
    if not _kernel_takes(x_k, a_log, win_k, win_v, win_g, win_beta):
        return kda_verify_inputs_reference(x_k, x_v, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits,
                                           conv_pool, layer, slots, win_k, win_v, win_g, win_beta, lower_bound)
    b = slots.shape[0]
    if dt_bias is None:  # f + 0.0 in the kernel: the value f holds (as the reference)
        dt_bias = torch.zeros(x_k.shape[-1], dtype=torch.float32, device=x_k.device)
    per_request = lambda t: t.unflatten(0, (b, -1))  # noqa: E731  [B*n, ...] -> [B, n, ...]
    with torch.cuda.device(x_k.device):  # Triton launches on the current device
        kda_verify_inputs_triton(per_request(x_k), per_request(x_v), k_conv_weight, v_conv_weight, per_request(f),
                                 dt_bias, a_log, per_request(beta_logits), conv_pool, layer, slots, win_k, win_v,
                                 win_g, win_beta, lower_bound, decode_batch=b, layout=launch)


@kda_verify_inputs.register_fake
def _kda_verify_inputs_fake(x_k, x_v, k_conv_weight, v_conv_weight, f, dt_bias, a_log, beta_logits, conv_pool,
                            layer, slots, win_k, win_v, win_g, win_beta, lower_bound, launch=DEFAULT_LAYOUT):
    check_layout(launch)
    return None  # (no shape checks here: the sizes are symbolic while a pass builds the graph)
