"""The whole default pass pipeline on tp2 rank graphs (the communication passes P9, P12, P13 together with
the single-GPU ones): over gloo each rank's passed graph computes what its unpassed graph does, and the
communication passes find their sites (exact counts)."""
import pytest

from .helpers import layer_counts
from .parallel_helpers import assert_same_over_gloo, pipeline_graphs


# k3-tiny prefill: P9 (both forms), P12 into k3.all_reduce, then P13 on P12's reduced latent; kimi-linear-tiny
# decode: P9 reducing P6's fused MoE output in place (P12 then finds nothing). The others: the per-pass tests.
@pytest.mark.parametrize("name,mode", [("k3-tiny", "prefill"), ("kimi-linear-tiny", "decode")])
def test_default_pipeline_on_tp2_rank_graphs(name, mode):
    cfg, graphs = pipeline_graphs(name, mode)
    n = layer_counts(cfg)
    latent = cfg.latent_size is not None
    for _, _, matches, _ in graphs:
        assert matches["p09_all_reduce_norm"] == n["layers"] + n["dense"] + (0 if latent else n["moe"])
        # P6 finalizes decode MoE layers in its own kernel: P12 is left the prefill graphs
        assert matches["p12_moe_finalize_all_reduce"] == (0 if mode == "decode" else n["moe"])
        assert matches["p13_latent_up_column"] == (n["moe"] if latent else 0)
    assert_same_over_gloo(graphs, rtol=1e-4, atol=1e-4)
