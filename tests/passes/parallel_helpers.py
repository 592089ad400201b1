"""Rank graphs of tp2 for the communication-pass tests: captured per rank, run through the passes before
the one under test, copied, the pass applied to the copy; then both run over gloo on the same inputs."""
from __future__ import annotations

import functools

import torch

from k3compile.capture import capture_step
from k3compile.model_def.parallel.shard import shard_model
from k3compile.model_def.parallel.topology import RankShard, parse_topology
from k3compile.passes.manager import PassManager, snapshot
from k3compile.passes.pipeline import PipelineConfig, pipeline_from_flags
from k3compile.passes.verify import step_inputs
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import launch
from tests.model_def.parallel.helpers import whole_model, wide_config

TOPOLOGY = "tp2"


def passes_before(name: str, skip=()) -> list[str]:
    return [p for p in PipelineConfig.default().enabled_passes() if p < name and p not in skip]


def run_passes(gm, names, mode):
    return PassManager(pipeline_from_flags(passes=",".join(names))).run(gm, graph_name=mode).matches()


@functools.lru_cache(maxsize=None)
def _captured_ranks_cached(model_name: str, mode: str, experts: str):
    cfg = wide_config(model_name, 2)
    whole = whole_model(cfg)
    topology = parse_topology(TOPOLOGY, experts)
    models = [shard_model(whole, RankShard.of(cfg, topology, r)) for r in range(topology.world)]
    return cfg, [(m, capture_step(m, mode)) for m in models]


def _captured_ranks(model_name: str, mode: str, experts: str):
    """(cfg, [(rank model, a private copy of its captured `mode` step)]) for each rank of tp2 (routed experts
    placed as `experts` says: auto = whole experts per rank on the tiny presets, tp = sliced). Captured once per
    process (two ranks: ~15 CPU s); the copies share weights, which passes never write in place."""
    cfg, ranks = _captured_ranks_cached(model_name, mode, experts)
    return cfg, [(m, snapshot(gm)) for m, gm in ranks]


def rank_graphs(model_name: str, mode: str, pass_name: str, skip=(), experts: str = "auto"):
    """[(graph before the pass, graph after it, its match count, step inputs)] for each rank of tp2."""
    cfg, ranks = _captured_ranks(model_name, mode, experts)
    out = []
    for r, (m, gm) in enumerate(ranks):
        run_passes(gm, passes_before(pass_name, skip), mode)
        after = snapshot(gm)
        out.append((gm, after, run_passes(after, [pass_name], mode)[pass_name], step_inputs(m, mode, seed=r)))
    return cfg, out


def pipeline_graphs(model_name: str, mode: str, experts: str = "auto"):
    """[(unpassed rank graph, the same after the whole default pipeline, its match counts, step inputs)]."""
    cfg, ranks = _captured_ranks(model_name, mode, experts)
    out = []
    for r, (m, gm) in enumerate(ranks):
        after = snapshot(gm)
        passes = PipelineConfig.default().enabled_passes()
        out.append((gm, after, run_passes(after, passes, mode), step_inputs(m, mode, seed=r)))
    return cfg, out


def _run_both(rank, graphs):
    init_rank(parse_topology(TOPOLOGY), "gloo", timeout_s=60)
    try:
        before, after, _, inputs = graphs[rank]
        return before(*[t.clone() for t in inputs]), after(*[t.clone() for t in inputs])
    finally:
        shutdown_rank()


def assert_same_over_gloo(graphs, rtol=1e-5, atol=1e-5):
    for a, b in launch(_run_both, len(graphs), (graphs,), timeout_s=120):
        assert torch.allclose(a, b, rtol=rtol, atol=atol), (a - b).abs().max()


def count(gm, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == op)
