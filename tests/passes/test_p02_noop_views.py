"""P2 no-op views: exact matches on the model graphs, symbolic-size care on small traced functions."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .helpers import (FP32_TOL, MODELS, MODES, assert_same_step, eager_step, graph, inputs_for, layer_counts,
                      model, op_counts, run_graph, run_pass)

aten = torch.ops.aten
P2 = "p02_noop_views"
INT64_MAX = 9223372036854775807


def _full_slices(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == aten.slice.Tensor and n.args[2] == 0 and n.args[3] == INT64_MAX
               and n.args[0].meta["val"].shape[n.args[1]] == n.meta["val"].shape[n.args[1]])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", MODES)
def test_counts_on_model_graphs(name, mode):
    # MLA's `ckv[:, :r]` and `ckv[:, r:]` each open with a full `[:]` slice of dim 0: 2 per MLA layer.
    gm = graph(name, mode)
    n = layer_counts(model(name).config)
    nodes0, slices0 = len(gm.graph.nodes), op_counts(gm)[aten.slice.Tensor]
    assert _full_slices(gm) == 2 * n["mla"]
    assert run_pass(gm, P2) == 2 * n["mla"]
    assert _full_slices(gm) == 0
    assert op_counts(gm)[aten.slice.Tensor] == slices0 - 2 * n["mla"]
    assert len(gm.graph.nodes) == nodes0 - 2 * n["mla"]
    code = gm.code
    assert run_pass(gm, P2) == 0  # nothing left to match
    assert gm.code == code


def test_after_gemm_merge_numerics_vs_unpassed_and_eager():
    before, gm = graph("k3-tiny", "decode"), graph("k3-tiny", "decode")
    n = layer_counts(model("k3-tiny").config)
    run_pass(gm, "p01_gemm_merge")
    assert run_pass(gm, P2) == 2 * n["mla"]  # the slices now read column blocks of the merged GEMM
    x = inputs_for("k3-tiny", "decode")
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), FP32_TOL, "vs unpassed graph")
    assert_same_step(got, eager_step(model("k3-tiny"), "decode", x), FP32_TOL, "vs eager model")


def _views(x, y):
    a = x[:, :]                              # two full slices: no-ops
    b = a.view(a.shape)                      # view to its own shape: no-op
    c = b.view(-1).view(x.shape[0], -1)      # chain over contiguous x: collapses, then is x itself
    d = y.t().view(-1, 2, 2).view(-1, 4)     # chain over a transposed y: must stay
    e = x[: x.shape[0] - 1]                  # a real slice (symbolic end): must stay
    g = x[:, : x.shape[1]].expand(x.shape)   # full slice + expand to own shape: no-ops
    return c + 1, d * 2, e * 3, g * 4


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="symbolic")(*args)


def test_symbolic_views_removed_kept_and_collapsed():
    gm = _trace(_views, torch.randn(3, 5), torch.randn(4, 6))
    ref = _trace(_views, torch.randn(3, 5), torch.randn(4, 6))
    # slice, slice, view, (view_2: chain collapsed, then a no-op), slice, expand
    assert run_pass(gm, P2) == 7
    counts = op_counts(gm)
    assert counts[aten.slice.Tensor] == 1  # x[: n - 1]
    assert counts[aten.view.default] == 2  # the two over y.t()
    assert counts[aten.expand.default] == 0
    for shapes in [((3, 5), (4, 6)), ((7, 2), (4, 9))]:  # another size than traced: still symbolic
        x, y = torch.randn(*shapes[0]), torch.randn(*shapes[1])
        for a, b in zip(gm(x, y), ref(x, y)):
            assert torch.equal(a, b)


def test_unknown_symbolic_equality_keeps_the_node():
    def fn(x, n):
        return x[: n.shape[0]] * 2  # equal to x's length only if the two symbols are equal: not provable
    gm = _trace(fn, torch.randn(5, 2), torch.randn(3))
    code = gm.code
    assert run_pass(gm, P2) == 0
    assert gm.code == code


def test_chain_collapse_can_be_turned_off():
    def fn(x):
        return x.view(-1).view(x.shape[0], 2, -1) + 1
    gm = _trace(fn, torch.randn(3, 4))
    assert run_pass(gm, P2, collapse_chains=False) == 0
    assert run_pass(gm, P2) == 1
    assert op_counts(gm)[aten.view.default] == 1
