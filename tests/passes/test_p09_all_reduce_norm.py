"""P9: on tp2 rank graphs every all-reduce that feeds P7's residual add + AttnRes + RMSNorm becomes one
k3.all_reduce_attn_res_norm node (exact counts); run over gloo, each rank's graph computes what it
did before the pass. A whole-model graph has no all-reduce: 0 matches."""
import pytest
import torch

from k3compile.capture import capture_step
from k3compile.model_def.parallel.shard import shard_model
from k3compile.model_def.parallel.topology import RankShard, parse_topology
from k3compile.passes.kernels import all_reduce_norm  # noqa: F401  (registers the fused op)
from k3compile.passes.manager import PassManager
from k3compile.passes.pipeline import pipeline_from_flags
from k3compile.passes.registry import registered_passes
from k3compile.passes.verify import step_inputs
from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
from k3compile.runtime.parallel.launch import launch
from tests.model_def.parallel.helpers import whole_model, wide_config

from .helpers import graph, layer_counts, snapshot

FUSED = torch.ops.k3.all_reduce_attn_res_norm.default
ALL_REDUCE = torch.ops.k3.all_reduce.default


def _expected(cfg) -> int:
    n = layer_counts(cfg)
    return n["layers"] + n["dense"] + (0 if cfg.latent_size is not None else n["moe"])


def _count(gm, op):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == op)


def _rank_graphs(name, mode):
    """Per rank of tp2: (graph after P1-P8, the same graph after P9, P9's match count, inputs)."""
    cfg = wide_config(name, 2)
    whole = whole_model(cfg)
    out = []
    for r in range(2):
        m = shard_model(whole, RankShard.of(cfg, parse_topology("tp2"), r))
        gm = capture_step(m, mode)
        PassManager(_before_p09()).run(gm, graph_name=mode)
        after = snapshot(gm)
        report = PassManager(_only_p09()).run(after, graph_name=mode)
        out.append((gm, after, report.matches()["p09_all_reduce_norm"], step_inputs(m, mode, seed=r)))
    return cfg, out


def _before_p09():
    return pipeline_from_flags(passes=",".join(n for n in registered_passes() if n < "p09"))


def _only_p09():
    return pipeline_from_flags(passes="p09_all_reduce_norm")


def _run_both(rank, graphs):
    init_rank(parse_topology("tp2"), "gloo", timeout_s=60)
    try:
        before, after, _, inputs = graphs[rank]
        a = before(*[t.clone() for t in inputs])
        b = after(*[t.clone() for t in inputs])
        return a, b
    finally:
        shutdown_rank()


@pytest.mark.parametrize("name,mode", [("k3-tiny", "decode"), ("kimi-linear-tiny", "prefill")])
def test_counts_and_numerics_on_tp2_rank_graphs(name, mode):
    cfg, graphs = _rank_graphs(name, mode)
    for before, after, matches, _ in graphs:
        assert matches == _expected(cfg)  # k3-tiny: 9 mixers + 1 dense; kimi-linear-tiny: 6 + 1 + 5 MoE
        assert _count(after, FUSED) == matches
        assert _count(after, ALL_REDUCE) == _count(before, ALL_REDUCE) - matches
    for a, b in launch(_run_both, 2, (graphs,), timeout_s=120):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_single_graph_has_nothing_to_fuse():
    gm = graph("k3-tiny", "decode", torch.float32)
    PassManager(_before_p09()).run(gm, graph_name="decode")
    assert PassManager(_only_p09()).run(gm, graph_name="decode").matches()["p09_all_reduce_norm"] == 0
