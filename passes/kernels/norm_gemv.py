"""P7's residual add + RMSNorm in the prologue of P8's GEMV: one launch where the graph had two (pass
p08_small_m_norm_gemv).

`torch.ops.k3.norm_gemv(x, delta, norm_weight, norm_eps, w, c, max_m, block_n, block_k, split_k, design,
use_pdl, num_warps, max_tokens) -> (y, p)` is exactly the composition the decode graph runs once P7 and P8 have
rewritten it (P7's plain pre-norm residual: no AttnRes bank):

    h, p = k3.attn_res_norm([], x, delta, None, norm_weight, res_eps, norm_eps, pdl)     p = x + delta (x: no delta)
    y    = k3.gemv(h, w, c, max_m, block_n, block_k, split_k, design, use_pdl, num_warps)

CPU (and CUDA whenever M > min(max_m, max_tokens) or the kernel does not take the shape) runs those two, so a
graph with the op computes bit for bit what the graph without it does there.

The kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1) is k3.gemv's, either design, with the same split-K,
last-arrival reduction (kernels/gemv.py `_finish`) and tuned configuration; only x changes: every program
  1. loads its first K step's weight tile (constants: with PDL this overlaps the previous kernel's tail),
  2. waits for the previous kernel (`gdc_wait`),
  3. recomputes each row's RMS from the un-normed input (p = x + delta rounded to x's dtype, summed over the
     whole row in fp32: one row of a few KB per token, L2-hot after the first program; every program runs the
     same code on the same bytes, so all get the same inverse RMS); the (column tile 0, split 0) program stores p,
  4. in each K step normalizes its own K slice of the rows as P7 rounds it, h = (norm_weight *
     (p * inv_rms).to(x.dtype)).to(w.dtype), and multiplies it into the weight tile as the GEMV does,
  5. releases its dependents (`gdc_launch_dependents`) once its inputs are read, and finishes as the GEMV does.
So y equals norm-then-GEMV up to the GEMV's own fp32 accumulation (the RMS's fp32 sum order may differ from P7's
kernel by an ulp of inv_rms, which moves a normed element by at most one 16-bit rounding). The rows design
normalizes the slice once as a [rows, BLOCK_K] tile and broadcasts it over the weight tile's rows (not the
GEMV's x pointer tile shaped like the products: that would repeat the norm's arithmetic BLOCK_N times).
"""
from __future__ import annotations

import torch

from . import attn_res_norm as arn
from . import gemv as gv
from .pdl import pdl_for

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through the references
    triton = None

ARRIVALS_OWNER = "norm_gemv"  # the split-K counters of this kernel (kernels/arrivals.py)
ROW_TILE = 4096  # elements of the [rows, BLOCK_R] tile the RMS prologue sums per step


def check_args(x, delta, norm_weight, w, c, max_m, block_n, block_k, split_k, design, num_warps,
               max_tokens: int = 0) -> None:
    """Raise ValueError naming the first thing wrong with a call (the norm's checks, then the GEMV's on h)."""
    arn.check_args([], x, delta, None, norm_weight)
    h_dtype = arn._out_dtype(x, norm_weight)
    if not x.dtype == h_dtype == w.dtype:
        raise ValueError(f"norm_gemv: x, the normed rows and w must share a dtype, got x {x.dtype}, normed rows "
                         f"{h_dtype} (norm_weight {norm_weight.dtype}), w {w.dtype}")
    gv.check_gemv_args(x, w, c, max_m, block_n, block_k, split_k, design, num_warps)
    if max_tokens < 0:
        raise ValueError(f"norm_gemv: max_tokens must be >= 0, got {max_tokens}")


def norm_gemv_reference(x, delta, norm_weight, norm_eps, w, c=None):
    """(y, p): P7's reference (no bank), then the GEMV's aten calls on h."""
    h, p = arn.attn_res_norm_reference([], x, delta, None, norm_weight, 0.0, norm_eps)
    return gv.gemv_reference(h, w, c), p


# --------------------------------------------------------------------------- Triton kernel

if triton is not None:
    from .gemv import _dot_product, _finish, _rows_product, _w_tile

    @triton.jit
    def _load_p(x_ptr, d_ptr, offs, mask, HAS_DELTA: tl.constexpr):
        """p = x + delta rounded to x's dtype, as P7's residual add (x alone without delta)."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _row_inv_rms(x_ptr, d_ptr, p_ptr, rm, m_ok, K, eps, owner, HAS_DELTA: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_R: tl.constexpr):
        """rsqrt(mean(p^2) + eps) per row [ROWS] over the whole row; the owner program (owner == 0) stores p."""
        ss = tl.zeros([ROWS], dtype=tl.float32)
        for r0 in range(0, K, BLOCK_R):
            rk = r0 + tl.arange(0, BLOCK_R)
            mask = m_ok[:, None] & (rk < K)[None, :]
            offs = rm[:, None] * K + rk[None, :]
            p = _load_p(x_ptr, d_ptr, offs, mask, HAS_DELTA)
            tl.store(p_ptr + offs, p, mask=mask & ((offs * 0 + owner) == 0))
            pf = p.to(tl.float32)
            ss += tl.sum(pf * pf, axis=1)
        return tl.rsqrt(ss / K + eps)

    @triton.jit
    def _normed_slice(x_ptr, d_ptr, nw_ptr, rm, m_ok, rk, k_ok, K, inv, HAS_DELTA: tl.constexpr,
                      OUT_DTYPE: tl.constexpr):
        """h [ROWS, BLOCK_K] = norm_weight * (p * inv).to(x's dtype), rounded to OUT_DTYPE (P7's `_rms_norm_row`
        roundings)."""
        mask = m_ok[:, None] & k_ok[None, :]
        p = _load_p(x_ptr, d_ptr, rm[:, None] * K + rk[None, :], mask, HAS_DELTA)
        nw = tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        normed = (p.to(tl.float32) * inv[:, None]).to(p.dtype).to(tl.float32)
        return (nw[None, :] * normed).to(OUT_DTYPE)

    @triton.jit
    def _norm_gemv_step(acc, w, x_ptr, d_ptr, nw_ptr, rm, m_ok, rk, k_ok, K, inv, HAS_DELTA: tl.constexpr,
                        ROWS_DESIGN: tl.constexpr):
        h = _normed_slice(x_ptr, d_ptr, nw_ptr, rm, m_ok, rk, k_ok, K, inv, HAS_DELTA, w.dtype)
        if ROWS_DESIGN:
            acc = _rows_product(acc, h[:, None, :], w)
        else:
            acc = _dot_product(acc, h, w)
        return acc

    @triton.jit
    def _norm_gemv_kernel(x_ptr, d_ptr, nw_ptr, p_ptr, w_ptr, c_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split,
                          norm_eps, swn, swk, scm, scn, sym, syn,
                          HAS_DELTA: tl.constexpr, HAS_C: tl.constexpr, ROWS_DESIGN: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                          SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr):
        # x, delta and p are contiguous [M, K] (the wrapper makes sure): row m starts at m * K
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, ROWS)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        k_start = pid_k * k_per_split
        # the first K step's weights load while the previous kernel (x's and delta's producer) finishes
        w, rk, k_ok = _w_tile(w_ptr, rn, n_ok, k_start, 0, k_per_split, K, swn, swk, BLOCK_K)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        inv = _row_inv_rms(x_ptr, d_ptr, p_ptr, rm, m_ok, K, norm_eps, pid_n + pid_k, HAS_DELTA, ROWS, BLOCK_R)
        if ROWS_DESIGN:
            acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        acc = _norm_gemv_step(acc, w, x_ptr, d_ptr, nw_ptr, rm, m_ok, rk, k_ok, K, inv, HAS_DELTA, ROWS_DESIGN)
        for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
            w, rk, k_ok = _w_tile(w_ptr, rn, n_ok, k_start, k0, k_per_split, K, swn, swk, BLOCK_K)
            acc = _norm_gemv_step(acc, w, x_ptr, d_ptr, nw_ptr, rm, m_ok, rk, k_ok, K, inv, HAS_DELTA, ROWS_DESIGN)
        if USE_PDL:  # x, delta read (and p stored): the next kernel may launch
            tl.extra.cuda.gdc_launch_dependents()
        if ROWS_DESIGN:
            out = tl.sum(acc, axis=2)
        else:
            out = acc
        _finish(out, rm, rn, m_ok, n_ok, pid_n, pid_k, c_ptr, y_ptr, ws_ptr, cnt_ptr, N, scm, scn, sym, syn,
                HAS_C, ROWS, BLOCK_N, SPLIT_K)


def kernel_supports(x: torch.Tensor, w: torch.Tensor, max_m: int, design: int) -> bool:
    return gv.kernel_supports(x, w, max_m, design) and x.shape[1] > 0


def norm_gemv_triton(x, delta, norm_weight, norm_eps, w, c=None, block_n: int = 64, block_k: int = 128,
                     split_k: int = 1, num_warps: int = 4, design: int = 0, use_pdl: bool = False):
    """Launch the fused kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): (y, p)."""
    rows = design == gv.DESIGNS["rows"]
    most = gv.ROWS_MAX_M if rows else gv.MAX_M
    check_args(x, delta, norm_weight, w, c, most, block_n, block_k, split_k, design, num_warps)
    if triton is None:
        raise RuntimeError("norm_gemv: triton is not installed")
    m, k = x.shape
    n = w.shape[0]
    if not kernel_supports(x, w, most, design):
        raise ValueError(f"norm_gemv kernel: takes 1..{most} rows of bf16/fp16 with K > 0 in the "
                         f"{'rows' if rows else 'dot'} design, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    delta = x if delta is None else delta.contiguous()  # delta None: unused pointer slot
    p = torch.empty_like(x)
    y = torch.empty(m, n, dtype=w.dtype, device=x.device)
    tiles, k_per_split, split_k, ws, cnt = gv.split_plan(m, n, k, block_n, block_k, split_k, rows, x.device,
                                                         ARRIVALS_OWNER)
    ws, cnt = (y, y) if ws is None else (ws, cnt)  # split_k 1: unused pointer slots
    if c is None:
        c_arg, scm, scn = y, 0, 0
    else:
        c_arg = c
        scm, scn = (0, c.stride(0)) if c.dim() == 1 else (c.stride(0), c.stride(1))
    padded = triton.next_power_of_2(m) if rows else gv.BLOCK_M
    pdl = pdl_for(use_pdl, x)
    extra = {"launch_pdl": True} if pdl else {}
    _norm_gemv_kernel[(tiles, split_k)](
        x, delta, norm_weight.contiguous(), p, w, c_arg, y, ws, cnt, m, n, k, k_per_split, float(norm_eps),
        w.stride(0), w.stride(1), scm, scn, y.stride(0), y.stride(1),
        HAS_DELTA=delta is not x, HAS_C=c is not None, ROWS_DESIGN=rows, ROWS=padded, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_R=min(triton.next_power_of_2(k), max(16, ROW_TILE // padded)), SPLIT_K=split_k,
        USE_PDL=pdl, num_warps=num_warps, **extra)
    return y, p


# --------------------------------------------------------------------------- the k3 op

@torch.library.custom_op("k3::norm_gemv", mutates_args=())
def norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, norm_eps: float,
              w: torch.Tensor, c: torch.Tensor | None, max_m: int, block_n: int, block_k: int, split_k: int,
              design: int, use_pdl: bool, num_warps: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, p): k3.attn_res_norm without a bank, then k3.gemv on its h. See the module doc."""
    check_args(x, delta, norm_weight, w, c, max_m, block_n, block_k, split_k, design, num_warps, max_tokens)
    return norm_gemv_reference(x, delta, norm_weight, norm_eps, w, c)


@norm_gemv.register_kernel("cuda")
def _norm_gemv_cuda(x, delta, norm_weight, norm_eps, w, c, max_m, block_n, block_k, split_k, design, use_pdl,
                    num_warps, max_tokens):
    check_args(x, delta, norm_weight, w, c, max_m, block_n, block_k, split_k, design, num_warps, max_tokens)
    with torch.cuda.device(x.device):  # Triton launches on the current device
        if kernel_supports(x, w, min(max_m, max_tokens), design):
            return norm_gemv_triton(x, delta, norm_weight, norm_eps, w, c, block_n, block_k, split_k,
                                    num_warps=num_warps, design=design, use_pdl=use_pdl)
        # the pair the pass replaced: P7's kernel, then the GEMV (which itself runs aten above max_m)
        h, p = torch.ops.k3.attn_res_norm([], x, delta, None, norm_weight, 0.0, norm_eps, use_pdl)
        return torch.ops.k3.gemv(h, w, c, max_m, block_n, block_k, split_k, design, use_pdl, num_warps), p


@norm_gemv.register_fake
def _norm_gemv_fake(x, delta, norm_weight, norm_eps, w, c, max_m, block_n, block_k, split_k, design, use_pdl,
                    num_warps, max_tokens):
    check_args(x, delta, norm_weight, w, c, max_m, block_n, block_k, split_k, design, num_warps, max_tokens)
    return x.new_empty(x.shape[0], w.shape[0], dtype=w.dtype), torch.empty_like(x)
