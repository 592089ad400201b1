"""Gated NoPE-MLA (spec §2.3): latent KV cache [c ; k_r] per token, optional q-LoRA and output gate.

Prefill expands the cached latents through kv_b_proj; decode absorbs kv_b_proj into the query and
the output (q_lat = [W_UK^T q_nope ; q_rope], o = W_UV · attn(q_lat, rows)) so only the 576-wide
rows are read per token. Verify (speculative decoding) is decode for n queries per request, each
over its own prefix.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops import library as k3ops  # noqa: F401
from ..ops.attention_math import mla_expanded
from ..ops.eager_dispatch import k3
from ..parallel import comm  # noqa: F401  (registers torch.ops.k3.all_reduce / all_to_all)
from ..parallel.dcp_attention import dcp_exchange
from .common import RMSNorm, StepInputs, linear


class MLAMixer(nn.Module):
    def __init__(self, cfg, pool_index: int, shard=None):
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        # Sharded: queries for the heads of this rank's query group (all heads under pure DCP), the
        # gate and o_proj for its own block of heads (o_proj row-parallel); the latent KV projection
        # stays whole, so every rank can write the cache rows it stores.
        h_out = h if shard is None else len(shard.block(h))
        h = h if shard is None else len(shard.query_block(h))
        self.shard, self.dcp = shard, 1 if shard is None else shard.dcp
        self.num_heads, self.pool_index = h, pool_index
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim ** -0.5
        if cfg.q_lora_rank is None:
            self.q_proj = linear(d, h * cfg.qk_head_dim)
        else:
            self.q_a_proj = linear(d, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = linear(cfg.q_lora_rank, h * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)  # DeepSeek-style default eps, as transformers
        self.kv_b_proj = linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        if cfg.mla_output_gate:
            self.g_proj = linear(d, h_out * cfg.v_head_dim)
        self.o_proj = linear(h_out * cfg.v_head_dim, d)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.unflatten(-1, (self.num_heads, -1))

    def forward(self, x: torch.Tensor, s: StepInputs) -> torch.Tensor:
        q = self.query(x)
        ckv = self.kv_a_proj_with_mqa(x)
        rows = torch.cat([self.kv_a_layernorm(ckv[:, : self.kv_lora_rank]), ckv[:, self.kv_lora_rank:]], -1)
        if s.mode == "train":  # each sequence attends over its own rows; no pool
            o = torch.cat([mla_expanded(q[a:b], rows[a:b], self.kv_b_proj.weight, self.kv_lora_rank, self.nope,
                                        self.scale, 0) for a, b in s.spans()])
            return self._output(o, x)
        k3.kv_write(rows, s.kv, self.pool_index, s.out_cache_loc)
        if self.dcp > 1:  # prefill, decode and verify: mla_partial places each query by cu_seqlens / seq_lens
            o = self._attend_dcp(q, s).to(x.dtype)
        elif s.mode == "decode" or s.window:
            w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, -1))  # [H, nope+v, r]
            w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]
            q_nope = torch.einsum("bhd,hdr->bhr", q[..., : self.nope], w_uk)
            q_lat = torch.cat([q_nope, q[..., self.nope:]], -1)
            table, lens = s.page_table, s.seq_lens
            if s.window:
                # verify: n tokens per request, each a decode query over its own prefix (token j of a
                # request sees seq_len - n + j + 1 rows): no host sync, so it can sit in a CUDA graph
                b = s.state_slots.shape[0]
                n = x.shape[0] // b
                table = table.repeat_interleave(n, 0)
                lens = (lens.view(b, 1) - n + 1 + torch.arange(n, device=lens.device, dtype=lens.dtype)).flatten()
            o_lat = k3.mla_decode(q_lat, s.kv, self.pool_index, table, lens, self.scale, self.kv_lora_rank)
            o = torch.einsum("bhr,hdr->bhd", o_lat, w_uv)
        else:
            o = k3.mla_prefill(q, s.kv, self.pool_index, self.kv_b_proj.weight, s.page_table, s.cu_seqlens,
                               s.seq_lens, self.scale, self.kv_lora_rank, self.nope)
        return self._output(o, x)

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        o = o.flatten(-2)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x))
        y = self.o_proj(o)
        return y if self.shard is None else k3.all_reduce(y, "world")

    def _attend_dcp(self, q: torch.Tensor, s: StepInputs) -> torch.Tensor:
        """Absorbed attention over this rank's positions (prefill, decode and verify alike: query j of a request's
        packed tokens sits at position seq_len - extend + j and sees the rank's rows up to it), W_UV applied per head
        before the exchange (linear, so merging 128-wide outputs equals merging 512-wide latents), then one
        all-to-all + exact LSE merge: [N, H_query, nope+rope] -> [N, H_own, v]."""
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, -1))
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]
        q_lat = torch.cat([torch.einsum("bhd,hdr->bhr", q[..., : self.nope], w_uk), q[..., self.nope:]], -1)
        o_lat, lse = k3.mla_partial(q_lat, s.kv, self.pool_index, s.page_table, s.cu_seqlens, s.seq_lens,
                                    self.scale, self.kv_lora_rank, self.shard.dcp_rank, self.dcp)
        o = torch.einsum("bhr,hdr->bhd", o_lat, w_uv.float())
        return dcp_exchange(o, lse, self.dcp)
