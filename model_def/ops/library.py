"""The `k3::` custom ops: stateful or special steps that stay single nodes in captured graphs.

Each op has a reference implementation (pure torch, used on CPU and as the fallback on any device)
and a fake kernel so torch.fx / torch.export / make_fx can trace through it. Faster CUDA kernels
(fla, Triton) register themselves as device overrides in `cuda_backend.py`.

Pools are passed whole with a layer index, so a captured step has one graph input per pool.
Requests are cut out of the packed token axis by `cu_seqlens`; a request's prefix length is
`seq_lens - extend_len`; a zero prefix means a fresh (zero) state, whatever the slot holds.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from . import attention_math, kda_math, moe_math, mxfp4

KDA_PREFILL_CHUNK = 64


# --------------------------------------------------------------------------------------- short conv

@custom_op("k3::short_conv_prefill", mutates_args=("conv_pool",))
def short_conv_prefill(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, layer: int,
                       channel_offset: int, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                       seq_lens: torch.Tensor) -> torch.Tensor:
    """x [N, C] -> SiLU(causal depthwise conv) [N, C]; updates each request's window in conv_pool.
    All requests at once, on any device: no per-request loop, no host sync."""
    c = x.shape[1]
    fresh, layout = _conv_step_layout(cu_seqlens, seq_lens, x.shape[0], weight.shape[-1])
    win = conv_pool[slots, layer, channel_offset: channel_offset + c]  # [B, C, W-1]
    win = torch.where(fresh, torch.zeros_like(win), win)
    y, new = kda_math.short_conv_packed(x, weight, win, cu_seqlens, layout)
    conv_pool[slots, layer, channel_offset: channel_offset + c] = new.to(conv_pool.dtype)
    return y


# The last step's short-conv layout: (key, (fresh [B, 1, 1], row indices)). Every short conv of a step (3 per KDA
# layer, or 1 after pass P18) sees the same cu_seqlens / seq_lens tensors, and their index math is ~30 of the op's
# ~60 host-dispatched ops: an eager prefill step is host-bound (traces/h200_s13/call3), so it is done once a step.
# Keyed on the tensors' identity and version (held here, so an id cannot be reused) and the sizes it depends on;
# one tuple read and replaced whole, so engines stepping on two threads at worst recompute it.
_CONV_LAYOUT: list = [None]


def _conv_step_layout(cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, width: int):
    try:
        key = (cu_seqlens, cu_seqlens._version, seq_lens, seq_lens._version, num_tokens, width)
    except RuntimeError:   # inference tensors keep no version: nothing can tell an in-place change, so no cache
        key = None
    entry = _CONV_LAYOUT[0]
    if entry is not None and key is not None:
        old = entry[0]
        if old[0] is key[0] and old[2] is key[2] and old[1] == key[1] and old[3:] == key[3:]:
            return entry[1]
    fresh = _fresh(cu_seqlens, seq_lens).view(-1, 1, 1)
    value = (fresh, kda_math.short_conv_layout(cu_seqlens, num_tokens, width) if width > 1 else None)
    if key is not None:
        _CONV_LAYOUT[0] = (key, value)
    return value


def _fresh(cu_seqlens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[B] bool: the requests with no prefix (they start from a zero state, whatever their slot holds)."""
    return (seq_lens - (cu_seqlens[1:] - cu_seqlens[:-1])) <= 0


@short_conv_prefill.register_fake
def _(x, weight, conv_pool, layer, channel_offset, slots, cu_seqlens, seq_lens):
    return torch.empty_like(x)


@custom_op("k3::short_conv_decode", mutates_args=("conv_pool",))
def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, layer: int,
                      channel_offset: int, slots: torch.Tensor) -> torch.Tensor:
    """One token per request, vectorized: x [B, C]."""
    c = x.shape[1]
    win = conv_pool[slots, layer, channel_offset: channel_offset + c]  # [B, C, W-1]
    full = torch.cat([win.to(x.dtype), x.unsqueeze(-1)], -1)  # [B, C, W]
    y = torch.nn.functional.silu((full.float() * weight.float()).sum(-1)).to(x.dtype)
    conv_pool[slots, layer, channel_offset: channel_offset + c] = full[..., 1:].to(conv_pool.dtype)
    return y


@short_conv_decode.register_fake
def _(x, weight, conv_pool, layer, channel_offset, slots):
    return torch.empty_like(x)


# ---------------------------------------------------------------------------------------------- KDA

@custom_op("k3::kda_prefill", mutates_args=("ssm_pool",))
def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                ssm_pool: torch.Tensor, layer: int, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
    """Chunked KDA per request, from the slot's state (or zero for a fresh request); writes the final state.
    Requests with the same chunking run as one batched `kda_chunked_batch` call: KDA_PREFILL_CHUNK-token chunks,
    or one chunk of the next power of two for a shorter request (so a decode row riding in a mixed batch is not
    padded to a whole chunk); the chunk size changes only fp32 rounding."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    s0 = ssm_pool[slots, layer]
    s0 = torch.where(_fresh(cu_seqlens, seq_lens).view(-1, 1, 1, 1), torch.zeros_like(s0), s0)
    s1 = torch.empty_like(s0)
    cu = cu_seqlens.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        chunk = min(KDA_PREFILL_CHUNK, 1 << (n - 1).bit_length())
        groups.setdefault((chunk, -(-n // chunk)), []).append(i)
    for (chunk, n_chunks), members in groups.items():
        length = n_chunks * chunk
        idx = torch.tensor(members, dtype=torch.int64, device=v.device)
        tok = torch.tensor([t for i in members for t in range(cu[i], cu[i + 1])], dtype=torch.int64, device=v.device)
        dst = torch.tensor([j * length + t for j, i in enumerate(members) for t in range(cu[i + 1] - cu[i])],
                           dtype=torch.int64, device=v.device)

        def pad(x):
            z = x.new_zeros(len(members) * length, *x.shape[1:])
            z[dst] = x[tok]
            return z.unflatten(0, (len(members), length))

        o, s1[idx] = kda_math.kda_chunked_batch(pad(q), pad(k), pad(v), pad(g), pad(beta), s0[idx], chunk)
        out[tok] = o.flatten(0, 1)[dst].to(v.dtype)
    ssm_pool[slots, layer] = s1
    return out


@kda_prefill.register_fake
def _(q, k, v, g, beta, ssm_pool, layer, slots, cu_seqlens, seq_lens):
    return torch.empty_like(v)


@custom_op("k3::kda_decode", mutates_args=("ssm_pool",))
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               ssm_pool: torch.Tensor, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """One recurrent step for B requests, vectorized over the batch (q, k [B, H, K]; v [B, H, V])."""
    qf, kf = kda_math.l2norm(q.float()) * q.shape[-1] ** -0.5, kda_math.l2norm(k.float())
    s = kda_math.kda_decode_step(ssm_pool[slots, layer], kf, v, g, beta)
    ssm_pool[slots, layer] = s
    return kda_math.kda_read(s, qf, v.dtype)


@kda_decode.register_fake
def _(q, k, v, g, beta, ssm_pool, layer, slots):
    return torch.empty_like(v)


# ---------------------------------------------------------------------------------------------- MLA

@custom_op("k3::kv_write", mutates_args=("kv_pool",))
def kv_write(rows: torch.Tensor, kv_pool: torch.Tensor, layer: int, out_cache_loc: torch.Tensor) -> None:
    """Store new tokens' cache rows [N, W] at flat positions page * page_size + offset."""
    page = kv_pool.shape[2]
    kv_pool[out_cache_loc // page, layer, out_cache_loc % page] = rows.to(kv_pool.dtype)


@kv_write.register_fake
def _(rows, kv_pool, layer, out_cache_loc):
    return None


@custom_op("k3::mla_prefill", mutates_args=())
def mla_prefill(q: torch.Tensor, kv_pool: torch.Tensor, layer: int, kv_b_weight: torch.Tensor,
                page_table: torch.Tensor, cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                kv_lora_rank: int, nope_dim: int) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole cached context (rows already written);
    requests with the same number of new tokens attend in one batched call (attention_math.mla_prefill_packed)."""
    cu, seq = host_lens(cu_seqlens, seq_lens)
    return attention_math.mla_prefill_packed(q, kv_pool[:, layer], kv_b_weight, page_table, cu, seq, scale,
                                             kv_lora_rank, nope_dim)


def host_lens(cu_seqlens: torch.Tensor, seq_lens: torch.Tensor) -> tuple[list[int], list[int]]:
    """cu_seqlens and seq_lens on the host, with one device read for both."""
    both = torch.cat([cu_seqlens.to(torch.int64), seq_lens.to(torch.int64)]).tolist()
    b = seq_lens.shape[0]
    return both[:b + 1], both[b + 1:]


@mla_prefill.register_fake
def _(q, kv_pool, layer, kv_b_weight, page_table, cu_seqlens, seq_lens, scale, kv_lora_rank, nope_dim):
    H = q.shape[1]
    return q.new_empty(q.shape[0], H, kv_b_weight.shape[0] // H - nope_dim)


@custom_op("k3::mla_decode", mutates_args=())
def mla_decode(q_lat: torch.Tensor, kv_pool: torch.Tensor, layer: int, page_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed-latent decode attention, [B, H, W] -> [B, H, r]."""
    return attention_math.mla_decode_latent(q_lat, kv_pool[:, layer].to(q_lat.dtype), page_table, seq_lens,
                                            scale, kv_lora_rank)


@mla_decode.register_fake
def _(q_lat, kv_pool, layer, page_table, seq_lens, scale, kv_lora_rank):
    return q_lat.new_empty(q_lat.shape[0], q_lat.shape[1], kv_lora_rank)


# ---------------------------------------------------------------------------------------------- MoE

@custom_op("k3::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, act: str, beta: float, linear_beta: float) -> torch.Tensor:
    """Σ_k w_k · expert_{id_k}(x) for each token; x [N, D], w13 [E, 2I, D], w2 [E, D, I]."""
    return moe_math.moe_experts_loop(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta)


@moe_experts.register_fake
def _(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta):
    return x.new_empty(x.shape[0], w2.shape[1])


def _moe_experts_setup(ctx, inputs, output):
    x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta = inputs
    ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2)
    ctx.act = (act, beta, linear_beta)


def _moe_experts_backward(ctx, grad):
    """Training only (`k3compile train`): recompute the reference under autograd and pull the gradient
    through it, so the op stays one node for capture and still trains."""
    x, topk_ids, topk_weights, w13, w2 = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(True) for t in (x, topk_weights, w13, w2)]
    with torch.enable_grad():
        out = moe_math.moe_experts_loop(leaves[0], topk_ids, leaves[1], leaves[2], leaves[3], *ctx.act)
        gx, gw, g13, g2 = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return gx, None, gw, g13, g2, None, None, None


moe_experts.register_autograd(_moe_experts_backward, setup_context=_moe_experts_setup)


@custom_op("k3::moe_experts_mxfp4", mutates_args=())
def moe_experts_mxfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13_packed: torch.Tensor,
                      w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, act: str, beta: float,
                      linear_beta: float) -> torch.Tensor:
    """moe_experts on MXFP4 experts (ops/mxfp4.py layout), dequantized to x's dtype first."""
    w13 = mxfp4.dequantize(w13_packed, w13_scale, x.dtype)
    w2 = mxfp4.dequantize(w2_packed, w2_scale, x.dtype)
    return moe_math.moe_experts_loop(x, topk_ids, topk_weights, w13, w2, act, beta, linear_beta)


@moe_experts_mxfp4.register_fake
def _(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, act, beta, linear_beta):
    return x.new_empty(x.shape[0], w2_packed.shape[1])


from . import cuda_backend  # noqa: E402,F401  (registers CUDA overrides)
from . import verify  # noqa: E402,F401  (registers the verify-step ops)
