"""P9: on tp2 rank graphs every all-reduce that feeds P7's residual add + AttnRes + RMSNorm becomes one
k3.all_reduce_attn_res_norm node (exact counts); run over gloo, each rank's graph computes what it
did before the pass. A whole-model graph has no all-reduce: 0 matches."""
import pytest
import torch

from k3compile.passes.kernels import all_reduce_norm  # noqa: F401  (registers the fused op)

from .helpers import graph, layer_counts
from .parallel_helpers import assert_same_over_gloo, count, passes_before, rank_graphs, run_passes

FUSED = torch.ops.k3.all_reduce_attn_res_norm.default
ALL_REDUCE = torch.ops.k3.all_reduce.default
P9 = "p09_all_reduce_norm"


def _expected(cfg) -> int:
    n = layer_counts(cfg)
    return n["layers"] + n["dense"] + (0 if cfg.latent_size is not None else n["moe"])


@pytest.mark.parametrize("name,mode", [("k3-tiny", "decode"), ("kimi-linear-tiny", "prefill")])
def test_counts_and_numerics_on_tp2_rank_graphs(name, mode):
    cfg, graphs = rank_graphs(name, mode, P9)
    for before, after, matches, _ in graphs:
        assert matches == _expected(cfg)  # k3-tiny: 9 mixers + 1 dense; kimi-linear-tiny: 6 + 1 + 5 MoE
        assert count(after, FUSED) == matches
        assert count(after, ALL_REDUCE) == count(before, ALL_REDUCE) - matches
    assert_same_over_gloo(graphs)


def test_single_graph_has_nothing_to_fuse():
    gm = graph("k3-tiny", "decode", torch.float32)
    run_passes(gm, passes_before(P9), "decode")
    assert run_passes(gm, [P9], "decode")[P9] == 0
