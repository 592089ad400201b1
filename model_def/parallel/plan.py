"""The partitioning plan in numbers: what each rank holds, how much memory it needs, how many KV tokens and
KDA state slots fit beside its weights, and what a decode step sends between ranks.

Everything is read off the rank model (`shard.build_rank_model` on the meta device, the same module
tree the runtime runs and `build` partitions) and the rank's CacheSpec; the collectives listed per
decode step are exactly those the rank model issues (tests compare them with `comm.record()`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import CacheSpec
from .shard import build_rank_model
from .topology import RankShard, Topology

_FP32 = 4


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce | all_gather | all_to_all
    group: str  # world | dcp
    where: str  # which layers / module
    count: int  # how many per decode step
    message_bytes: int  # what one rank hands to one call, per token of the batch

    def wire_bytes(self, group_size: int) -> int:
        """Bytes one rank sends per call and token (ring all-reduce / all-gather, direct all-to-all)."""
        g = group_size
        if g == 1:
            return 0
        if self.op == "all_reduce":
            return 2 * (g - 1) * self.message_bytes // g
        if self.op == "all_gather":
            return (g - 1) * self.message_bytes
        return (g - 1) * self.message_bytes // g


@dataclass
class RankPlan:
    topology: Topology
    rank: int
    expert_mode: str
    kda_heads: range
    mla_query_heads: range
    mla_output_heads: range
    experts: range
    expert_slice: range  # intermediate columns of each held expert
    vocab: range
    weight_bytes: int
    kv_bytes_per_token: int  # one stored token, all MLA layers, on this rank
    kda_slot_bytes: int  # one request's KDA state (+ conv windows) on this rank
    collectives: list[Collective] = field(default_factory=list)

    @property
    def kv_positions(self) -> str:
        d, m = self.rank % self.topology.dcp, self.topology.dcp
        return "all" if m == 1 else f"p mod {m} = {d}"

    def comm_bytes_per_token(self) -> int:
        """Bytes this rank sends per decode step and batch token."""
        size = {"world": self.topology.world, "dcp": self.topology.dcp}
        return sum(c.count * c.wire_bytes(size[c.group]) for c in self.collectives)

    def capacity(self, gpu_bytes: int, fraction: float) -> "Capacity":
        pool = int(gpu_bytes * fraction) - self.weight_bytes
        if pool <= 0:
            return Capacity(pool, 0, 0, 0)
        local = pool // self.kv_bytes_per_token if self.kv_bytes_per_token else 0
        slots = pool // self.kda_slot_bytes if self.kda_slot_bytes else 0
        return Capacity(pool, local, local * self.topology.dcp, slots)


@dataclass(frozen=True)
class Capacity:
    pool_bytes: int  # memory left for KV pages + KDA slots on the rank (negative: weights do not fit)
    kv_tokens_local: int  # tokens the rank stores if the whole pool is KV
    kv_tokens_logical: int  # context tokens that amounts to (x DCP: each rank stores 1/M of them)
    kda_slots: int  # KDA state slots if the whole pool is state

    @property
    def fits(self) -> bool:
        return self.pool_bytes > 0


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _collectives(cfg, shard: RankShard, act_bytes: int) -> list[Collective]:
    """The collectives of one decode step, per token, as the rank model issues them (see layers/*)."""
    d, out = cfg.hidden_size, []
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    n_dense = cfg.num_hidden_layers - n_moe
    if n_kda:
        out.append(Collective("all_reduce", "world", "KDA o_proj", n_kda, d * act_bytes))
    if n_mla:
        if shard.dcp > 1:
            hq = len(shard.query_block(cfg.num_attention_heads))
            out.append(Collective("all_to_all", "dcp", "MLA partials + LSE (fp32)", n_mla,
                                  hq * (cfg.v_head_dim + 1) * _FP32))
        out.append(Collective("all_reduce", "world", "MLA o_proj", n_mla, d * act_bytes))
    if n_dense:
        out.append(Collective("all_reduce", "world", "dense MLP", n_dense, d * act_bytes))
    if n_moe:
        if cfg.latent_size is not None:
            out.append(Collective("all_reduce", "world", "MoE latent sum", n_moe, cfg.latent_size * act_bytes))
            if cfg.num_shared_experts:
                out.append(Collective("all_reduce", "world", "MoE shared experts", n_moe, d * act_bytes))
        else:
            out.append(Collective("all_reduce", "world", "MoE output", n_moe, d * act_bytes))
    out.append(Collective("all_gather", "world", "lm_head logits (fp32)", 1,
                          len(shard.block(cfg.vocab_size)) * _FP32))
    return out


def rank_plan(cfg, topology: Topology, rank: int = 0, dtype: torch.dtype = torch.bfloat16) -> RankPlan:
    shard = RankShard.of(cfg, topology, rank)
    model = build_rank_model(cfg, shard, dtype, "meta")
    spec = CacheSpec.from_config(cfg, dtype, shard.world)
    i = cfg.moe_intermediate_size
    return RankPlan(
        topology=topology, rank=rank, expert_mode=shard.expert_mode, kda_heads=shard.block(cfg.kda_num_heads),
        mla_query_heads=shard.query_block(cfg.num_attention_heads), mla_output_heads=shard.block(cfg.num_attention_heads),
        experts=shard.expert_block(cfg.num_experts), expert_slice=range(i) if shard.expert_mode == "ep" else shard.block(i),
        vocab=shard.block(cfg.vocab_size), weight_bytes=_bytes(model), kv_bytes_per_token=spec.kv_bytes_per_token,
        kda_slot_bytes=spec.slot_bytes, collectives=_collectives(cfg, shard, dtype.itemsize) if shard.world > 1 else [])


def all_rank_plans(cfg, topology: Topology, dtype: torch.dtype = torch.bfloat16) -> list[RankPlan]:
    return [rank_plan(cfg, topology, r, dtype) for r in range(topology.world)]
