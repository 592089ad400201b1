"""P3 casts, copies, DCE: exact matches on the model graphs, each rule (and each refusal) on small
traced functions, and that nodes with side effects survive DCE."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.model_def.ops import library  # noqa: F401  (torch.ops.k3.*)
from k3compile.passes.graph_utils import is_impure

from .helpers import (BF16_TOL, FP32_TOL, MODELS, assert_same_step, attn_res_reads_with_weights, eager_step, graph,
                      inputs_for, layer_counts, model, op_counts, run_graph, run_pass)

aten = torch.ops.aten
P3 = "p03_casts_copies_dce"


def _k3_op_counts(gm) -> dict:
    counts = op_counts(gm)
    return {str(t): c for t, c in counts.items() if str(t).split(".")[0] == "k3"}


def _constant_casts(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == aten._to_copy.default and n.args[0].op == "get_attr")


@pytest.mark.parametrize("name,mode", [(m, mode) for m in MODELS for mode in ("decode", "prefill")])
def test_fp32_graphs_only_lose_the_unused_topk_values(name, mode):
    # fp32 graphs hold no casts (.float() on fp32 is not traced); route() leaves topk's values unused.
    gm = graph(name, mode)
    n = layer_counts(model(name).config)
    k3_before, nodes0 = _k3_op_counts(gm), len(gm.graph.nodes)
    assert run_pass(gm, P3) == n["moe"]
    assert len(gm.graph.nodes) == nodes0 - n["moe"]
    assert _k3_op_counts(gm) == k3_before  # kv_write returns nothing and has no users, yet stays
    code = gm.code
    assert run_pass(gm, P3) == 0
    assert gm.code == code


@pytest.mark.parametrize("name,mode", [("k3-tiny", "decode"), ("kimi-linear-tiny", "prefill")])
def test_bf16_graphs_fold_constant_casts(name, mode):
    m = model(name, torch.bfloat16)
    cfg = m.config
    n = layer_counts(cfg)
    gm, before = graph(name, mode, torch.bfloat16), graph(name, mode, torch.bfloat16)
    # casts of constants: per KDA layer dt_bias, A_log and the gated norm weight; per MoE layer the
    # router weight; per softmax AttnRes read its two weights
    folded = 3 * n["kda"] + n["moe"] + 2 * attn_res_reads_with_weights(cfg)
    assert _constant_casts(gm) == folded
    casts0, k3_before = op_counts(gm)[aten._to_copy.default], _k3_op_counts(gm)
    assert run_pass(gm, P3) == folded + n["moe"]
    assert _constant_casts(gm) == 0
    assert op_counts(gm)[aten._to_copy.default] == casts0 - folded
    assert _k3_op_counts(gm) == k3_before
    params = dict(m.named_parameters())
    router = getattr(gm, "w_model_layers_1_block_sparse_moe_gate_weight_fp32")
    assert router.dtype == torch.float32
    assert torch.equal(router, params["model.layers.1.block_sparse_moe.gate.weight"].float())
    assert not hasattr(gm, "w_model_layers_1_block_sparse_moe_gate_weight")  # the bf16 original is dead
    x = inputs_for(name, mode, torch.bfloat16)
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), BF16_TOL, "vs unpassed graph")
    assert_same_step(got, eager_step(m, mode, x), BF16_TOL, "vs eager model")


def test_fp32_numerics_after_p1_p2_p3():
    before, gm = graph("kimi-linear-tiny", "decode"), graph("kimi-linear-tiny", "decode")
    for p in ("p01_gemm_merge", "p02_noop_views", P3):
        run_pass(gm, p)
    x = inputs_for("kimi-linear-tiny", "decode")
    assert_same_step(run_graph(gm, x), run_graph(before, x), FP32_TOL, "vs unpassed graph")


# ----------------------------------------------------------------------------- rules on small graphs

def _trace(fn, *args):
    return make_fx(fn, tracing_mode="symbolic")(*args)


def _casts(h, f):  # h: bf16, f: fp32
    up_down = h.float().to(torch.bfloat16)      # exact round trip: h itself
    down_up = f.to(torch.bfloat16).float()      # rounds: must stay
    up_up = h.float().double()                  # exact first step: h.double()
    same = aten._to_copy.default(f, dtype=torch.float32)  # cast to its own dtype: a copy of f
    return up_down * 2, down_up * 2, up_up * 2, same * 2


def test_cast_rules():
    args = (torch.randn(4, 3).bfloat16(), torch.randn(4, 3))
    gm, ref = _trace(_casts, *args), _trace(_casts, *args)
    assert op_counts(gm)[aten._to_copy.default] == 7
    assert run_pass(gm, P3, fold_constant_casts=False, dce=False) == 3  # up_down, up_up shortened, same
    assert run_pass(gm, P3) == 2  # the dead inner casts of up_down and up_up
    assert op_counts(gm)[aten._to_copy.default] == 3  # down_up's two + h.double()
    for shape in [(4, 3), (6, 1)]:
        h, f = torch.randn(*shape).bfloat16(), torch.randn(*shape)
        for a, b in zip(gm(h, f), ref(h, f)):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_cast_chain_over_a_tensor_written_in_between_stays():
    def fn(h):
        up = h.float()
        h.mul_(2)              # the first cast is a snapshot of h before this write
        return up.double()
    gm = _trace(fn, torch.randn(3).bfloat16())
    code = gm.code
    assert run_pass(gm, P3) == 0
    assert gm.code == code
    h = torch.randn(4).bfloat16()
    assert torch.equal(gm(h.clone()), h.double())


def _copies(x, pool):
    a = x.clone()              # same layout as x, nobody writes either: removable
    b = x.t().contiguous()     # a row-major copy of a transposed view: another layout, stays
    b2 = x.t().clone()         # keeps the transposed strides (preserve_format): removable
    c = pool.clone()           # pool is written below: the copy must keep the old values
    pool.add_(1)               # in-place, result unused: DCE must keep it
    d = x.clone()
    d.mul_(2)                  # the copy itself is written: stays
    x.sin()                    # dead and pure: removed
    return a + 1, b + 1, b2 + 1, c + 1, d, x.clone()  # last: a graph input's copy as output stays


def test_copy_rules_and_side_effects():
    args = (torch.randn(3, 4), torch.randn(2, 5))
    gm, ref = _trace(_copies, *args), _trace(_copies, *args)
    assert op_counts(gm)[aten.clone.default] == 6
    assert run_pass(gm, P3) == 3  # the clones for `a` and `b2`, the dead sin
    counts = op_counts(gm)
    assert counts[aten.clone.default] == 4 and counts[aten.add_.Tensor] == 1 and counts[aten.mul_.Tensor] == 1
    assert counts[aten.sin.default] == 0
    for shapes in [((3, 4), (2, 5)), ((5, 2), (4, 1))]:
        x1, p1 = torch.randn(*shapes[0]), torch.randn(*shapes[1])
        x2, p2 = x1.clone(), p1.clone()
        outs, refs = gm(x1, p1), ref(x2, p2)
        assert torch.equal(p1, p2)
        for a, b in zip(outs, refs):
            assert torch.equal(a, b)


def test_dce_keeps_pool_writers_and_random_ops():
    def fn(rows, kv, loc, x):
        torch.ops.k3.kv_write(rows, kv, 0, loc)   # returns nothing, writes kv
        torch.rand_like(x)                        # unused, but draws from the RNG
        x.cos()                                   # unused and pure
        return x * 2
    args = (torch.randn(2, 6), torch.zeros(4, 1, 2, 6), torch.tensor([1, 5]), torch.randn(3))
    gm = _trace(fn, *args)
    assert run_pass(gm, P3) == 1
    targets = {str(n.target) for n in gm.graph.nodes}
    assert "k3.kv_write.default" in targets and "aten.rand_like.default" in targets
    assert "aten.cos.default" not in targets
    kv = torch.zeros(4, 1, 2, 6)
    rows = torch.randn(2, 6)
    gm(rows, kv, torch.tensor([1, 5]), torch.randn(3))
    assert torch.equal(kv[0, 0, 1], rows[0]) and torch.equal(kv[2, 0, 1], rows[1])


def test_is_impure_table():
    gm = graph("k3-tiny", "decode")
    for node in gm.graph.nodes:
        name = str(node.target)
        if name.startswith("k3.") and name.split(".")[1] in ("kv_write", "short_conv_decode", "kda_decode"):
            assert is_impure(node), name
        if name in ("aten.mm.default", "aten.view.default", "aten.t.default"):
            assert not is_impure(node), name


def test_every_part_can_be_disabled():
    gm = graph("kimi-linear-tiny", "prefill")
    code = gm.code
    assert run_pass(gm, P3, fold_constant_casts=False, remove_casts=False, remove_copies=False, dce=False) == 0
    assert gm.code == code
