"""The MoE finalize (routing-weighted sum of the expert outputs + the shared experts' partial) as the staging
step of the all-reduce that follows it (pass P12; TensorRT-LLM's MoE-finalize + all-reduce fusion).

Unfused, a rank's MoE layer runs its experts, scatters their weighted outputs into a zeroed [N, D] sum
(k3::moe_experts; on CUDA: fill, weight multiply, index_add, cast), adds the shared experts' partial (one
more kernel) and hands the result to k3::all_reduce, which copies it into a buffer it may overwrite (the
staging copy) before NCCL reduces it. After P12:

    rows, slot_rows = k3::moe_expert_rows(x, ids, w13, w2, act, beta, linear_beta)
        every (token, choice)'s expert output, unweighted, where the GEMMs left it: rows [N*k, D];
        slot_rows [N, k] = the row of token t's choice s (identity on CPU; the grouped GEMM's expert order on
        CUDA, so nothing is scattered)
    y = k3::moe_finalize_all_reduce(rows, slot_rows, weights, shared, role)
        one kernel writes Σ_s w[t,s] rows[slot_rows[t,s]] (+ shared[t]) straight into the buffer the
        all-reduce then reduces in place (no staging copy, no separate add)
  | y = k3::moe_finalize(rows, slot_rows, weights, shared)
        the same buffer for a collective that reduces its input in place itself (P9's
        k3::all_reduce_attn_res_norm, where the MoE output meets the residual stream)

On CUDA the finalize is one Triton program per (token, column block): loads its k rows through slot_rows,
multiplies by the routing weights in the rows' dtype, sums in fp32, casts, adds the shared partial, stores;
elsewhere the reference (moe_math.finalize). The reduction is NCCL's kernel (gloo on CPU).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the ops still work through the reference
    triton = None

from k3compile.model_def.ops import moe_math
from k3compile.model_def.parallel import comm


def check_args(rows, slot_rows, topk_weights, shared) -> None:
    if rows.dim() != 2 or slot_rows.dim() != 2:
        raise ValueError(f"moe_finalize: rows must be [N*k, D] and slot_rows [N, k], got {tuple(rows.shape)} and "
                         f"{tuple(slot_rows.shape)}")
    n, k = slot_rows.shape
    if rows.shape[0] != n * k:
        raise ValueError(f"moe_finalize: {n} tokens x {k} choices need {n * k} rows, got {rows.shape[0]}")
    if tuple(topk_weights.shape) != (n, k):
        raise ValueError(f"moe_finalize: topk_weights must be [{n}, {k}], got {tuple(topk_weights.shape)}")
    if slot_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_finalize: slot_rows must be an integer tensor, got {slot_rows.dtype}")
    if shared is not None and (tuple(shared.shape) != (n, rows.shape[1]) or shared.dtype != rows.dtype):
        raise ValueError(f"moe_finalize: shared must be [{n}, {rows.shape[1]}] {rows.dtype}, got "
                         f"{tuple(shared.shape)} {shared.dtype}")


# --------------------------------------------------------------------------- the expert GEMMs

@torch.library.custom_op("k3::moe_expert_rows", mutates_args=())
def moe_expert_rows(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: str,
                    beta: float, linear_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N*k, D], slot_rows [N, k]): k3::moe_experts without the weighted sum."""
    return moe_math.expert_rows_loop(x, topk_ids, w13, w2, act, beta, linear_beta)


@moe_expert_rows.register_kernel("cuda")
def _moe_expert_rows_cuda(x, topk_ids, w13, w2, act, beta, linear_beta):
    if hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9:
        return moe_math.expert_rows_grouped(x, topk_ids, w13, w2, act, beta, linear_beta)
    return moe_math.expert_rows_gather(x, topk_ids, w13, w2, act, beta, linear_beta)


@moe_expert_rows.register_fake
def _(x, topk_ids, w13, w2, act, beta, linear_beta):
    n, k = topk_ids.shape
    return x.new_empty(n * k, w2.shape[1]), topk_ids.new_empty(n, k, dtype=torch.int64)


# --------------------------------------------------------------------------- the finalize kernel

if triton is not None:

    @triton.jit
    def _finalize_kernel(rows_ptr, slot_ptr, w_ptr, shared_ptr, out_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr,
                         HAS_SHARED: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in tl.static_range(K):
            row = tl.load(slot_ptr + token * K + s).to(tl.int64)
            wt = tl.load(w_ptr + token * K + s)
            y = tl.load(rows_ptr + row * D + cols, mask=m, other=0.0)
            # the product rounded to the rows' dtype, as the reference: two bf16/fp16 values multiply exactly in
            # fp32, so rounding that product once equals the half-precision multiply
            prod = y.to(tl.float32) * wt.to(y.dtype).to(tl.float32)
            acc += prod.to(y.dtype).to(tl.float32)
        out = acc.to(out_ptr.dtype.element_ty)
        if HAS_SHARED:  # added after the cast, in the output dtype (as the unfused graph adds two tensors)
            sh = tl.load(shared_ptr + token * D + cols, mask=m, other=0.0)
            out = (out.to(tl.float32) + sh.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + token * D + cols, out, mask=m)


def moe_finalize_triton(rows, slot_rows, topk_weights, shared=None, out=None, block_d: int = 1024):
    """The finalize kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1), written into `out` (a fresh
    [N, D] buffer when None); returns it."""
    check_args(rows, slot_rows, topk_weights, shared)
    if triton is None:
        raise RuntimeError("moe_finalize: triton is not installed")
    n, k = slot_rows.shape
    d = rows.shape[1]
    out = torch.empty(n, d, dtype=rows.dtype, device=rows.device) if out is None else out
    if n == 0:
        return out
    block = min(triton.next_power_of_2(d), block_d)
    _finalize_kernel[(n, triton.cdiv(d, block))](
        rows.contiguous(), slot_rows.contiguous(), topk_weights.contiguous(),
        shared.contiguous() if shared is not None else out, out, d, K=k, BLOCK_D=block,
        HAS_SHARED=shared is not None, num_warps=4 if block >= 512 else 1)
    return out


def _finalize(rows, slot_rows, topk_weights, shared):
    if rows.is_cuda and triton is not None:
        with torch.cuda.device(rows.device):
            return moe_finalize_triton(rows, slot_rows, topk_weights, shared)
    check_args(rows, slot_rows, topk_weights, shared)
    return moe_math.finalize(rows, slot_rows, topk_weights, shared)


# --------------------------------------------------------------------------- the k3 ops

@torch.library.custom_op("k3::moe_finalize", mutates_args=())
def moe_finalize(rows: torch.Tensor, slot_rows: torch.Tensor, topk_weights: torch.Tensor,
                 shared: torch.Tensor | None) -> torch.Tensor:
    """[N, D]: Σ_s topk_weights[t, s] · rows[slot_rows[t, s]] (+ shared[t]), in rows' dtype."""
    return _finalize(rows, slot_rows, topk_weights, shared)


@moe_finalize.register_fake
def _moe_finalize_fake(rows, slot_rows, topk_weights, shared):
    check_args(rows, slot_rows, topk_weights, shared)
    return rows.new_empty(slot_rows.shape[0], rows.shape[1])


@torch.library.custom_op("k3::moe_finalize_all_reduce", mutates_args=())
def moe_finalize_all_reduce(rows: torch.Tensor, slot_rows: torch.Tensor, topk_weights: torch.Tensor,
                            shared: torch.Tensor | None, role: str) -> torch.Tensor:
    """Σ_ranks (the rank's finalize): the finalize writes the buffer that the all-reduce reduces in place."""
    out = _finalize(rows, slot_rows, topk_weights, shared)
    comm.all_reduce_in_place(out, role)
    return out


@moe_finalize_all_reduce.register_fake
def _(rows, slot_rows, topk_weights, shared, role):
    return _moe_finalize_fake(rows, slot_rows, topk_weights, shared)
