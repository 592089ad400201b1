"""TP, DCP and TP x DCP over gloo (one process per rank) give the single-process greedy tokens, and
logits within fp32 tolerance, on k3-tiny and kimi-linear-tiny (8-head variants, so 8-way splits exist)."""
import pytest
import torch

from k3compile.model_def.parallel.plan import rank_plan
from k3compile.model_def.parallel.shard import shard_model
from k3compile.model_def.parallel.topology import RankShard, parse_topology
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import launch

from .helpers import PROMPTS, greedy, whole_model, wide_config

TIMEOUT_S = 120


def _rank_run(rank, cfg, topology, experts):
    topo = parse_topology(topology, experts)
    init_rank(topo, "gloo", timeout_s=60)
    try:
        shard = RankShard.of(cfg, topo, rank)
        model = shard_model(whole_model(cfg), shard)
        calls = []
        tokens, logits = greedy(model, kv_shard=(shard.dcp_rank, shard.dcp) if shard.dcp > 1 else None,
                                decode_calls=calls)
        return tokens, logits, shard.expert_mode, calls
    finally:
        shutdown_rank()


CASES = [
    ("k3-tiny", "tp2", "auto"), ("k3-tiny", "tp4", "tp"), ("k3-tiny", "dcp2", "auto"), ("k3-tiny", "dcp4", "auto"),
    ("k3-tiny", "dcp8", "auto"), ("k3-tiny", "tp2-dcp2", "tp"), ("kimi-linear-tiny", "tp2", "tp"),
    ("kimi-linear-tiny", "tep4", "auto"), ("kimi-linear-tiny", "dcp4", "auto"), ("kimi-linear-tiny", "tp2-dcp2", "auto"),
]
_reference = {}


def reference(name):
    if name not in _reference:
        _reference[name] = greedy(whole_model(wide_config(name)))
    return _reference[name]


@pytest.mark.parametrize("name,topology,experts", CASES, ids=[f"{n}-{t}-{e}" for n, t, e in CASES])
def test_matches_single_process(name, topology, experts):
    cfg = wide_config(name)
    ref_tokens, ref_logits = reference(name)
    world = parse_topology(topology).world
    results = launch(_rank_run, world, (cfg, topology, experts), timeout_s=TIMEOUT_S)
    for rank, (tokens, logits, mode, calls) in enumerate(results):
        assert torch.equal(tokens, ref_tokens), f"rank {rank}"
        err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
        assert err < 1e-4, f"rank {rank}: max rel err {err:.2e}"
        # the planner's per-step collectives are the ones the rank issued (per token: the batch has 2)
        plan = rank_plan(cfg, parse_topology(topology, experts), rank, torch.float32)
        want = sorted((c.op, c.group, c.message_bytes) for c in plan.collectives for _ in range(c.count))
        assert sorted((op, role, n // len(PROMPTS)) for op, role, n in calls) == want
    if experts != "auto":
        assert results[0][2] == experts
