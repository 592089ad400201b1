"""Small-M GEMM (decode GEMV): y = x @ w.T (+ c), a Triton split-K kernel for M <= 16 rows.

The op pass P8 puts in place of `mm(x, t(w))` where the kernel measured faster than cuBLAS at
build time (and into which P11 folds the add that follows):

    torch.ops.k3.gemv(x [M, K], w [N, K], c [N] | [M, N] | None, max_m, block_n, block_k, split_k, design=0,
                      use_pdl=False, num_warps=4, l2_prefetch_kb=0, early_release=False) -> [M, N]

* Semantics: exactly `torch.mm(x, w.t())`, and with c, `torch.mm(x, w.t()) + c`: the product is
  rounded to x's dtype before c is added, as in the unfused graph (a 16-bit addmm, which rounds
  once, drifts from it: 1.3% in the logits of a bf16 k3-tiny step with every pass). The CPU
  implementation (and CUDA whenever M > max_m, or a shape the kernel does not take) *is* those aten
  calls, so a rewritten graph is bit-identical to the original wherever the kernel does not run.
* The kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1): one program per (BLOCK_N columns,
  K split); rows padded to 16 for `tl.dot` (tf32 on fp32 copies of the 16-bit inputs: exact products);
  fp32 accumulation. With split_k > 1 each program stores
  its partial sums in an fp32 workspace and bumps a per-column-tile counter; the program that arrives
  last sums the partials, rounds, adds c, writes y and resets the counter, so the GEMV stays one launch (no
  zero-fill, no second reduction kernel). The counters are kernels.arrivals' buffer for owner "gemv", zero
  between launches; two split-K launches running at once on two streams would share them (no pass does that).
* Two designs (`design`), chosen per shape by P8's measurement:
  0 "dot": the kernel above, rows padded to 16 for tensor cores; any M <= 16.
  1 "rows" (M <= ROWS_MAX_M): no tensor cores; each program multiplies a [BLOCK_N, BLOCK_K] weight tile
    by every x row in registers, products summed in place and reduced once after the loop (no
    padding to 16 rows, no layout change of the weights through shared memory). At batch 1-4 a
    decode GEMV is bound by the bytes in flight, not by FLOPs, so this is the design that can approach
    the copy bandwidth; split-K and the last-arrival reduction are as in "dot".
* PDL (`use_pdl`, P8's option): launched with programmatic dependent launch (kernels/pdl.py), a program
  loads its first K step's weight tile before `gdc_wait()` (x comes from the previous kernel) and calls
  `gdc_launch_dependents()` once its x is read, so the next kernel's launch overlaps the epilogue. The
  accumulation order is the same with and without it.
* L2 prefetch (`l2_prefetch_kb`, P8's `l2_prefetch_mb`; with PDL only): before its gdc_wait each of the launch's
  first programs, as many as the budget covers, asks L2 for its whole weight slice (kernels/l2_prefetch.py).
  The previous kernel in a decode step is often latency-bound (the KDA recurrence, MLA attention, a norm) and
  leaves HBM idle; the GEMV's loads after the wait then hit L2. Same loads, same order: the same bits.
* Early release (`early_release`, P8's option; with PDL only): `gdc_launch_dependents()` right after the wait
  instead of after the K loop, so the next kernel (the fused KDA kernel after an in-projection) is resident and loads
  its weights and state while this GEMV streams. Safe for the same reason as the late call: every kernel of the
  chain waits before it releases, and the next one waits for this whole grid before it reads y.
* max_m / block_n / block_k / split_k / design / num_warps are plain ints in the schema: the pass records the
  tuned configuration per node, and the serialized engine carries it. num_warps and then l2_prefetch_kb are last
  with defaults (4 warps, no prefetch: what every launch did before they were in the schema), so an engine
  written without them loads and runs as before; early_release (a bool) comes after them, for the same reason.
* Upper tiers (`upper`, P8's `upper_tier`; last, default None): rows of (max_m, block_n, block_k, split_k, design,
  num_warps), flattened, for M above max_m: the first row whose max_m covers M launches its configuration, above
  them all the aten calls run. The token count is static per captured graph (one CUDA graph per decode batch), so a
  graph always takes one branch. Why: the configuration that wins at M = 1 (the rows design) loses at M = 8, where
  cuBLAS then ran, at the 48B o_proj / dense down as a split-K GEMM + reduce pair (two kernels), while a split-K
  dot tile in one kernel was as fast (traces/h200_s13/call2).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import arrivals, l2_prefetch
from .pdl import pdl_for

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op still works through aten
    triton = None

BLOCK_M = 16  # tl.dot's smallest tile: M <= 16 rows are padded to it
MAX_M = 16
ROWS_MAX_M = 4  # the "rows" design keeps M_PAD x BLOCK_N x BLOCK_K fp32 products in registers
DESIGNS = {"dot": 0, "rows": 1}
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
NUM_WARPS = (1, 2, 4, 8, 16)  # warps per program Triton can launch with


# --------------------------------------------------------------------------- argument checks

def check_gemv_args(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, max_m: int, block_n: int,
                    block_k: int, split_k: int, design: int = 0, num_warps: int = 4) -> None:
    """Raise ValueError naming the first thing wrong with a gemv call."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"gemv: x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: x has K = {x.shape[1]} columns but w has K = {w.shape[1]}")
    if x.dtype != w.dtype:
        raise ValueError(f"gemv: x is {x.dtype} but w is {w.dtype}")
    if c is not None and not (c.dim() == 1 and c.shape[0] == w.shape[0]
                              or c.dim() == 2 and tuple(c.shape) == (x.shape[0], w.shape[0])):
        raise ValueError(f"gemv: c must be [N] = [{w.shape[0]}] or [M, N] = [{x.shape[0]}, {w.shape[0]}], "
                         f"got {tuple(c.shape)}")
    if not 1 <= max_m <= MAX_M:
        raise ValueError(f"gemv: max_m must be in 1..{MAX_M}, got {max_m}")
    if design not in DESIGNS.values():
        raise ValueError(f"gemv: design must be one of {DESIGNS} (name: value), got {design}")
    if design == DESIGNS["rows"] and max_m > ROWS_MAX_M:
        raise ValueError(f"gemv: the rows design takes at most {ROWS_MAX_M} rows, got max_m {max_m}")
    least_n = 16 if design == DESIGNS["dot"] else 1  # tl.dot's tile; the rows design takes any power of two
    for name, v, least in (("block_n", block_n, least_n), ("block_k", block_k, 16)):
        if v < least or v & (v - 1):
            raise ValueError(f"gemv: {name} must be a power of two >= {least}, got {v}")
    if split_k < 1:
        raise ValueError(f"gemv: split_k must be >= 1, got {split_k}")
    if num_warps not in NUM_WARPS:
        raise ValueError(f"gemv: num_warps must be one of {NUM_WARPS}, got {num_warps}")


UPPER_ROW = 6  # an upper tier's fields: max_m, block_n, block_k, split_k, design, num_warps


def upper_rows(upper) -> list[tuple[int, ...]]:
    """The upper tiers of a gemv call (its flattened `upper` argument) as rows; [] for None."""
    if upper is None:
        return []
    if len(upper) % UPPER_ROW:
        raise ValueError(f"gemv: upper must be rows of {UPPER_ROW} ints (max_m, block_n, block_k, split_k, design, "
                         f"num_warps), got {len(upper)} ints")
    return [tuple(int(v) for v in upper[i:i + UPPER_ROW]) for i in range(0, len(upper), UPPER_ROW)]


def flat_upper(rows) -> list[int]:
    """Rows of (max_m, block_n, block_k, split_k, design, num_warps) as the op's `upper` argument."""
    return [int(v) for row in rows for v in row]


def check_upper(upper, max_m: int) -> None:
    """Raise ValueError naming the first thing wrong with a gemv call's upper tiers: each row a valid configuration
    (as check_gemv_args checks the first), the rows' max_m increasing above the call's max_m."""
    last = max_m
    for row in upper_rows(upper):
        m, bn, bk, split, design, warps = row
        if m <= last:
            raise ValueError(f"gemv: an upper tier's max_m must exceed the tier before it ({last}), got {row}")
        if not 1 <= m <= MAX_M or design not in DESIGNS.values() \
                or design == DESIGNS["rows"] and m > ROWS_MAX_M or split < 1 or warps not in NUM_WARPS:
            raise ValueError(f"gemv: upper tier {row} is not a configuration the kernel takes (max_m <= {MAX_M}, "
                             f"the rows design <= {ROWS_MAX_M} rows, split_k >= 1, warps in {NUM_WARPS})")
        least_n = 16 if design == DESIGNS["dot"] else 1
        for v, least in ((bn, least_n), (bk, 16)):
            if v < least or v & (v - 1):
                raise ValueError(f"gemv: upper tier {row}: block sizes must be powers of two (block_n >= {least_n}, "
                                 f"block_k >= 16)")
        last = m


def tier_for(m: int, max_m: int, config: tuple, upper=None) -> tuple[int, tuple] | None:
    """(the tier's max_m, (block_n, block_k, split_k, design, num_warps)) that launches for m rows: the call's own
    configuration up to max_m, else the first upper tier covering m; None: the aten calls (m above every tier)."""
    if m <= max_m:
        return max_m, tuple(config)
    for row in upper_rows(upper):
        if m <= row[0]:
            return row[0], row[1:]
    return None


def gemv_reference(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """The aten calls the passes replaced (bit-identical to the unpassed graph)."""
    y = torch.mm(x, w.t())
    return y if c is None else y + c


# --------------------------------------------------------------------------- Triton kernel

if triton is not None:
    from .l2_prefetch import prefetch_rows_l2

    @triton.jit
    def _finish(acc, rm, rn, m_ok, n_ok, pid_n, pid_k, c_ptr, y_ptr, ws_ptr, cnt_ptr, N, scm, scn, sym, syn,
                HAS_C: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
        """Both designs' epilogue: store y (+ c after rounding the product, as mm then add does), or with split-K
        store the partial to the workspace [SPLIT_K, ROWS, N] and let the column tile's last program sum the
        partials in split order (the sum does not depend on which split arrived last), store y and zero its counter."""
        out_mask = m_ok[:, None] & n_ok[None, :]
        last = True
        if SPLIT_K > 1:
            tile = rm[:, None] * N + rn[None, :]
            tl.store(ws_ptr + pid_k * ROWS * N + tile, acc, mask=out_mask)
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            last = arrived == SPLIT_K - 1
            if last:
                acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
                for s in range(SPLIT_K):
                    acc += tl.load(ws_ptr + s * ROWS * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + pid_n, 0)  # zero again for the next launch
        if last:
            if HAS_C:
                c = tl.load(c_ptr + rm[:, None] * scm + rn[None, :] * scn, mask=out_mask, other=0.0)
                acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32) + c.to(tl.float32)
            tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


    @triton.jit
    def _w_tile(w_ptr, rn, n_ok, k_start, k0, k_per_split, K, swn, swk, BLOCK_K: tl.constexpr):
        """The [BLOCK_N, BLOCK_K] weight tile of K step k0 (and rk, k_ok): constants, loadable before gdc_wait."""
        kk = tl.arange(0, BLOCK_K)
        rk = k_start + k0 + kk
        k_ok = (rk < K) & (k0 + kk < k_per_split)
        return tl.load(w_ptr + rn[:, None] * swn + rk[None, :] * swk, mask=n_ok[:, None] & k_ok[None, :], other=0.0), \
            rk, k_ok

    @triton.jit
    def _prefetch_weights(w_ptr, pid_n, pid_k, k_start, N, K, swn, k_per_split, pf_programs, BLOCK_N: tl.constexpr,
                          PIECES: tl.constexpr):
        """The launch's first pf_programs programs (in the order the GPU starts them: pid_n fastest) ask L2 for their
        whole weight slice, so the programs resident while the previous kernel runs stream during it; later ones
        would only delay their own loads (measured: prefetching a part of every program's slice made the 48B step
        2-6% slower). Never past K: the host made K's bytes and the row pitch 16-byte multiples (region_ok)."""
        if pid_n + pid_k * tl.num_programs(0) < pf_programs:
            n0 = pid_n * BLOCK_N
            rows = tl.minimum(N - n0, BLOCK_N)
            esize = w_ptr.dtype.element_ty.primitive_bitwidth // 8
            seg = tl.minimum(k_per_split, K - k_start) * esize
            prefetch_rows_l2(w_ptr + n0.to(tl.int64) * swn + k_start, rows, seg, swn * esize, PIECES)

    @triton.jit
    def _dot_product(acc, x, w):
        """acc + x [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T (the dot design's step; kernels/norm_gemv.py too)."""
        # bf16/fp16 values are exact in tf32: the tensor-core product equals the 16-bit one (and the
        # CPU interpreter, whose 16-bit dot is wrong, computes the same thing)
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="tf32")

    @triton.jit
    def _rows_product(acc3, x, w):
        """acc3 [M_PAD, BLOCK_N, BLOCK_K] + every x row times the weight tile (the rows design's step), summed later."""
        return acc3 + w.to(tl.float32)[None, :, :] * x.to(tl.float32)

    @triton.jit
    def _dot_step(acc, w, x_ptr, rm, m_ok, rk, k_ok, sxm, sxk):
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        return _dot_product(acc, x, w)

    @triton.jit
    def _rows_step(acc3, w, x_ptr, rm, rn, m_ok, n_ok, rk, k_ok, sxm, sxk):
        # x through a pointer tile shaped like the products (same register layout as w's: no shuffle
        # through shared memory); the repeated reads of a row come from L1
        xmask = m_ok[:, None, None] & n_ok[None, :, None] & k_ok[None, None, :]
        x = tl.load(x_ptr + rm[:, None, None] * sxm + rk[None, None, :] * sxk + 0 * rn[None, :, None],
                    mask=xmask, other=0.0)
        return _rows_product(acc3, x, w)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, c_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split,
                     sxm, sxk, swn, swk, scm, scn, sym, syn,
                     HAS_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr, PEEL: tl.constexpr, pf_programs=0,
                     L2_PF: tl.constexpr = False, PIECES: tl.constexpr = 128, EARLY: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_first = 0
        if L2_PF:  # ask L2 for this program's weight rows while the previous kernel runs (kernels/l2_prefetch.py)
            _prefetch_weights(w_ptr, pid_n, pid_k, k_start, N, K, swn, k_per_split, pf_programs, BLOCK_N, PIECES)
        if PEEL:  # the first K step's weights load while the previous kernel (x's producer) finishes
            w, rk, k_ok = _w_tile(w_ptr, rn, n_ok, k_start, 0, k_per_split, K, swn, swk, BLOCK_K)
            if USE_PDL:
                tl.extra.cuda.gdc_wait()
                if EARLY:  # release the next kernel now: its programs load their weights while we stream ours
                    tl.extra.cuda.gdc_launch_dependents()
            acc = _dot_step(acc, w, x_ptr, rm, m_ok, rk, k_ok, sxm, sxk)
            k_first = BLOCK_K
        for k0 in range(k_first, k_per_split, BLOCK_K):
            w, rk, k_ok = _w_tile(w_ptr, rn, n_ok, k_start, k0, k_per_split, K, swn, swk, BLOCK_K)
            acc = _dot_step(acc, w, x_ptr, rm, m_ok, rk, k_ok, sxm, sxk)
        if USE_PDL and not EARLY:  # x is read: the next kernel may launch (it waits for this one before reading y)
            tl.extra.cuda.gdc_launch_dependents()
        _finish(acc, rm, rn, m_ok, n_ok, pid_n, pid_k, c_ptr, y_ptr, ws_ptr, cnt_ptr, N, scm, scn, sym, syn,
                HAS_C, BLOCK_M, BLOCK_N, SPLIT_K)

    @triton.jit
    def _gemv_rows_kernel(x_ptr, w_ptr, c_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split,
                          sxm, sxk, swn, swk, scm, scn, sym, syn,
                          HAS_C: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr, PEEL: tl.constexpr, pf_programs=0,
                          L2_PF: tl.constexpr = False, PIECES: tl.constexpr = 128, EARLY: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, M_PAD)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc3 = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_first = 0
        if L2_PF:  # ask L2 for this program's weight rows while the previous kernel runs (kernels/l2_prefetch.py)
            _prefetch_weights(w_ptr, pid_n, pid_k, k_start, N, K, swn, k_per_split, pf_programs, BLOCK_N, PIECES)
        if PEEL:  # the first K step's weights load while the previous kernel (x's producer) finishes
            w, rk, k_ok = _w_tile(w_ptr, rn, n_ok, k_start, 0, k_per_split, K, swn, swk, BLOCK_K)
            if USE_PDL:
                tl.extra.cuda.gdc_wait()
                if EARLY:  # release the next kernel now: its programs load their weights while we stream ours
                    tl.extra.cuda.gdc_launch_dependents()
            acc3 = _rows_step(acc3, w, x_ptr, rm, rn, m_ok, n_ok, rk, k_ok, sxm, sxk)
            k_first = BLOCK_K
        for k0 in range(k_first, k_per_split, BLOCK_K):
            w, rk, k_ok = _w_tile(w_ptr, rn, n_ok, k_start, k0, k_per_split, K, swn, swk, BLOCK_K)
            acc3 = _rows_step(acc3, w, x_ptr, rm, rn, m_ok, n_ok, rk, k_ok, sxm, sxk)
        if USE_PDL and not EARLY:  # x is read: the next kernel may launch (it waits for this one before reading y)
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.sum(acc3, axis=2)  # [M_PAD, BLOCK_N]
        _finish(acc, rm, rn, m_ok, n_ok, pid_n, pid_k, c_ptr, y_ptr, ws_ptr, cnt_ptr, N, scm, scn, sym, syn,
                HAS_C, M_PAD, BLOCK_N, SPLIT_K)


def kernel_supports(x: torch.Tensor, w: torch.Tensor, max_m: int, design: int = 0) -> bool:
    most = ROWS_MAX_M if design == DESIGNS["rows"] else MAX_M
    return (triton is not None and x.shape[0] <= min(max_m, most) and x.dtype in KERNEL_DTYPES
            and w.dtype == x.dtype)


def gemv_triton(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None = None, block_n: int = 64,
                block_k: int = 128, split_k: int = 1, num_warps: int = 4, design: int = 0,
                use_pdl: bool = False, l2_prefetch_kb: int = 0, early_release: bool = False) -> torch.Tensor:
    """Launch the kernel of `design` (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). use_pdl: launch
    with programmatic dependent launch where kernels/pdl.py says it exists; the first K step is peeled (its weights
    load before the wait) whenever it is asked for, so the interpreter runs that code too. l2_prefetch_kb: with
    PDL, the launch asks L2 for up to this many KiB of its weight before the wait (`prefetch_plan`). early_release: with
    PDL, release the next kernel right after the wait instead of after the K loop (same sums)."""
    rows = design == DESIGNS["rows"]
    most = ROWS_MAX_M if rows else MAX_M
    check_gemv_args(x, w, c, most, block_n, block_k, split_k, design, num_warps)
    if triton is None:
        raise RuntimeError("gemv: triton is not installed")
    m, k = x.shape
    n = w.shape[0]
    if m > most:
        raise ValueError(f"gemv kernel: at most {most} rows in the {'rows' if rows else 'dot'} design, got {m}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if c is None else y.copy_(c.expand(m, n))
    tiles, k_per_split, split_k, ws, cnt = split_plan(m, n, k, block_n, block_k, split_k, rows, x.device, "gemv")
    ws, cnt = (y, y) if ws is None else (ws, cnt)  # split_k 1: unused pointer slots
    if c is None:
        c_arg, scm, scn = y, 0, 0
    else:
        c_arg = c
        scm, scn = (0, c.stride(0)) if c.dim() == 1 else (c.stride(0), c.stride(1))
    args = (x, w, c_arg, y, ws, cnt, m, n, k, k_per_split,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), scm, scn, y.stride(0), y.stride(1))
    pdl = pdl_for(use_pdl, x)
    extra = {"launch_pdl": True} if pdl else {}
    pf_programs = prefetch_plan(w, block_n, split_k, k_per_split, l2_prefetch_kb) if pdl else 0
    if pf_programs:
        extra.update(pf_programs=pf_programs, L2_PF=True, PIECES=32 * num_warps)
    if pdl and early_release:
        extra["EARLY"] = True
    if rows:
        _gemv_rows_kernel[(tiles, split_k)](*args, HAS_C=c is not None, M_PAD=triton.next_power_of_2(m),
                                            BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, USE_PDL=pdl, PEEL=bool(use_pdl),
                                            num_warps=num_warps, **extra)
    else:
        _gemv_kernel[(tiles, split_k)](*args, HAS_C=c is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                                       SPLIT_K=split_k, USE_PDL=pdl, PEEL=bool(use_pdl), num_warps=num_warps, **extra)
    return y


def prefetch_plan(w: torch.Tensor, block_n: int, split_k: int, k_per_split: int, l2_prefetch_kb: int) -> int:
    """How many of the launch's first programs ask L2 for their weight slice (block_n rows x one K split) before
    their gdc_wait: as many whole slices as fit the budget (l2_prefetch_kb KiB), at most every program; 0 (no
    prefetch) without a budget or where the bulk prefetch's alignment does not hold (rows not contiguous, a row
    pitch or K's bytes not a multiple of 16, an unaligned weight pointer)."""
    n, k = w.shape
    esize = w.element_size()
    if l2_prefetch_kb <= 0 or w.stride(1) != 1 or (k * esize) % l2_prefetch.ALIGN \
            or not l2_prefetch.region_ok(w, w.stride(0) * esize):
        return 0
    programs = -(-n // block_n) * split_k
    return min(programs, (l2_prefetch_kb * 1024) // (block_n * k_per_split * esize))


def split_plan(m: int, n: int, k: int, block_n: int, block_k: int, split_k: int, rows: bool, device,
               owner: str):
    """(column tiles, k_per_split, split_k, workspace, counters) of a launch of either design: each split covers a
    whole number of BLOCK_K steps and none is empty; with one split there is no workspace (None, None). The
    workspace is [split_k, rows padded as the design pads them, n] fp32; the counters are `owner`'s."""
    tiles = triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k == 1:
        return tiles, k_per_split, 1, None, None
    ws = torch.empty(split_k, triton.next_power_of_2(m) if rows else BLOCK_M, n, dtype=torch.float32, device=device)
    return tiles, k_per_split, split_k, ws, arrivals.arrival_counters(device, tiles, owner=owner)


def default_config(n: int, k: int, sm_count: int = 132) -> tuple[int, int, int]:
    """(block_n, block_k, split_k) that gives about two programs per SM: split K when N alone has too few
    column tiles (a down-projection: small N, large K)."""
    block_n, block_k = 64, 128
    tiles = -(-n // block_n)
    split_k = 1
    while tiles * split_k < 2 * sm_count and k // (split_k * 2) >= 2 * block_k and split_k < 32:
        split_k *= 2
    return block_n, block_k, split_k


ROWS_TILE = 4096  # weights per program and K step in the rows design (8 KiB of bf16; fp32 products in place)
ROWS_TARGET_PROGRAMS = 528  # >= 4 programs per SM of an H200 (132): short programs keep every SM streaming


def rows_configs(n: int, k: int, target_programs: int = ROWS_TARGET_PROGRAMS) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, split_k, design) candidates of the rows design: a narrow and a wide row block, each
    with the fewest K splits that give `target_programs` programs (splits keep >= one K step each)."""
    out = []
    for block_n in (4, 16):
        block_k = max(16, min(ROWS_TILE // block_n, triton.next_power_of_2(k)))
        tiles, split = -(-n // block_n), 1
        while tiles * split < target_programs and k // (split * 2) >= block_k and split < 32:
            split *= 2
        out.append((block_n, block_k, split, DESIGNS["rows"]))
    return out


# --------------------------------------------------------------------------- the k3 op

def run_gemv(x, w, c, max_m, block_n, block_k, split_k, design=0, use_pdl=False, num_warps=4, l2_prefetch_kb=0,
             early_release=False, upper=None) -> torch.Tensor:
    """What k3.gemv launches on CUDA (and on CPU tensors under TRITON_INTERPRET=1): the kernel in the tier that
    covers x's rows (`tier_for`), the aten calls where no tier does or the kernel does not take the call."""
    tier = tier_for(x.shape[0], max_m, (block_n, block_k, split_k, design, num_warps), upper)
    if tier is not None and kernel_supports(x, w, tier[0], tier[1][3]):
        bn, bk, split, des, warps = tier[1]
        return gemv_triton(x, w, c, bn, bk, split, num_warps=warps, design=des, use_pdl=use_pdl,
                           l2_prefetch_kb=l2_prefetch_kb, early_release=early_release)
    return gemv_reference(x, w, c)


@torch.library.custom_op("k3::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, max_m: int, block_n: int, block_k: int,
         split_k: int, design: int = 0, use_pdl: bool = False, num_warps: int = 4,
         l2_prefetch_kb: int = 0, early_release: bool = False, upper: Optional[list[int]] = None) -> torch.Tensor:
    """y = x @ w.T (then + c): the aten calls (CPU, or rows above every tier); see the module doc."""
    check_gemv_args(x, w, c, max_m, block_n, block_k, split_k, design, num_warps)
    check_upper(upper, max_m)
    return gemv_reference(x, w, c)


@gemv.register_kernel("cuda")
def _gemv_cuda(x, w, c, max_m, block_n, block_k, split_k, design=0, use_pdl=False, num_warps=4, l2_prefetch_kb=0,
               early_release=False, upper=None):
    check_gemv_args(x, w, c, max_m, block_n, block_k, split_k, design, num_warps)
    check_upper(upper, max_m)
    with torch.cuda.device(x.device):  # Triton launches on the current device
        return run_gemv(x, w, c, max_m, block_n, block_k, split_k, design, use_pdl, num_warps, l2_prefetch_kb,
                        early_release, upper)


@gemv.register_fake
def _gemv_fake(x, w, c, max_m, block_n, block_k, split_k, design=0, use_pdl=False, num_warps=4, l2_prefetch_kb=0,
               early_release=False, upper=None):
    check_gemv_args(x, w, c, max_m, block_n, block_k, split_k, design, num_warps)
    check_upper(upper, max_m)
    return x.new_empty(x.shape[0], w.shape[0])
