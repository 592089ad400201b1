"""`k3::all_reduce_attn_res_norm` (+ `_f32`): all-reduce of a sublayer's partial output, residual add, AttnRes
read and RMSNorm as one collective op (P9).

    p = x + Σ_ranks partial          (x None, at an AttnRes block boundary: p = Σ_ranks partial)
    h = RMSNorm(AttnRes read of bank + [p])   (_f32: also h's fp32 copy)

What is fused, on every device: the all-reduce runs in place on `partial` (the op declares it mutated; P9
only builds the op where the sublayer's output is read by nothing else), so the staging copy into a
communication buffer that `k3::all_reduce` makes (it may not touch its input) is gone. Then ONE kernel does
the residual add, the AttnRes read and the RMSNorm reading the reduced rows: P7's Triton kernel on CUDA
(`attn_res_norm_triton`, with its one-pass bank tile and PDL), its reference elsewhere. The reduction
itself is NCCL's kernel (gloo on CPU): folding it into the norm kernel (a one-shot all-reduce reading the
peers' rows over NVLink, TensorRT-LLM's RESIDUAL_RMS_NORM / FlashInfer's allreduce_fusion) needs symmetric
memory and is not done here.

Per call on CUDA: NCCL all-reduce + 1 Triton kernel (the composite it replaces: copy + NCCL + 1 kernel).
"""
from __future__ import annotations

import torch

from k3compile.model_def.parallel import comm

from . import attn_res_norm as _arn  # registers torch.ops.k3.attn_res_norm(_f32)


def _residual_operands(x, partial):
    """(x, delta) for P7's op once `partial` holds the reduced sum: without x the sum is p itself."""
    return (partial, None) if x is None else (x, partial)


def check_args(x, partial) -> None:
    if x is not None and (x.shape != partial.shape or x.dtype != partial.dtype):
        raise ValueError(f"all_reduce_attn_res_norm: partial must match x ({tuple(x.shape)}, {x.dtype}), "
                         f"got {tuple(partial.shape)}, {partial.dtype}")
    if not partial.is_contiguous():
        raise ValueError(f"all_reduce_attn_res_norm: partial is reduced in place and must be contiguous, "
                         f"got strides {partial.stride()}")


def all_reduce_attn_res_norm_triton(bank, x, partial, query, norm_weight, res_eps, norm_eps, role, pdl=False,
                                    with_fp32=False):
    """The fused path by hand (CUDA tensors, or CPU ones under TRITON_INTERPRET=1 with a gloo group): the
    in-place all-reduce, then P7's Triton kernel on the reduced rows."""
    check_args(x, partial)
    comm.all_reduce_in_place(partial, role)
    x, delta = _residual_operands(x, partial)
    return _arn.attn_res_norm_triton(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl=pdl,
                                     with_fp32=with_fp32)


def _run(bank, x, partial, query, norm_weight, res_eps, norm_eps, role, pdl, op):
    check_args(x, partial)
    comm.all_reduce_in_place(partial, role)
    x, delta = _residual_operands(x, partial)
    return op(bank, x, delta, query, norm_weight, res_eps, norm_eps, pdl)  # P7's op: Triton on CUDA


@torch.library.custom_op("k3::all_reduce_attn_res_norm", mutates_args=("partial",))
def all_reduce_attn_res_norm(bank: list[torch.Tensor], x: torch.Tensor | None, partial: torch.Tensor,
                             query: torch.Tensor | None, norm_weight: torch.Tensor, res_eps: float, norm_eps: float,
                             role: str, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, p): p = x + Σ_ranks partial (Σ_ranks partial without x); h = RMSNorm(AttnRes read of bank + [p])
    (just RMSNorm(p) without a bank). `partial` is overwritten with Σ_ranks partial."""
    return _run(bank, x, partial, query, norm_weight, res_eps, norm_eps, role, pdl, torch.ops.k3.attn_res_norm)


@all_reduce_attn_res_norm.register_fake
def _(bank, x, partial, query, norm_weight, res_eps, norm_eps, role, pdl=False):
    x, delta = _residual_operands(x, partial)
    return _arn._attn_res_norm_fake(bank, x, delta, query, norm_weight, res_eps, norm_eps)


@torch.library.custom_op("k3::all_reduce_attn_res_norm_f32", mutates_args=("partial",))
def all_reduce_attn_res_norm_f32(bank: list[torch.Tensor], x: torch.Tensor | None, partial: torch.Tensor,
                                 query: torch.Tensor | None, norm_weight: torch.Tensor, res_eps: float,
                                 norm_eps: float, role: str,
                                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """all_reduce_attn_res_norm plus h's fp32 copy (P7's attn_res_norm_f32 after the all-reduce)."""
    return _run(bank, x, partial, query, norm_weight, res_eps, norm_eps, role, pdl, torch.ops.k3.attn_res_norm_f32)


@all_reduce_attn_res_norm_f32.register_fake
def _(bank, x, partial, query, norm_weight, res_eps, norm_eps, role, pdl=False):
    x, delta = _residual_operands(x, partial)
    return _arn._attn_res_norm_f32_fake(bank, x, delta, query, norm_weight, res_eps, norm_eps)
