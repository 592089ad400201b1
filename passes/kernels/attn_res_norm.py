"""Residual add + Block-AttnRes read + the following RMSNorm, per token, as one op (pass P7).

`torch.ops.k3.attn_res_norm(bank, x, delta, query, norm_weight, res_eps, norm_eps) -> (h, p)`:

    p   = x + delta                                  the residual add, rounded to x's dtype
        = x                                          when delta is None (a block boundary: the
                                                     partial sum restarts from zeros_like, 0 + d = d)
    r   = bank + [p]                                 the read's sources (bank rows [N, D] each)
    mix = Σ_j softmax_j(Σ_d r_j[d] / rms(r_j) · query[d]) · r_j      fp32 on the raw rows, cast
                                                     back to x's dtype (spec §3.2; query = γ ⊙ w)
        = p                                          when the bank is empty (plain pre-norm residual)
    h   = norm_weight * (mix.float() * rsqrt(mean(mix.float()²) + norm_eps)).to(x.dtype)

It is exactly the composition `model_def` runs (`attn_res_read` then `RMSNorm`, see
`layers/attn_res.py`, `layers/common.py`), so an empty bank is the Kimi-Linear "x = x + f(..);
h = norm(x)" pair and a non-empty one K3's read. `p` is returned because the running partial sum
is read again by the next residual add and by later bank snapshots.

CPU (and any device without the kernel) runs `attn_res_norm_reference`; CUDA runs one Triton
program per token. Where the bank fits in registers (bank rows x dim <= TILE_MAX_ELEMS: every
k3-mini and Kimi-Linear shape) the program loads all bank rows as one [rows, dim] tile in a single
pass (every load in flight at once), takes the rows' rms and logits as two row reductions, the
softmax in registers and the weighted sum from the same registers. Otherwise (K3's 7168-wide
8-row read) it streams the rows: pass 1 the rms and logit of each row, pass 2 re-reads them (L2-hot)
for the weighted sum. The streaming form was the only one until the bank tile: at batch 1 (one
program) it waits for each row's DRAM latency and its reductions one row after another, which made
the read 5.4 us at k3-mini-6b's 2048 x 8 bank against 2 us for an empty bank.

PDL (`pdl=True`, P7's default; CUDA sm90+ with Triton's device-side calls): the kernel loads its
weights, waits for the previous kernel (`gdc_wait`), and releases its dependents once its inputs are
read.

Testing without a GPU: TRITON_INTERPRET=1 in the environment before this module is imported makes
`attn_res_norm_triton` run on CPU tensors (tests/passes/kernels/interpret_attn_res_norm.py).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through the reference
    triton = None

from .pdl import pdl_for

MAX_BANK = 8  # K3: ceil(93 / 12) bank rows; the kernel has one pointer argument per row
KERNEL_MAX_DIM = 16384  # one token's row lives in registers
TILE_MAX_ELEMS = 32768  # bank tile (padded rows x padded dim) held in registers by one program


def check_args(bank, x, delta, query, norm_weight) -> None:
    """Raise ValueError naming the first thing wrong with a call."""
    if x.dim() != 2:
        raise ValueError(f"attn_res_norm: x must be [tokens, dim], got shape {tuple(x.shape)}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"attn_res_norm: delta must match x ({tuple(x.shape)}, {x.dtype}), "
                         f"got {tuple(delta.shape)}, {delta.dtype}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"attn_res_norm: x must be a float tensor, got {x.dtype}")
    for i, row in enumerate(bank):
        if row.shape != x.shape or row.dtype != x.dtype:
            raise ValueError(f"attn_res_norm: bank row {i} must match x ({tuple(x.shape)}, {x.dtype}), "
                             f"got {tuple(row.shape)}, {row.dtype}")
    if len(bank) > MAX_BANK:
        raise ValueError(f"attn_res_norm: at most {MAX_BANK} bank rows, got {len(bank)}")
    d = x.shape[1]
    if bank and (query is None or query.shape != (d,)):
        raise ValueError(f"attn_res_norm: a non-empty bank needs query [{d}], got "
                         f"{None if query is None else tuple(query.shape)}")
    if norm_weight.shape != (d,):
        raise ValueError(f"attn_res_norm: norm_weight must be [{d}], got {tuple(norm_weight.shape)}")


def _out_dtype(x, norm_weight):
    return torch.promote_types(norm_weight.dtype, x.dtype)


# --------------------------------------------------------------------------- CPU reference

def attn_res_norm_reference(bank: list[torch.Tensor], x: torch.Tensor, delta: torch.Tensor | None,
                            query: torch.Tensor | None, norm_weight: torch.Tensor, res_eps: float,
                            norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(bank, x, delta, query, norm_weight)
    p = x.clone() if delta is None else x + delta
    if bank:
        r = torch.stack(list(bank) + [p], 0).float()
        logits = (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + res_eps) * query.float()).sum(-1)
        mix = (logits.softmax(0).unsqueeze(-1) * r).sum(0).to(x.dtype)
    else:
        mix = p
    mf = mix.float()
    h = norm_weight * (mf * torch.rsqrt(mf.pow(2).mean(-1, keepdim=True) + norm_eps)).to(x.dtype)
    return h, p


# --------------------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def _bank_row(j: tl.constexpr, b0, b1, b2, b3, b4, b5, b6, b7):
        if j == 0:
            return b0
        elif j == 1:
            return b1
        elif j == 2:
            return b2
        elif j == 3:
            return b3
        elif j == 4:
            return b4
        elif j == 5:
            return b5
        elif j == 6:
            return b6
        else:
            return b7

    @triton.jit
    def _residual_add(x_ptr, delta_ptr, p_ptr, base, m, store_m, HAS_DELTA: tl.constexpr):
        """p = x + delta rounded to x's dtype (x alone without delta), stored where store_m; returns p."""
        x = tl.load(x_ptr + base, mask=m, other=0.0)
        if HAS_DELTA:
            dl = tl.load(delta_ptr + base, mask=m, other=0.0)
            p = (x.to(tl.float32) + dl.to(tl.float32)).to(x.dtype)  # the residual add, rounded like torch
        else:
            p = x
        tl.store(p_ptr + base, p, mask=store_m)
        return p

    @triton.jit
    def _rms_norm_row(mix, p, w, D, norm_eps, OUT_DTYPE: tl.constexpr):
        """h = w * RMSNorm(mix) with torch's roundings (normed to p's dtype, the product to OUT_DTYPE)."""
        inv = tl.rsqrt(tl.sum(mix * mix, axis=0) / D + norm_eps)
        normed = (mix * inv).to(p.dtype).to(tl.float32)
        return (w * normed).to(OUT_DTYPE)

    @triton.jit
    def _norm_store(mix, p, w, D, norm_eps, h_ptr, h32_ptr, base, m, WRITE_H32: tl.constexpr):
        """h = w * RMSNorm(mix) (`_rms_norm_row`); stores h (and its fp32 copy)."""
        h = _rms_norm_row(mix, p, w, D, norm_eps, h_ptr.dtype.element_ty)
        tl.store(h_ptr + base, h, mask=m)
        if WRITE_H32:  # h's fp32 copy for a consumer that casts it (the router's fp32 GEMM)
            tl.store(h32_ptr + base, h.to(tl.float32), mask=m)

    @triton.jit
    def _tile_mix(r, live, p, q, D, res_eps):
        """The AttnRes read over a bank tile r [rows, D] (fp32, rows past `live` masked) plus the partial sum p:
        softmax over the rows' rms-normed logits, the weighted sum rounded to p's dtype; returned in fp32."""
        pf = p.to(tl.float32)
        inv_r = tl.rsqrt(tl.sum(r * r, axis=1) / D + res_eps)
        logit_r = tl.where(live, tl.sum(r * q[None, :], axis=1) * inv_r, float("-inf"))
        logit_p = tl.sum(pf * q, axis=0) * tl.rsqrt(tl.sum(pf * pf, axis=0) / D + res_eps)
        top = tl.maximum(tl.max(logit_r, axis=0), logit_p)
        e_r = tl.exp(logit_r - top)
        e_p = tl.exp(logit_p - top)
        den = tl.sum(e_r, axis=0) + e_p
        acc = tl.sum(r * (e_r / den)[:, None], axis=0) + pf * (e_p / den)
        return acc.to(p.dtype).to(tl.float32)

    @triton.jit
    def _bank_tile_ptrs(ridx, NUM_BANK: tl.constexpr, b0, b1, b2, b3, b4, b5, b6, b7):
        """[rows, 1] pointers: row j of the tile points at bank row j (rows past NUM_BANK: b0, masked)."""
        ptrs = tl.where(ridx == 0, b0, b0)
        for j in tl.static_range(1, NUM_BANK):
            ptrs = tl.where(ridx == j, _bank_row(j, b0, b1, b2, b3, b4, b5, b6, b7), ptrs)
        return ptrs

    @triton.jit
    def _attn_res_norm_tile_kernel(
        b0, b1, b2, b3, b4, b5, b6, b7,
        x_ptr, delta_ptr, query_ptr, weight_ptr, h_ptr, p_ptr, h32_ptr,
        D, res_eps, norm_eps,
        NUM_BANK: tl.constexpr, BLOCK_D: tl.constexpr, BANK_PAD: tl.constexpr, USE_PDL: tl.constexpr,
        WRITE_H32: tl.constexpr, HAS_DELTA: tl.constexpr,
    ):
        # one pass: the whole bank is one [BANK_PAD, BLOCK_D] tile, every row's load in flight at once
        token = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        base = token * D + cols
        w = tl.load(weight_ptr + cols, mask=m, other=0.0).to(tl.float32)
        q = tl.load(query_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # x, delta and the bank rows come from earlier kernels
        ridx = tl.arange(0, BANK_PAD)
        # every row starts 16-byte aligned (the wrapper checks): say so, or the select hides it
        rows = tl.multiple_of(_bank_tile_ptrs(ridx[:, None], NUM_BANK, b0, b1, b2, b3, b4, b5, b6, b7), [16, 1])
        live = ridx < NUM_BANK
        r = tl.load(rows + base[None, :], mask=live[:, None] & m[None, :], other=0.0).to(tl.float32)
        p = _residual_add(x_ptr, delta_ptr, p_ptr, base, m, m, HAS_DELTA)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()  # inputs read
        mix = _tile_mix(r, live, p, q, D, res_eps)
        _norm_store(mix, p, w, D, norm_eps, h_ptr, h32_ptr, base, m, WRITE_H32)

    @triton.jit
    def _attn_res_norm_kernel(
        b0, b1, b2, b3, b4, b5, b6, b7,
        x_ptr, delta_ptr, query_ptr, weight_ptr, h_ptr, p_ptr, h32_ptr,
        D, res_eps, norm_eps,
        NUM_BANK: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
        WRITE_H32: tl.constexpr, HAS_DELTA: tl.constexpr,
    ):
        # all [N, D] tensors are contiguous (the wrapper makes sure), so a token's row starts at token * D
        token = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        base = token * D + cols
        # weights first: with PDL these loads overlap the previous kernel's tail
        w = tl.load(weight_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if NUM_BANK > 0:
            q = tl.load(query_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # x, delta and the bank rows come from earlier kernels
        p = _residual_add(x_ptr, delta_ptr, p_ptr, base, m, m, HAS_DELTA)
        pf = p.to(tl.float32)
        if NUM_BANK > 0:
            idx = tl.arange(0, ROWS_PAD)
            logits = tl.full([ROWS_PAD], float("-inf"), tl.float32)
            for j in tl.static_range(NUM_BANK):
                r = tl.load(_bank_row(j, b0, b1, b2, b3, b4, b5, b6, b7) + base, mask=m, other=0.0).to(tl.float32)
                inv = tl.rsqrt(tl.sum(r * r, axis=0) / D + res_eps)
                logits = tl.where(idx == j, tl.sum(r * q, axis=0) * inv, logits)
            inv = tl.rsqrt(tl.sum(pf * pf, axis=0) / D + res_eps)
            logits = tl.where(idx == NUM_BANK, tl.sum(pf * q, axis=0) * inv, logits)
            e = tl.exp(logits - tl.max(logits, axis=0))
            pi = e / tl.sum(e, axis=0)
            acc = pf * tl.sum(tl.where(idx == NUM_BANK, pi, 0.0), axis=0)
            for j in tl.static_range(NUM_BANK):
                r = tl.load(_bank_row(j, b0, b1, b2, b3, b4, b5, b6, b7) + base, mask=m, other=0.0).to(tl.float32)
                acc += r * tl.sum(tl.where(idx == j, pi, 0.0), axis=0)
            mix = acc.to(p.dtype).to(tl.float32)
        else:
            mix = pf
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()  # inputs read
        _norm_store(mix, p, w, D, norm_eps, h_ptr, h32_ptr, base, m, WRITE_H32)


def kernel_supports(dim: int, num_bank: int) -> bool:
    return triton is not None and dim <= KERNEL_MAX_DIM and num_bank <= MAX_BANK


def bank_fits_tile(dim: int, num_bank: int) -> bool:
    """Whether the one-pass kernel holds this bank in registers."""
    return num_bank > 0 and triton.next_power_of_2(num_bank) * triton.next_power_of_2(dim) <= TILE_MAX_ELEMS


def one_pass_applies(bank: list[torch.Tensor], x: torch.Tensor) -> bool:
    """The one-pass kernel's conditions: the bank fits and every (contiguous) row starts 16-byte aligned,
    which the kernel tells the compiler so it can use vector loads."""
    return (bank_fits_tile(x.shape[1], len(bank)) and (x.shape[1] * x.element_size()) % 16 == 0
            and all(r.is_contiguous() and r.data_ptr() % 16 == 0 for r in bank))


def attn_res_norm_triton(bank, x, delta, query, norm_weight, res_eps, norm_eps, num_warps: int | None = None,
                         pdl: bool = False, with_fp32: bool = False, one_pass: bool | None = None):
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): (h, p), or
    (h, p, h.float()) with `with_fp32`. `one_pass` None picks the bank-tile kernel where the bank fits
    (`bank_fits_tile`, rows 16-byte aligned); False forces the streaming kernel (the benchmarks' old arm)."""
    check_args(bank, x, delta, query, norm_weight)
    if triton is None:
        raise RuntimeError("attn_res_norm: triton is not installed")
    n, d = x.shape
    if not kernel_supports(d, len(bank)):
        raise ValueError(f"attn_res_norm kernel: supports dim <= {KERNEL_MAX_DIM}, got {d}")
    bank = [r.contiguous() for r in bank]
    x = x.contiguous()
    delta = x if delta is None else delta.contiguous()  # delta None: unused pointer slot
    h = torch.empty(n, d, dtype=_out_dtype(x, norm_weight), device=x.device)
    p = torch.empty_like(x)
    h32 = torch.empty(n, d, dtype=torch.float32, device=x.device) if with_fp32 else h
    if n == 0:
        return (h, p, h32) if with_fp32 else (h, p)
    rows = bank + [x] * (MAX_BANK - len(bank))  # unused pointer slots: any valid tensor
    block = triton.next_power_of_2(d)
    has_delta = delta is not x
    pdl = pdl_for(pdl, x)
    extra = {"launch_pdl": True} if pdl else {}
    args = (*rows, x, delta, query.contiguous() if query is not None else norm_weight, norm_weight.contiguous(),
            h, p, h32, d, float(res_eps), float(norm_eps))
    if one_pass is None:
        one_pass = one_pass_applies(bank, x)
    if one_pass:
        if not one_pass_applies(bank, x):
            raise ValueError(f"attn_res_norm: a bank of {len(bank)} rows x {d} does not fit the one-pass tile "
                             f"(or a row is not 16-byte aligned)")
        pad = triton.next_power_of_2(len(bank))
        if num_warps is None:  # ~64 fp32 tile elements per thread (8 warps at k3-mini's 8 x 2048)
            num_warps = max(4, min(16, pad * block // 2048))
        _attn_res_norm_tile_kernel[(n,)](
            *args, NUM_BANK=len(bank), BLOCK_D=block, BANK_PAD=pad, USE_PDL=pdl, WRITE_H32=with_fp32,
            HAS_DELTA=has_delta, num_warps=num_warps, **extra)
    else:
        if num_warps is None:
            num_warps = 8 if block >= 4096 else (4 if block >= 1024 else 1)
        _attn_res_norm_kernel[(n,)](
            *args, NUM_BANK=len(bank), BLOCK_D=block, ROWS_PAD=triton.next_power_of_2(len(bank) + 1), USE_PDL=pdl,
            WRITE_H32=with_fp32, HAS_DELTA=has_delta, num_warps=num_warps, **extra)
    return (h, p, h32) if with_fp32 else (h, p)


# --------------------------------------------------------------------------- the k3 op

@torch.library.custom_op("k3::attn_res_norm", mutates_args=())
def attn_res_norm(bank: list[torch.Tensor], x: torch.Tensor, delta: torch.Tensor | None, query: torch.Tensor | None,
                  norm_weight: torch.Tensor, res_eps: float, norm_eps: float,
                  pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, p): RMSNorm of the AttnRes read over bank + [x + delta], and x + delta (x when delta is None).
    See module doc."""
    return attn_res_norm_reference(bank, x, delta, query, norm_weight, res_eps, norm_eps)


@attn_res_norm.register_kernel("cuda")
def _attn_res_norm_cuda(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl=False):
    if kernel_supports(x.shape[-1], len(bank)):
        with torch.cuda.device(x.device):
            return attn_res_norm_triton(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl=pdl)
    return attn_res_norm_reference(bank, x, delta, query, norm_weight, res_eps, norm_eps)


@attn_res_norm.register_fake
def _attn_res_norm_fake(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl=False):
    check_args(bank, x, delta, query, norm_weight)
    return x.new_empty(x.shape, dtype=_out_dtype(x, norm_weight)), torch.empty_like(x)


@torch.library.custom_op("k3::attn_res_norm_f32", mutates_args=())
def attn_res_norm_f32(bank: list[torch.Tensor], x: torch.Tensor, delta: torch.Tensor | None,
                      query: torch.Tensor | None,
                      norm_weight: torch.Tensor, res_eps: float, norm_eps: float,
                      pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k3::attn_res_norm plus h's fp32 copy from the same kernel (saves the cast kernel of a consumer that
    reads h in fp32, such as the MoE router's GEMM)."""
    h, p = attn_res_norm_reference(bank, x, delta, query, norm_weight, res_eps, norm_eps)
    return h, p, h.float()


@attn_res_norm_f32.register_kernel("cuda")
def _attn_res_norm_f32_cuda(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl=False):
    if kernel_supports(x.shape[-1], len(bank)):
        with torch.cuda.device(x.device):
            return attn_res_norm_triton(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl=pdl,
                                        with_fp32=True)
    h, p = attn_res_norm_reference(bank, x, delta, query, norm_weight, res_eps, norm_eps)
    return h, p, h.float()


@attn_res_norm_f32.register_fake
def _attn_res_norm_f32_fake(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl=False):
    check_args(bank, x, delta, query, norm_weight)
    return (x.new_empty(x.shape, dtype=_out_dtype(x, norm_weight)), torch.empty_like(x),
            x.new_empty(x.shape, dtype=torch.float32))
