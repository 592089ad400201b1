"""P13: in tp2 rank graphs of K3-style latent MoE the whole up-projection becomes each rank's column
block, completed inside the shared experts' all-reduce (after P11) or by an all-gather (without P11);
exact counts (one per latent MoE layer), the rank stores 1/2 of the weight, and over gloo every rank
computes what it did before. Whole-model graphs and Kimi-Linear (no latent space): 0."""
import pytest
import torch

from .helpers import graph, layer_counts
from .parallel_helpers import assert_same_over_gloo, count, passes_before, rank_graphs, run_passes

P13 = "p13_latent_up_column"
ALL_REDUCE = torch.ops.k3.all_reduce.default
ALL_GATHER = torch.ops.k3.all_gather.default


def _up_weights(gm):
    return {k: tuple(v.shape) for k, v in gm.named_buffers() if "routed_expert_up_proj" in k}


@pytest.mark.parametrize("mode,skip,completion", [("decode", (), "all_reduce"),
                                                  ("prefill", ("p11_copy_elision",), "all_gather")])
def test_counts_weights_and_numerics(mode, skip, completion):
    cfg, graphs = rank_graphs("k3-tiny", mode, P13, skip)
    moe = layer_counts(cfg)["moe"]
    for rank, (before, after, matches, _) in enumerate(graphs):
        assert matches == moe == 8
        assert count(after, ALL_REDUCE) == count(before, ALL_REDUCE)  # folded: no collective added or lost
        assert count(after, ALL_GATHER) == count(before, ALL_GATHER) + (moe if completion == "all_gather" else 0)
        shapes = _up_weights(after)
        assert len(shapes) == moe and all(s == (cfg.hidden_size // 2, cfg.latent_size) for s in shapes.values())
        assert all(k.endswith(f"cols{rank}of2") for k in shapes)
    assert_same_over_gloo(graphs)


def test_whole_model_and_plain_moe_graphs_are_left_alone():
    for name in ("k3-tiny", "kimi-linear-tiny"):
        gm = graph(name, "decode", torch.float32)
        run_passes(gm, passes_before(P13), "decode")
        assert run_passes(gm, [P13], "decode")[P13] == 0
