"""Topologies and what one rank holds (the partitioning plan that build, runtime and `plan` share).

    single        one rank
    tpN           N ranks; KDA/MLA heads, dense/shared MLP columns, lm_head vocab and routed experts
                  split N ways; MLA's latent KV replicated on every rank
    tepN          as tpN, but routed experts placed whole (expert parallel) instead of sliced
    dcpM          M ranks; weights and KDA heads split M ways as tpM, MLA KV split by position
                  (position p on rank p mod M); every rank computes all MLA query heads and attends
                  over its own positions; partial outputs + log-sum-exps are merged exactly
    tpN-dcpM      N*M ranks; weights and KDA heads split N*M ways; MLA query heads split N ways
                  (one "query group" per DCP group of M ranks); KV split M ways inside each group
                  and replicated over the N groups

Rank r of tpN-dcpM sits at (query group t = r // M, DCP rank d = r % M). Its block of every
N*M-way split is block r, so a DCP group's M ranks hold consecutive head blocks and together
cover exactly the heads of its query group (this is SGLang's layout with DCP inside the TP group).
Routed experts: "auto" places them whole (EP) when num_experts divides by the world size, else
slices their intermediate dimension (TP).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import ConfigError

EXPERT_MODES = ("auto", "tp", "ep")
_PATTERN = re.compile(r"^(?:(?P<tp_kind>tp|tep)(?P<tp>\d+))?(?:-?dcp(?P<dcp>\d+))?$")


class TopologyError(ConfigError):
    """An unparseable topology string or a split the model cannot take."""


@dataclass(frozen=True)
class Topology:
    tp: int = 1  # MLA query-head groups (= KV replication factor)
    dcp: int = 1  # MLA KV position shards per group
    experts: str = "auto"  # routed experts: "auto" | "tp" (sliced) | "ep" (whole experts per rank)

    @property
    def world(self) -> int:
        return self.tp * self.dcp

    @property
    def name(self) -> str:
        if self.world == 1:
            return "single"
        tp = ("tep" if self.experts == "ep" else "tp") + str(self.tp)
        if self.dcp == 1:
            return tp
        return f"dcp{self.dcp}" if self.tp == 1 and self.experts != "ep" else f"{tp}-dcp{self.dcp}"


def parse_topology(text: str, experts: str = "auto") -> Topology:
    """`single | tpN | tepN | dcpM | tpN-dcpM | tepN-dcpM` (any N, M >= 1)."""
    if experts not in EXPERT_MODES:
        raise TopologyError(f"expert placement must be one of {', '.join(EXPERT_MODES)}, got {experts!r}")
    s = text.strip().lower()
    if s == "single":
        return Topology(1, 1, experts)
    m = _PATTERN.match(s)
    if not s or m is None or (m["tp"] is None and m["dcp"] is None) or (m["tp"] is None and s.startswith("-")):
        raise TopologyError(f"unknown topology {text!r}: expected single, tpN, tepN, dcpM or tpN-dcpM "
                            f"(e.g. tp2, dcp4, tp2-dcp4)")
    tp, dcp = int(m["tp"] or 1), int(m["dcp"] or 1)
    if tp < 1 or dcp < 1:
        raise TopologyError(f"topology {text!r}: sizes must be >= 1")
    if m["tp_kind"] == "tep":
        if experts == "tp":
            raise TopologyError(f"topology {text!r} asks for expert parallelism but experts='tp' was given")
        experts = "ep"
    return Topology(tp, dcp, experts)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise TopologyError(msg)


def resolve_experts(cfg, topo: Topology) -> str:
    """The routed-expert placement for this config: whole experts (EP) or intermediate slices (TP)."""
    w = topo.world
    if topo.experts == "ep" or (topo.experts == "auto" and cfg.num_experts % w == 0):
        _need(cfg.num_experts % w == 0, f"{topo.name}: {cfg.num_experts} routed experts do not divide over {w} ranks "
                                        f"(expert parallelism needs whole experts per rank)")
        return "ep"
    inter = cfg.moe_intermediate_size
    _need(inter % w == 0, f"{topo.name}: neither {cfg.num_experts} experts nor their intermediate size {inter} "
                          f"divide by {w} ranks")
    if cfg.expert_quant == "mxfp4":
        _need((inter // w) % 32 == 0, f"{topo.name}: MXFP4 experts are scaled in groups of 32; an intermediate "
                                      f"slice of {inter // w} is not a whole number of groups")
    return "tp"


def check_topology(cfg, topo: Topology) -> str:
    """Raise a TopologyError naming the first split `cfg` cannot take; returns the expert placement."""
    w = topo.world
    _need(cfg.kda_num_heads % w == 0 or not cfg.kda_layers,
          f"{topo.name}: {cfg.kda_num_heads} KDA heads are not divisible by {w} ranks")
    _need(cfg.num_attention_heads % w == 0 or not cfg.mla_layers,
          f"{topo.name}: {cfg.num_attention_heads} MLA heads are not divisible by {w} ranks")
    _need(cfg.vocab_size % w == 0, f"{topo.name}: vocabulary {cfg.vocab_size} is not divisible by {w} ranks "
                                   f"(lm_head is split by vocabulary)")
    for name, inter in (("dense MLP intermediate", cfg.intermediate_size),
                        ("shared-expert intermediate", cfg.moe_intermediate_size * cfg.num_shared_experts)):
        if inter:
            _need(inter % w == 0, f"{topo.name}: {name} {inter} is not divisible by {w} ranks")
    return resolve_experts(cfg, topo)


@dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `topology` holds (resolved for one config)."""
    topology: Topology
    rank: int
    expert_mode: str  # "tp" | "ep"

    @classmethod
    def of(cls, cfg, topo: Topology, rank: int) -> "RankShard":
        if not 0 <= rank < topo.world:
            raise TopologyError(f"{topo.name}: rank {rank} is outside 0..{topo.world - 1}")
        return cls(topo, rank, check_topology(cfg, topo))

    @property
    def world(self) -> int:
        return self.topology.world

    @property
    def query_group(self) -> int:  # t: which N-way block of MLA query heads this rank computes
        return self.rank // self.topology.dcp

    @property
    def dcp_rank(self) -> int:  # d: positions p with p mod M == d live here
        return self.rank % self.topology.dcp

    @property
    def dcp(self) -> int:
        return self.topology.dcp

    def block(self, total: int) -> range:
        """This rank's block of a `world`-way split (KDA heads, MLA output heads, columns, vocab)."""
        n = total // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def query_block(self, total: int) -> range:
        """The MLA query heads this rank computes: its query group's block of a tp-way split."""
        n = total // self.topology.tp
        return range(self.query_group * n, (self.query_group + 1) * n)

    def expert_block(self, num_experts: int) -> range:
        return self.block(num_experts) if self.expert_mode == "ep" else range(num_experts)

    def owns_position(self, p: int) -> bool:
        return p % self.dcp == self.dcp_rank

    def local_kv_len(self, seq_len: int) -> int:
        """How many of positions 0..seq_len-1 this rank stores."""
        return max(0, (seq_len - self.dcp_rank + self.dcp - 1) // self.dcp)

    def dcp_group_ranks(self, group: int | None = None) -> list[int]:
        t = self.query_group if group is None else group
        return [t * self.dcp + d for d in range(self.dcp)]
