"""CUDA implementations of the k3:: ops: fla's KDA kernels and grouped-GEMM experts.

Registered as device overrides of the reference ops, so the CPU reference stays the definition
and tests compare the two. fla (`pip install fla-core`) is optional: without it, CUDA runs the
reference code. `BACKENDS` records what was registered (tests and reports print it).
"""
from __future__ import annotations

import torch

from . import library, moe_math, mxfp4

BACKENDS: dict[str, str] = {}


_LAST_CU: list = [None, None, -1]  # [the step's cu_seqlens, its int64 copy, its version then]


def _int64_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as int64, the same tensor object for every KDA layer of a step: fla caches the chunk indices
    it derives from cu_seqlens (a host sync each time) on the tensor's identity, so a fresh `.long()` per layer
    recomputed them -- and synced -- once per layer instead of once per step."""
    if cu_seqlens.dtype == torch.int64:
        return cu_seqlens
    if _LAST_CU[0] is not cu_seqlens or _LAST_CU[0]._version != _LAST_CU[2]:
        _LAST_CU[:] = [cu_seqlens, cu_seqlens.long(), cu_seqlens._version]
    return _LAST_CU[1]


def _register_fla() -> None:
    try:
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # not installed, or no usable triton: keep the reference
        BACKENDS["kda"] = f"reference (fla unavailable: {type(e).__name__})"
        return

    @library.kda_prefill.register_kernel("cuda")
    def _kda_prefill_fla(q, k, v, g, beta, ssm_pool, layer, slots, cu_seqlens, seq_lens):
        ext = cu_seqlens[1:] - cu_seqlens[:-1]
        fresh = (seq_lens - ext) <= 0
        h0 = ssm_pool[slots, layer].masked_fill(fresh.view(-1, 1, 1, 1), 0.0)
        o, ht = chunk_kda(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0),
                          beta.to(q.dtype).unsqueeze(0), initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=_int64_cu_seqlens(cu_seqlens))
        ssm_pool[slots, layer] = ht
        return o.squeeze(0)

    @library.kda_decode.register_kernel("cuda")
    def _kda_decode_fla(q, k, v, g, beta, ssm_pool, layer, slots):
        # continuous-batching mode: reads and writes each request's state in place through its slot index
        # (the slot-major pool view has stride(0) = whole slot, which the kernel honours)
        o, _ = fused_recurrent_kda_fwd(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.float().unsqueeze(1),
                                       beta.to(q.dtype).unsqueeze(1), initial_state=ssm_pool[:, layer],
                                       inplace_final_state=True, ssm_state_indices=slots,
                                       use_qk_l2norm_in_kernel=True)
        return o.squeeze(1)

    BACKENDS["kda"] = "fla"


def _register_grouped_moe() -> None:
    if not hasattr(torch, "_grouped_mm"):
        BACKENDS["moe"] = "gather (no torch._grouped_mm)"
        return

    @library.moe_experts.register_kernel("cuda")
    def _moe_cuda(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta):
        major = torch.cuda.get_device_capability(x.device)[0]
        if x.dtype == torch.bfloat16 and major >= 9:
            return moe_math.moe_experts_grouped(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta)
        return moe_math.moe_experts_gather(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta)

    @library.moe_experts_mxfp4.register_kernel("cuda")
    def _moe_mxfp4_cuda(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, act, beta,
                        linear_beta):
        # whole-tensor dequantization (no NaN-scale scan: it would sync); P6's kernel reads MXFP4 directly
        w13 = mxfp4.dequantize(w13_packed, w13_scale, x.dtype, check_nan_scales=False)
        w2 = mxfp4.dequantize(w2_packed, w2_scale, x.dtype, check_nan_scales=False)
        return _moe_cuda(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta)

    BACKENDS["moe"] = "grouped_mm (bf16, sm90+) / gather"


def _register_sdpa_prefill() -> None:
    from . import attention_math

    @library.mla_prefill.register_kernel("cuda")
    def _mla_prefill_sdpa(q, kv_pool, layer, kv_b_weight, page_table, cu_seqlens, seq_lens, scale, kv_lora_rank,
                          nope_dim):
        # one SDPA call per distinct chunk length (not per request), one host read per layer
        cu, seq = library.host_lens(cu_seqlens, seq_lens)
        return attention_math.mla_prefill_packed(q, kv_pool[:, layer], kv_b_weight, page_table, cu, seq, scale,
                                                 kv_lora_rank, nope_dim, attend=attention_math.mla_expanded_sdpa_batch)

    BACKENDS["mla_prefill"] = "sdpa"


_register_fla()
_register_grouped_moe()
_register_sdpa_prefill()
