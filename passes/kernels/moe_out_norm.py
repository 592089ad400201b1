"""P6's latent MoE and the AttnRes norm after it in one op: kernel C's last program per token runs the norm (pass
p07_moe_out_norm).

`torch.ops.k3.fused_moe_decode_norm(bank, residual, query, norm_weight, res_eps, norm_eps, norm_pdl, tail_warps,
tail_block_n, <k3::fused_moe_decode's arguments, same order and defaults>) -> (h, p)` is exactly the composition the decode graph
runs once P6 and P7 have rewritten it:

    y    = k3.fused_moe_decode(<MoE arguments>)                                  latent MoE (latent_up_w given)
    h, p = k3.attn_res_norm(bank, residual, y, query, norm_weight, res_eps, norm_eps, norm_pdl)   residual given
         = k3.attn_res_norm(bank, y, None, query, norm_weight, res_eps, norm_eps, norm_pdl)       residual None

CPU (and CUDA wherever the fused kernel does not apply: the grouped-GEMM path at or above the crossover, a bank that
does not fit P7's one-pass register tile or a row not 16-byte aligned, widths that differ) runs those two ops, so an
engine with the pass computes bit for bit what one without it does there.

CUDA below the crossover: kernels A and B' as P6 launches them, then kernel C (`_latent_out_norm_kernel`): every
program computes its column block of y as P6's kernel C does (moe_decode._latent_out_block: same loads, same sums,
PDL wait and release at the same points), stores it, and arrives on its token's counter (kernels.arrivals, acq_rel,
zeroed again by the last); the token's last program to arrive runs P7's one-pass norm on the whole row (bank tile,
residual add, AttnRes softmax, RMSNorm: attn_res_norm's helpers, the same roundings) and stores h and p. y itself
stays in a workspace. One launch per MoE layer less than the pair: the norm's own kernel (3.9 us a launch in the
session-12 k3-mini trace, traces/h200_s12/call4) becomes a tail that runs once the row exists, with no kernel
boundary in between. The tail's [bank rows, D] tile lives in the registers of one program of kernel C, so it sizes
kernel C's register budget: ptxas (Triton 3.6, sm90, k3-mini's 8-row bank, batch 1) gives kernel C 96 registers a
thread without the tail and 211 with it at 4 warps (124 at 8 warps), i.e. 2 programs an SM where 5 fitted, so C's 512
programs at batch 1 no longer fit one wave. `tail_block_n` (the pass's `block_n`, 0: kernel C's own launch) sets C's
output columns per program (8: 256 programs, one wave at 2 an SM, the same bytes in flight per SM), `tail_warps`
(`num_warps`, 0: C's own) its warps.

Testing without a GPU: TRITON_INTERPRET=1 in the environment before this module is imported makes
`fused_moe_norm_triton` run on CPU tensors (tests/passes/kernels/interpret_moe_out_norm.py).
"""
from __future__ import annotations

import torch

from . import attn_res_norm as arn
from . import moe_decode, moe_launch
from .arrivals import arrival_counters

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through the references
    triton = None

ARRIVALS_OWNER = "moe_out_norm"  # this kernel's per-token counters (kernels.arrivals)
NORM_ARGS = 9  # the op's arguments before k3::fused_moe_decode's (bank .. tail_block_n)


def check_args(bank, residual, query, norm_weight, x, latent_up_w) -> None:
    """Raise ValueError naming the first thing wrong with the norm's half of a call (the MoE's half is
    moe_decode.check_args'): a latent MoE, and P7's checks against the MoE output's shape and dtype."""
    if latent_up_w is None:
        raise ValueError("fused_moe_decode_norm: the op fuses a latent MoE's kernel C; latent_up_w is None")
    y = x.new_empty(()).expand(x.shape[0], latent_up_w.shape[0])  # the MoE output's shape and dtype, one element
    nx, delta = _norm_inputs(y, bank, residual)
    arn.check_args(bank, nx, delta, query, norm_weight)


def _norm_inputs(y, bank, residual):
    """attn_res_norm's (x, delta) for the MoE output y: (residual, y), or (y, None) without a residual."""
    return (residual, y) if residual is not None else (y, None)


# --------------------------------------------------------------------------- CPU reference

def fused_moe_norm_reference(bank, residual, query, norm_weight, res_eps, norm_eps, *moe_args):
    """(h, p): P6's reference MoE (moe_decode.fused_moe_reference's arguments), then P7's reference norm."""
    y = moe_decode.fused_moe_reference(*moe_args)
    x, delta = _norm_inputs(y, bank, residual)
    return arn.attn_res_norm_reference(bank, x, delta, query, norm_weight, res_eps, norm_eps)


# --------------------------------------------------------------------------- Triton kernel

if triton is not None:
    from .attn_res_norm import _bank_tile_ptrs, _residual_add, _rms_norm_row, _tile_mix
    from .moe_decode import _latent_out_block

    @triton.jit
    def _norm_tail(token, x_ptr, delta_ptr, b0, b1, b2, b3, b4, b5, b6, b7, query_ptr, norm_w_ptr, h_ptr, p_ptr,
                   D, res_eps, norm_eps, NUM_BANK: tl.constexpr, BANK_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                   HAS_DELTA: tl.constexpr):
        """P7's one-pass norm (attn_res_norm's tile kernel) of row `token`: h and p stored."""
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        base = token * D + cols  # every [N, D] tensor is contiguous (the wrapper makes sure)
        nw = tl.load(norm_w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if NUM_BANK > 0:
            q = tl.load(query_ptr + cols, mask=m, other=0.0).to(tl.float32)
            ridx = tl.arange(0, BANK_PAD)
            rows = tl.multiple_of(_bank_tile_ptrs(ridx[:, None], NUM_BANK, b0, b1, b2, b3, b4, b5, b6, b7), [16, 1])
            live = ridx < NUM_BANK
            r = tl.load(rows + base[None, :], mask=live[:, None] & m[None, :], other=0.0).to(tl.float32)
        p = _residual_add(x_ptr, delta_ptr, p_ptr, base, m, m, HAS_DELTA)
        if NUM_BANK > 0:
            mix = _tile_mix(r, live, p, q, D, res_eps)
        else:
            mix = p.to(tl.float32)
        h = _rms_norm_row(mix, p, nw, D, norm_eps, h_ptr.dtype.element_ty)
        tl.store(h_ptr + base, h, mask=m)

    @triton.jit
    def _latent_out_norm_kernel(
        u_ptr, nw_ptr, upw_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr, L, DOUT, IS,
        sin_row_stride, sup_row_stride, out_row_stride, eps, beta, linear_beta,
        b0, b1, b2, b3, b4, b5, b6, b7, x_ptr, delta_ptr, query_ptr, norm_w_ptr, h_ptr, p_ptr, arrivals_ptr,
        res_eps, norm_eps,
        ACT: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, SHARED_GLU: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr, USE_PDL: tl.constexpr,
        PREWAIT: tl.constexpr, PREWAIT_W: tl.constexpr,
        NUM_BANK: tl.constexpr, BANK_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DELTA: tl.constexpr,
        COL_BLOCKS: tl.constexpr,
    ):
        token = _latent_out_block(u_ptr, nw_ptr, upw_ptr, sin_ptr, sup_ptr, sw2_ptr, out_ptr, L, DOUT, IS,
                                  sin_row_stride, sup_row_stride, out_row_stride, eps, beta, linear_beta, ACT, NORM,
                                  SHARED, SHARED_GLU, BLOCK_N, BLOCK_K, BLOCK_KS, USE_PDL, PREWAIT, PREWAIT_W)
        if COL_BLOCKS == 1:
            _norm_tail(token, x_ptr, delta_ptr, b0, b1, b2, b3, b4, b5, b6, b7, query_ptr, norm_w_ptr, h_ptr, p_ptr,
                       DOUT, res_eps, norm_eps, NUM_BANK, BANK_PAD, BLOCK_D, HAS_DELTA)
        else:
            tl.debug_barrier()  # every thread's columns are stored before this program arrives
            arrived = tl.atomic_add(arrivals_ptr + token, 1, sem="acq_rel")
            if arrived == COL_BLOCKS - 1:  # the row is complete: this program runs the norm
                # zeroed relaxed: nothing else touches the counter in this launch, and the next launch of the kernel
                # sees the zero because this grid has completed before it starts (PDL: it waits in gdc_wait)
                tl.atomic_xchg(arrivals_ptr + token, 0, sem="relaxed")
                _norm_tail(token, x_ptr, delta_ptr, b0, b1, b2, b3, b4, b5, b6, b7, query_ptr, norm_w_ptr, h_ptr,
                           p_ptr, DOUT, res_eps, norm_eps, NUM_BANK, BANK_PAD, BLOCK_D, HAS_DELTA)


def kernel_supports(bank, residual, x, latent_up_w, crossover: int) -> bool:
    """Where the fused kernel runs: Triton, a latent MoE on the GEMV path (below the crossover), the norm's row within
    P7's kernel and, with a bank, its one-pass tile (bank rows 16-byte aligned, attn_res_norm.one_pass_applies)."""
    if triton is None or latent_up_w is None or x.shape[0] >= crossover:
        return False
    d = latent_up_w.shape[0]
    if d > arn.KERNEL_MAX_DIM or (d * x.element_size()) % 16:
        return False
    if residual is not None and not residual.is_contiguous():
        return False
    return not bank or (arn.bank_fits_tile(d, len(bank))
                        and all(r.is_contiguous() and r.data_ptr() % 16 == 0 for r in bank))


class _NormTail:
    """moe_decode.fused_moe_triton's latent_tail: launches `_latent_out_norm_kernel` with kernel C's arguments plus the
    norm's, returns (h, p)."""

    def __init__(self, bank, residual, query, norm_weight, res_eps, norm_eps, num_warps: int = 0, block_n: int = 0):
        self.bank, self.residual, self.query, self.norm_weight = bank, residual, query, norm_weight
        self.res_eps, self.norm_eps, self.num_warps, self.block_n = float(res_eps), float(norm_eps), num_warps, block_n

    def __call__(self, grid, c_args, c_consts, launch):
        y = c_args[6]  # kernel C's output: [N, D] contiguous (fused_moe_triton allocates it)
        n, d = y.shape
        consts = dict(c_consts)
        if self.block_n:  # kernel C's launch for this column block (latent_config's K tiles for it)
            latent, shared = c_args[7], c_args[9]
            launch_c = moe_launch.latent_config(n, d, latent, shared, block_n=self.block_n)
            consts.update(BLOCK_N=launch_c.block_n, BLOCK_K=launch_c.block_k, BLOCK_KS=launch_c.block_ks,
                          PREWAIT_W=consts["PREWAIT"] and launch_c.block_k >= latent)
            grid = (grid[0], triton.cdiv(d, launch_c.block_n))
        if self.num_warps:
            consts["num_warps"] = self.num_warps
        x, delta = _norm_inputs(y, self.bank, self.residual)
        h = torch.empty(n, d, dtype=arn._out_dtype(y, self.norm_weight), device=y.device)
        p = torch.empty_like(y)
        rows = self.bank + [y] * (arn.MAX_BANK - len(self.bank))  # unused pointer slots: any valid tensor
        col_blocks = grid[1]
        arrivals = arrival_counters(y.device, n, ARRIVALS_OWNER) if col_blocks > 1 else h  # (unused at 1)
        _latent_out_norm_kernel[grid](
            *c_args, *rows, x, delta if delta is not None else x,
            self.query.contiguous() if self.query is not None else self.norm_weight, self.norm_weight.contiguous(),
            h, p, arrivals, self.res_eps, self.norm_eps,
            **consts, NUM_BANK=len(self.bank), BANK_PAD=triton.next_power_of_2(max(len(self.bank), 1)),
            BLOCK_D=triton.next_power_of_2(d), HAS_DELTA=delta is not None, COL_BLOCKS=col_blocks, **launch)
        return h, p


def fused_moe_norm_triton(bank, residual, query, norm_weight, res_eps, norm_eps, *moe_args, tail_warps: int = 0,
                          tail_block_n: int = 0, **moe_options):
    """Launch A, B' and kernel C with the norm tail (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): (h, p).
    moe_args: fused_moe_triton's positional arguments (x .. shared_w13), moe_options its launch options; tail_warps /
    tail_block_n: kernel C's warps / output columns per program with the tail (0: its own launch's)."""
    if triton is None:
        raise RuntimeError("fused_moe_decode_norm: triton is not installed")
    x, latent_up_w = moe_args[0], moe_args[13]
    check_args(bank, residual, query, norm_weight, x, latent_up_w)
    bank = [r.contiguous() for r in bank]
    residual = residual.contiguous() if residual is not None else None
    if not kernel_supports(bank, residual, x, latent_up_w, moe_decode.NO_CROSSOVER):
        raise ValueError(f"fused_moe_decode_norm kernel: no fused kernel for width {latent_up_w.shape[0]} and "
                         f"{len(bank)} bank rows (bank tile too large, or a row not 16-byte aligned)")
    if x.shape[0] == 0:
        y = x.new_empty(0, latent_up_w.shape[0])
        return torch.empty_like(y, dtype=arn._out_dtype(y, norm_weight)), torch.empty_like(y)
    if tail_block_n and tail_block_n & (tail_block_n - 1):
        raise ValueError(f"fused_moe_decode_norm: tail_block_n must be a power of two, got {tail_block_n}")
    tail = _NormTail(bank, residual, query, norm_weight, res_eps, norm_eps, tail_warps, tail_block_n)
    return moe_decode.fused_moe_triton(*moe_args, **moe_options, latent_tail=tail)


# --------------------------------------------------------------------------- the k3 op

@torch.library.custom_op("k3::fused_moe_decode_norm", mutates_args=())
def fused_moe_decode_norm(
        bank: list[torch.Tensor], residual: torch.Tensor | None, query: torch.Tensor | None, norm_weight: torch.Tensor,
        res_eps: float, norm_eps: float, norm_pdl: bool, tail_warps: int, tail_block_n: int,
        x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, shared_in: torch.Tensor | None,
        shared_up: torch.Tensor | None, shared_w2: torch.Tensor | None, act: str, beta: float, linear_beta: float,
        crossover: int, latent_up_w: torch.Tensor | None = None, latent_norm_w: torch.Tensor | None = None,
        latent_eps: float = 1e-5, use_pdl: bool = False, shared_w13: torch.Tensor | None = None,
        down_split: list[int] | None = None, shared_l2_prefetch: bool = False, down_l2_prefetch: bool = False,
        up_launch: list[int] | None = None, flag_deps: bool = False, early_release: bool = False,
        down_early_release: bool = False, latent_prewait: bool = False,
        grouped_sorted: bool = False, sorted_finish: bool = False,
        routed_l2_prefetch: bool = False, up_prewait: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, p): k3::fused_moe_decode, then k3::attn_res_norm on its output. See the module doc. tail_warps /
    tail_block_n: kernel C's warps / output columns per program with the tail (0: its own launch's; the results do not
    depend on them beyond the sums' order)."""
    check_args(bank, residual, query, norm_weight, x, latent_up_w)
    return fused_moe_norm_reference(bank, residual, query, norm_weight, res_eps, norm_eps, x, topk_ids, topk_weights,
                                    w13, w2, w13_scale, w2_scale, shared_in, shared_up, shared_w2, act, beta,
                                    linear_beta, latent_up_w, latent_norm_w, latent_eps, shared_w13)


@fused_moe_decode_norm.register_kernel("cuda")
def _fused_moe_decode_norm_cuda(bank, residual, query, norm_weight, res_eps, norm_eps, norm_pdl, tail_warps, tail_block_n,
                                x,
                                topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up, shared_w2,
                                act, beta, linear_beta, crossover, latent_up_w=None, latent_norm_w=None,
                                latent_eps=1e-5, use_pdl=False, shared_w13=None, down_split=None,
                                shared_l2_prefetch=False, down_l2_prefetch=False, up_launch=None, flag_deps=False,
                                early_release=False, down_early_release=False, latent_prewait=False,
                                grouped_sorted=False, sorted_finish=False, routed_l2_prefetch=False,
                                up_prewait=False):
    check_args(bank, residual, query, norm_weight, x, latent_up_w)
    bank_c = [r.contiguous() for r in bank]
    with torch.cuda.device(x.device):  # Triton launches on the current device
        if kernel_supports(bank_c, residual, x, latent_up_w, crossover):
            split = None if down_split is None else moe_launch.split_from_list(down_split)
            return fused_moe_norm_triton(
                bank_c, residual, query, norm_weight, res_eps, norm_eps, x, topk_ids, topk_weights, w13, w2,
                w13_scale, w2_scale, shared_in, shared_up, shared_w2, act, beta, linear_beta, latent_up_w,
                latent_norm_w, latent_eps, shared_w13, tail_warps=tail_warps, tail_block_n=tail_block_n, use_pdl=use_pdl, split=split,
                shared_l2_prefetch=shared_l2_prefetch, down_l2_prefetch=down_l2_prefetch, up_launch=up_launch,
                flag_deps=flag_deps, early_release=early_release, down_early_release=down_early_release,
                latent_prewait=latent_prewait, routed_l2_prefetch=routed_l2_prefetch, up_prewait=up_prewait)
        # the pair the pass replaced
        y = torch.ops.k3.fused_moe_decode(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in,
                                          shared_up, shared_w2, act, beta, linear_beta, crossover, latent_up_w,
                                          latent_norm_w, latent_eps, use_pdl, shared_w13, down_split,
                                          shared_l2_prefetch, down_l2_prefetch, up_launch, flag_deps, early_release,
                                          down_early_release, latent_prewait, grouped_sorted, sorted_finish,
                                          routed_l2_prefetch, up_prewait)
        nx, delta = _norm_inputs(y, bank, residual)
        return torch.ops.k3.attn_res_norm(bank, nx, delta, query, norm_weight, res_eps, norm_eps, norm_pdl)


@fused_moe_decode_norm.register_fake
def _fused_moe_decode_norm_fake(bank, residual, query, norm_weight, res_eps, norm_eps, norm_pdl, tail_warps, tail_block_n,
                                x,
                                topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up, shared_w2,
                                act, beta, linear_beta, crossover, latent_up_w=None, latent_norm_w=None,
                                latent_eps=1e-5, use_pdl=False, shared_w13=None, down_split=None,
                                shared_l2_prefetch=False, down_l2_prefetch=False, up_launch=None, flag_deps=False,
                                early_release=False, down_early_release=False, latent_prewait=False,
                                grouped_sorted=False, sorted_finish=False, routed_l2_prefetch=False,
                                up_prewait=False):
    check_args(bank, residual, query, norm_weight, x, latent_up_w)
    y = torch.ops.k3.fused_moe_decode(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, shared_in, shared_up,
                                      shared_w2, act, beta, linear_beta, crossover, latent_up_w, latent_norm_w,
                                      latent_eps, use_pdl, shared_w13)  # its fake: checks the MoE half, y's shape
    return y.new_empty(y.shape, dtype=arn._out_dtype(y, norm_weight)), torch.empty_like(y)
