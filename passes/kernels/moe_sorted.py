"""Sorted, M-tiled fused MoE: the routed experts of a batch above P6's crossover, each expert's weights read once.

Below the crossover P6's GEMV kernels (moe_decode A / B') read an expert's weights once per token that chose it.
At batch 64 the build-time crossover hands the layer to `torch._grouped_mm`, which reads them once but runs the
sort, the gathers, the GLU (12 ATen kernels for SiTU) and the weighted sum as separate kernels, with CUTLASS tiles of
128 rows for experts that see ~2-8 tokens (traces/h200_s15: ~24% of the MoE bytes' roofline at k3-mini-6b, ~49% at
Kimi-Linear-48B). Here the same work is four launches (the fused-MoE design of vLLM and TensorRT-LLM, in our code):

  align  `_expert_align_kernel`, one program: the (token, choice) pairs p = t k + s sorted by expert, each
         expert's run padded to a multiple of BLOCK_M. pairs[b BLOCK_M + r] = the pair in row r of block b, or P
         (= N k, a padding row); block_expert[b] = block b's expert, E past the last block. The grid of the next two
         kernels is static (CUDA graphs): max_blocks(P, E, BLOCK_M) blocks; a block without an expert returns at once.
  up     `_expert_sorted_up_kernel`, one program per (block, column block of I): x's rows of the block's pairs (a
         gather) times the expert's gate and up rows, both by tl.dot over D in fp32, the GLU in registers; h
         [blocks BLOCK_M, I] in x's dtype (the reference rounds the activation to it as well).
  down   `_expert_sorted_down_kernel`, one program per (block, column block of Do): h's rows times the expert's W2
         block, times the pair's routing weight, stored as the pair's fp32 row rows[p] ([P, Do]: each pair's own
         row, so no atomics and the sum below is in a fixed order).
  sum    rows.view(N, k, Do).sum(1) in fp32, cast to x's dtype (ATen); or (`finish`, P6's `sorted_finish`)
         `_expert_finish_kernel`, one program per token: the same sum and rounding, and for a latent MoE K3's
         RMSNorm of it in the same kernel (the ATen chain is ~7 kernels a layer).

`moe_experts_sorted` has `model_def.ops.moe_math.moe_experts_loop`'s contract (its exact reference); P6's op runs it
as its grouped path when the pass option `grouped_sorted` is on (kernels.moe_decode.fused_moe_grouped). Weights in
bf16 or MXFP4 (decoded in registers: E2M1 x E8M0, each code byte's two inputs as two half-K dots). Under
TRITON_INTERPRET=1 (set before this module is imported) the kernels run on CPU tensors
(tests/passes/kernels/interpret_moe_sorted.py).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: P6's op runs its reference there
    triton = None

ACTS = {"silu": 0, "situ": 1}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernels are decorated, as Triton does


class SortedLaunch(NamedTuple):
    """One shape's tiles: rows per block, up's and down's column block and K step, warps and pipeline stages."""
    block_m: int = 16
    up_n: int = 64
    up_k: int = 128
    down_n: int = 64
    down_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_LAUNCH = SortedLaunch()
WIDE_LAUNCH = SortedLaunch(block_m=32)
WIDE_FROM_PAIRS_PER_EXPERT = 16


def sorted_launch(pairs: int, num_experts: int) -> SortedLaunch:
    """The launch for P pairs over E experts: 32-row blocks once the mean expert holds >= 16 pairs, else 16. From one
    MoE layer on the H200 (traces/h200_s16/call1/sorted16.md, experts alone, µs, m16 / m32): k3-mini-6b batch 256
    (21 pairs an expert) 229.2 / 212.4; batch 64 (5.3) 128.2 / 133.3; 48B batch 256 (8) 1034.1 / 1038.9."""
    return WIDE_LAUNCH if pairs >= WIDE_FROM_PAIRS_PER_EXPERT * num_experts else DEFAULT_LAUNCH


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Most blocks the align step can produce: sum_e ceil(c_e / M) <= P / M + experts hit <= cdiv(P, M) + min(E, P)."""
    return -(-pairs // block_m) + min(num_experts, pairs)


if triton is not None:
    from .moe_decode import _e2m1_x2p14, _glu  # the GEMV kernels' SiLU / SiTU-GLU and E2M1 decode, shared

    @triton.jit
    def _expert_align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, P, E, MAX_BLOCKS, BLOCK_M: tl.constexpr,
                             BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
        """One program. Per-expert counts, then each pair's rank among the earlier pairs of its expert (a running
        count per expert, chunk by chunk), its row = the expert's first block x BLOCK_M + rank; then every block's
        expert and its padding rows. Experts are compared against a [CHUNK, BLOCK_E] one-hot (no gathers from
        register vectors, no atomics: the same result on every run)."""
        experts = tl.arange(0, BLOCK_E)
        live = experts < E
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for c0 in range(0, P, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            e_j = tl.load(ids_ptr + j, mask=j < P, other=-1).to(tl.int32)
            counts += tl.sum((e_j[:, None] == experts[None, :]).to(tl.int32), axis=0)
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_end = tl.cumsum(blocks, axis=0)
        first_row = (block_end - blocks) * BLOCK_M
        seen = tl.zeros([BLOCK_E], dtype=tl.int32)
        for c0 in range(0, P, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            e_j = tl.load(ids_ptr + j, mask=j < P, other=-1).to(tl.int32)
            hot = (e_j[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
            i = tl.arange(0, CHUNK)
            before = (e_j[:, None] == e_j[None, :]) & (i[None, :] < i[:, None])  # earlier pairs of this chunk
            row = tl.sum(hot * (first_row + seen)[None, :], axis=1) + tl.sum(before.to(tl.int32), axis=1)
            tl.store(pairs_ptr + row, j, mask=j < P)
            seen += tl.sum(hot, axis=0)
        total = tl.sum(tl.where(live, blocks, 0), axis=0)
        for b0 in range(0, MAX_BLOCKS, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            e_b = tl.sum(((block_end[None, :] <= b[:, None]) & live[None, :]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, e_b, mask=b < MAX_BLOCKS)
            hot = (e_b[:, None] == experts[None, :]).to(tl.int32)
            # rows of block b already holding a pair: the expert's count less the rows of its earlier blocks
            rows_before = (b - tl.sum(hot * (first_row // BLOCK_M)[None, :], axis=1)) * BLOCK_M
            used = tl.sum(hot * counts[None, :], axis=1) - rows_before
            r = tl.arange(0, BLOCK_M)
            pad = (r[None, :] >= used[:, None]) | (b[:, None] >= total)
            tl.store(pairs_ptr + b[:, None] * BLOCK_M + r[None, :], P + 0 * r[None, :],
                     mask=pad & (b[:, None] < MAX_BLOCKS))

    @triton.jit
    def _mma(acc, a, w, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ w in fp32: 16-bit operands on the tensor cores, or (UPCAST: the interpreter, whose 16-bit dot is
        wrong) as fp32 copies, exact for 16-bit values."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
        return tl.dot(a.to(w.dtype), w, acc, input_precision=PRECISION)

    @triton.jit
    def _dense_step(acc, a_ptr, a_row, valid, w_ptr, cols, cmask, k0, K, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc + A[:, k0:k0+BLOCK_K] @ W[cols, k0:k0+BLOCK_K].T: A's rows at a_ptr + a_row (K contiguous), W [*, K]."""
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(a_ptr + a_row[:, None] + ks[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=kmask[:, None] & cmask[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]
        return _mma(acc, a, w, PRECISION, UPCAST)

    @triton.jit
    def _mxfp4_step(acc, a_ptr, a_row, valid, q_ptr, s_ptr, cols, cmask, k0, K, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
        """_dense_step with W in MXFP4 (codes [*, K/2] at q_ptr, E8M0 scales [*, K/32] at s_ptr): each code byte holds
        inputs 2j (low nibble) and 2j+1 (high), so the step is two dots of K = BLOCK_K / 2, A's even inputs with the
        low nibbles' values and its odd inputs with the high ones' (no interleaving in registers). Values decoded
        exactly (E2M1 x 2^(s - 127)) and rounded to A's dtype for the tensor cores: exact for scales in its range."""
        j = tl.arange(0, BLOCK_K // 2)
        even = k0 + 2 * j
        jmask = even < K
        amask = valid[:, None] & jmask[None, :]
        a_even = tl.load(a_ptr + a_row[:, None] + even[None, :], mask=amask, other=0.0)
        a_odd = tl.load(a_ptr + a_row[:, None] + even[None, :] + 1, mask=amask, other=0.0)
        wmask = jmask[:, None] & cmask[None, :]
        row = cols[None, :].to(tl.int64)
        code = tl.load(q_ptr + row * (K // 2) + (k0 // 2 + j)[:, None], mask=wmask, other=0).to(tl.int32)
        scale = tl.load(s_ptr + row * (K // 32) + (even // 32)[:, None], mask=wmask, other=127)
        factor = tl.exp2(scale.to(tl.float32) - (127.0 - 14.0))  # _e2m1_x2p14 leaves out 2^14
        lo = (_e2m1_x2p14(code & 15) * factor).to(a_even.dtype)
        hi = (_e2m1_x2p14(code >> 4) * factor).to(a_even.dtype)
        return _mma(_mma(acc, a_even, lo, PRECISION, UPCAST), a_odd, hi, PRECISION, UPCAST)

    @triton.jit
    def _block_rows(pairs_ptr, block, P, K_TOP, BLOCK_M: tl.constexpr):
        """(h rows, pair, valid, token) of a block's BLOCK_M rows."""
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + rows)
        valid = pair < P
        return rows, pair, valid, tl.where(valid, pair // K_TOP, 0)

    @triton.jit
    def _expert_weights(w_ptr, s_ptr, e, R, K, MXFP4: tl.constexpr):
        """Expert e's [R, K] weight: its dense rows, or its MXFP4 codes [R, K/2] and scales [R, K/32] (s_ptr unread
        when dense)."""
        if MXFP4:
            w, s = w_ptr + e.to(tl.int64) * R * (K // 2), s_ptr + e.to(tl.int64) * R * (K // 32)
        else:
            w, s = w_ptr + e.to(tl.int64) * R * K, s_ptr
        return w, s

    @triton.jit
    def _k_step(acc, a_ptr, a_row, valid, w_ptr, s_ptr, cols, cmask, k0, K, MXFP4: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
        """One K step of acc + A @ W[cols].T in either weight format (_dense_step / _mxfp4_step)."""
        if MXFP4:  # constexpr: only the taken branch is compiled (an early return would compile both)
            acc = _mxfp4_step(acc, a_ptr, a_row, valid, w_ptr, s_ptr, cols, cmask, k0, K, PRECISION, UPCAST, BLOCK_K)
        else:
            acc = _dense_step(acc, a_ptr, a_row, valid, w_ptr, cols, cmask, k0, K, PRECISION, UPCAST, BLOCK_K)
        return acc

    @triton.jit
    def _expert_sorted_up_kernel(x_ptr, stride_x, w13_ptr, s13_ptr, pairs_ptr, block_expert_ptr, h_ptr, P, E, K_TOP,
                                 D, I, beta, linear_beta, ACT: tl.constexpr, MXFP4: tl.constexpr,
                                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        block = tl.program_id(0)
        e = tl.load(block_expert_ptr + block)
        if e < E:
            rows, pair, valid, tok = _block_rows(pairs_ptr, block, P, K_TOP, BLOCK_M)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < I
            a_row = tok.to(tl.int64) * stride_x
            w, sc = _expert_weights(w13_ptr, s13_ptr, e, 2 * I, D, MXFP4)
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):  # gate rows [0, I), up rows [I, 2I), both at each K step
                acc_g = _k_step(acc_g, x_ptr, a_row, valid, w, sc, cols, cmask, k0, D, MXFP4, PRECISION, UPCAST,
                                BLOCK_K)
                acc_u = _k_step(acc_u, x_ptr, a_row, valid, w, sc, cols + I, cmask, k0, D, MXFP4, PRECISION, UPCAST,
                                BLOCK_K)
            h = _glu(acc_g, acc_u, beta, linear_beta, ACT)
            tl.store(h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=valid[:, None] & cmask[None, :])

    @triton.jit
    def _expert_sorted_down_kernel(h_ptr, w2_ptr, s2_ptr, pairs_ptr, block_expert_ptr, wts_ptr, out_ptr, P, E,
                                   K_TOP, I, DO, MXFP4: tl.constexpr, PRECISION: tl.constexpr,
                                   UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr):
        block = tl.program_id(0)
        e = tl.load(block_expert_ptr + block)
        if e < E:
            rows, pair, valid, tok = _block_rows(pairs_ptr, block, P, K_TOP, BLOCK_M)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < DO
            w, sc = _expert_weights(w2_ptr, s2_ptr, e, DO, I, MXFP4)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                acc = _k_step(acc, h_ptr, rows.to(tl.int64) * I, valid, w, sc, cols, cmask, k0, I, MXFP4, PRECISION,
                              UPCAST, BLOCK_K)
            weight = tl.load(wts_ptr + pair, mask=valid, other=0.0).to(tl.float32)
            tl.store(out_ptr + pair[:, None].to(tl.int64) * DO + cols[None, :], acc * weight[:, None],
                     mask=valid[:, None] & cmask[None, :])

    @triton.jit
    def _expert_finish_kernel(rows_ptr, out_ptr, norm_w_ptr, K_TOP, DO, eps, NORM: tl.constexpr,
                              BLOCK: tl.constexpr):
        """One program per token: the sum of its K_TOP pair rows (fp32, in choice order), rounded to the output dtype
        as the routed sum is; with NORM, then K3's latent RMSNorm with the roundings of model_def's RMSNorm
        (normalized row rounded, times the weight, rounded)."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < DO
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(K_TOP):
            acc += tl.load(rows_ptr + (t * K_TOP + s) * DO + cols, mask=mask, other=0.0)
        y = acc.to(out_ptr.dtype.element_ty)
        if NORM:
            yf = y.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(yf * yf, axis=0) / DO + eps)
            normed = (yf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = (normed * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * DO + cols, y, mask=mask)


def check_launch(launch: SortedLaunch, quantized: bool = False) -> None:
    """ValueError naming the field: tile sizes are powers of two >= 16 (tl.dot's least), and with MXFP4 weights the K
    steps >= 32 (each is two dots over half of it)."""
    for field, value in launch._asdict().items():
        if field in ("num_warps", "num_stages"):
            if value < 1:
                raise ValueError(f"moe_experts_sorted: launch {field}={value} < 1")
            continue
        least = 32 if quantized and field.endswith("_k") else 16
        if value < least or value & (value - 1):
            raise ValueError(f"moe_experts_sorted: launch {field}={value} is not a power of two >= {least}")


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [max_blocks * block_m] int32, block_expert [max_blocks] int32) by `_expert_align_kernel` (module doc)."""
    p = topk_ids.numel()
    blocks = max_blocks(p, num_experts, block_m)
    pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=topk_ids.device)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    block_e = max(16, triton.next_power_of_2(num_experts))
    # [CHUNK, BLOCK_E] one-hot tiles: at most 8k elements (64 registers a thread), K3's 896 experts at 8 pairs a step
    _expert_align_kernel[(1,)](ids, pairs, block_expert, p, num_experts, blocks, BLOCK_M=block_m, BLOCK_E=block_e,
                        CHUNK=max(4, min(32, 8192 // block_e)), num_warps=4)
    return pairs, block_expert


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The align step in torch (the kernel's contract, for its tests): a stable sort by expert."""
    flat = topk_ids.reshape(-1).long()
    p = flat.numel()
    blocks = max_blocks(p, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long).index_add_(0, flat.cpu(), torch.ones(p, dtype=torch.long))
    per = (counts + block_m - 1) // block_m
    end = per.cumsum(0)
    pairs = torch.full((blocks * block_m,), p, dtype=torch.int32)
    block_expert = torch.full((blocks,), num_experts, dtype=torch.int32)
    for e in range(num_experts):
        mine = torch.nonzero(flat.cpu() == e).flatten()
        start = int(end[e] - per[e])
        pairs[start * block_m: start * block_m + mine.numel()] = mine.to(torch.int32)
        block_expert[start: int(end[e])] = e
    return pairs, block_expert


def moe_experts_sorted(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta,
                       launch: SortedLaunch | None = None, w13_scale=None, w2_scale=None, finish: bool = False,
                       norm_w=None, eps: float = 1e-5):
    """moe_experts_loop's result (x [N, D]; w13 [E, 2I, D]; w2 [E, Do, I]) by the four launches of the module doc.
    With w13_scale / w2_scale the weights are MXFP4 (codes [E, 2I, D/2] / [E, Do, I/2], E8M0 scales [E, 2I, D/32] /
    [E, Do, I/32]: model_def.ops.mxfp4), decoded in the kernels' registers. launch: None = sorted_launch's rule.
    finish: the sum by `_expert_finish_kernel` instead of ATen's sum and cast, and with norm_w [Do] K3's latent
    RMSNorm (eps) in the same kernel: the result is then RMSNorm(the routed sum), as model_def rounds it. CUDA
    tensors, or CPU tensors under TRITON_INTERPRET=1."""
    if triton is None:
        raise RuntimeError("moe_experts_sorted: triton is not installed")
    quantized = w13_scale is not None
    n, k = topk_ids.shape
    launch = launch or sorted_launch(n * k, w13.shape[0])
    check_launch(launch, quantized)
    num_experts = w13.shape[0]
    do, inter = w2.shape[1], w2.shape[2] * (2 if quantized else 1)
    out = torch.empty(n, do, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    s13, s2 = (w13_scale.contiguous(), w2_scale.contiguous()) if quantized else (w13, w2)  # unread when dense
    pairs, block_expert = align(topk_ids, num_experts, launch.block_m)
    blocks = block_expert.numel()
    h = torch.empty(blocks * launch.block_m, inter, dtype=x.dtype, device=x.device)
    rows = torch.empty(n * k, do, dtype=torch.float32, device=x.device)
    precision = "ieee" if torch.float32 in (x.dtype, w13.dtype) else "tf32"
    common = {"MXFP4": quantized, "PRECISION": precision, "UPCAST": _INTERPRETED or precision == "ieee",
              "BLOCK_M": launch.block_m, "num_warps": launch.num_warps, "num_stages": launch.num_stages}
    _expert_sorted_up_kernel[(blocks, triton.cdiv(inter, launch.up_n))](
        x, x.stride(0), w13, s13, pairs, block_expert, h, n * k, num_experts, k, x.shape[1], inter, float(beta),
        float(linear_beta), ACT=ACTS[act], BLOCK_N=launch.up_n, BLOCK_K=launch.up_k, **common)
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    _expert_sorted_down_kernel[(blocks, triton.cdiv(do, launch.down_n))](
        h, w2, s2, pairs, block_expert, weights, rows, n * k, num_experts, k, inter, do, BLOCK_N=launch.down_n,
        BLOCK_K=launch.down_k, **common)
    if not finish:
        if norm_w is not None:
            raise ValueError("moe_experts_sorted: norm_w needs finish=True (the norm runs in the finish kernel)")
        return rows.view(n, k, do).sum(1).to(x.dtype)
    _expert_finish_kernel[(n,)](rows, out, norm_w if norm_w is not None else rows, k, do, float(eps),
                                NORM=norm_w is not None, BLOCK=triton.next_power_of_2(do), num_warps=4)
    return out
