"""CUDA implementations of the k3:: ops: fla's KDA kernels and grouped-GEMM experts.

Registered as device overrides of the reference ops, so the CPU reference stays the definition
and tests compare the two. fla (`pip install fla-core`) is optional: without it, CUDA runs the
reference code. `BACKENDS` records what was registered (tests and reports print it).
"""
from __future__ import annotations

import torch

from . import library, moe_math, mxfp4

BACKENDS: dict[str, str] = {}


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
                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long())
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
        h = q.shape[1]
        out = q.new_empty(q.shape[0], h, kv_b_weight.shape[0] // h - nope_dim)
        kv_layer = kv_pool[:, layer]
        for i, (s, e, prefix) in enumerate(library._lens(cu_seqlens, seq_lens)):
            rows = attention_math.gather_rows(kv_layer, page_table[i], prefix + e - s).to(q.dtype)
            out[s:e] = attention_math.mla_expanded_sdpa(q[s:e], rows, kv_b_weight, kv_lora_rank, nope_dim, scale,
                                                        prefix)
        return out

    BACKENDS["mla_prefill"] = "sdpa"


_register_fla()
_register_grouped_moe()
_register_sdpa_prefill()
