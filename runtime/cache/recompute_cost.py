"""What a prefill of tokens [start, end) costs in FLOPs: the price of recomputing a prefix whose
KDA state checkpoint was evicted (Marconi's FLOP-aware eviction, reference/runtime-anchors.md §3).

    cost(start, end) = linear * (end - start) + attention * sum_{t=start}^{end-1} t

`linear` is 2 x the weights a token is multiplied with (projections of every layer, dense MLP or
shared + routed experts, LM head excluded: a restored prefix does not need its logits);
`attention` is the MLA score + value FLOPs of one (query, earlier key) pair summed over the MLA
layers. An estimate from the config's shapes, not a count of kernels: it decides which checkpoint
is cheaper to lose, so the ratio between the two terms is what matters.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecomputeCost:
    linear: float  # FLOPs per token independent of its position
    attention: float  # FLOPs per (query, key) pair

    def __post_init__(self):
        if self.linear < 0 or self.attention < 0 or self.linear + self.attention <= 0:
            raise ValueError(f"recompute cost terms must be >= 0 and not both 0, got {self}")

    def prefill(self, start: int, end: int) -> float:
        """FLOPs to compute positions [start, end) on top of the state at `start`."""
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got {start}, {end}")
        pairs = (end * (end - 1) - start * (start - 1)) // 2  # sum of t for t in [start, end)
        return self.linear * (end - start) + self.attention * pairs

    @classmethod
    def from_config(cls, c) -> "RecomputeCost":
        """From a model_def ModelConfig (duck-typed: runtime/cache imports no model code)."""
        d, kda = c.hidden_size, c.kda_num_heads * c.kda_head_dim
        heads, qk, v = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        kda_w = 4 * d * kda + 2 * d * kda  # q, k, v, o + gate/beta projections (approx.)
        q_w = d * heads * qk if c.q_lora_rank is None else d * c.q_lora_rank + c.q_lora_rank * heads * qk
        mla_w = q_w + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * heads * (c.qk_nope_head_dim + v) \
            + heads * v * d
        width = c.latent_size or d
        moe_w = 3 * d * c.moe_intermediate_size * c.num_shared_experts \
            + 3 * width * c.moe_intermediate_size * c.num_experts_per_token + (2 * d * width if c.latent_size else 0)
        weights = 0
        for i, kind in enumerate(c.layer_types):
            weights += kda_w if kind == "kda" else mla_w
            weights += moe_w if c.is_moe_layer(i) else 3 * d * c.intermediate_size
        n_mla = sum(1 for t in c.layer_types if t == "mla")
        return cls(linear=2.0 * weights, attention=2.0 * 2 * heads * (qk + v) * n_mla)
