"""P12: in tp2 rank graphs each MoE layer's routing-weighted sum (+ the shared experts' partial) becomes
k3.moe_expert_rows + a finalize that writes the collective's buffer: k3.moe_finalize_all_reduce where the
sum went to a k3.all_reduce (K3's latent sum), k3.moe_finalize feeding P9's collective where it meets the
residual stream (Kimi-Linear). Exact counts, and over gloo each rank's graph computes what it did before.
P6's fused decode op already finalizes in registers: a default decode graph gives 0; a whole-model graph 0."""
import pytest
import torch

from k3compile.passes.kernels import moe_finalize  # noqa: F401  (registers the ops)

from .helpers import graph, layer_counts
from .parallel_helpers import assert_same_over_gloo, count, passes_before, rank_graphs, run_passes

P12 = "p12_moe_finalize_all_reduce"
EXPERTS = torch.ops.k3.moe_experts.default
ROWS = torch.ops.k3.moe_expert_rows.default
FIN = torch.ops.k3.moe_finalize.default
FIN_AR = torch.ops.k3.moe_finalize_all_reduce.default
ALL_REDUCE = torch.ops.k3.all_reduce.default


@pytest.mark.parametrize("name,mode,experts,skip", [
    ("k3-tiny", "prefill", "auto", ()),                          # EP: whole experts per rank
    ("kimi-linear-tiny", "prefill", "tp", ()),                   # TP: every expert's intermediate slice
])  # decode graphs without P6: tests/k3compile/engine/test_parallel_build.py (8 per rank engine, greedy tokens)
def test_counts_and_numerics_on_tp2_rank_graphs(name, mode, experts, skip):
    cfg, graphs = rank_graphs(name, mode, P12, skip, experts)
    moe = layer_counts(cfg)["moe"]
    latent = cfg.latent_size is not None
    for before, after, matches, _ in graphs:
        assert matches == moe == (8 if latent else 5)
        assert count(before, EXPERTS) == moe and count(after, EXPERTS) == 0 and count(after, ROWS) == moe
        # K3: the latent sum went to a plain all-reduce; Kimi-Linear: to P9's collective (its partial)
        assert count(after, FIN_AR) == (moe if latent else 0) and count(after, FIN) == (0 if latent else moe)
        assert count(after, ALL_REDUCE) == count(before, ALL_REDUCE) - (moe if latent else 0)
        if not latent:  # the shared experts' partial rides in the finalize (P11's addmm split back into its mm)
            assert all(n.args[3] is not None for n in after.graph.nodes if n.op == "call_function" and n.target == FIN)
    assert_same_over_gloo(graphs)


def test_whole_model_graph_has_nothing_to_move():
    """No collective in a single-process graph (P6's decode graphs give 0 too: tests/passes/test_parallel_pipeline)."""
    gm = graph("k3-tiny", "prefill", torch.float32)
    run_passes(gm, passes_before(P12), "prefill")
    assert run_passes(gm, [P12], "prefill")[P12] == 0
