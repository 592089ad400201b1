"""P11 copy elision: the add after each layer's output GEMMs folds into the GEMM (addmm / k3.gemv's tail),
exact counts from the layer structure, the copy census before/after, numerics vs the unpassed graph,
refusals (a GEMM result read twice, broadcasting, alpha), and P8's k3.gemv taking the residual."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.passes.p11_copy_elision import copy_nodes

from .helpers import (BF16_TOL, FP32_TOL, MODELS, graph_after, inputs_for, layer_counts, model, op_counts, rel_err,
                      run_graph, run_pass)

aten = torch.ops.aten
P11 = "p11_copy_elision"
GEMV = torch.ops.k3.gemv.default
BEFORE = ("p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing")


def engine_before(name, dtype, mode="decode"):
    return graph_after(name, mode, dtype, BEFORE)


def expected_folds(name, dtype):
    """Per layer: the mixer's o_proj + residual, and the MLP's down_proj + residual (dense) or the shared
    expert's down_proj + routed experts (MoE). fp32 graphs also fold KDA's dt_bias into its GEMM (bf16 graphs
    cast the GEMM's result to fp32 before that add)."""
    n = layer_counts(model(name, dtype).config)
    return 2 * n["layers"] + (n["kda"] if dtype == torch.float32 else 0)


def test_16bit_addmm_folding_is_opt_in():
    """bf16 mm + add rounds twice, a bf16 addmm once: not the same step, so it is not folded by default."""
    gm = engine_before("kimi-linear-tiny", torch.bfloat16)
    code = gm.code
    assert run_pass(gm, P11) == 0 and gm.code == code


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_folds_every_add_after_a_gemm(name, dtype):
    opts = {} if dtype == torch.float32 else {"fold_16bit_addmm": True}
    gm = engine_before(name, dtype)
    before, copies0 = op_counts(gm), copy_nodes(gm)
    want = expected_folds(name, dtype)
    assert want == {("k3-tiny", torch.float32): 24, ("k3-tiny", torch.bfloat16): 18,
                    ("kimi-linear-tiny", torch.float32): 16, ("kimi-linear-tiny", torch.bfloat16): 12}[name, dtype]
    inputs = inputs_for(name, "decode", dtype)
    ref = run_graph(gm, inputs)
    assert run_pass(gm, P11, **opts) == want
    after, copies1 = op_counts(gm), copy_nodes(gm)
    assert after[aten.addmm.default] == want
    assert after[aten.mm.default] == before[aten.mm.default] - want
    assert after[aten.add.Tensor] == before[aten.add.Tensor] - want
    # the census the final report quotes: every add-after-GEMM gone, the copies owned by other passes stay
    assert copies0["add-after-gemm"] == want and copies1["add-after-gemm"] == 0
    assert {k: v for k, v in copies1.items() if k != "add-after-gemm"} == \
        {k: v for k, v in copies0.items() if k != "add-after-gemm"}
    got = run_graph(gm, inputs)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
        if isinstance(b, torch.Tensor):
            assert rel_err(a, b) <= tol
    code = gm.code
    assert run_pass(gm, P11, **opts) == 0 and gm.code == code
    assert run_pass(engine_before(name, dtype), P11, fold_residual_add=False, **opts) == 0


def test_prefill_graph_folds_the_same_adds():
    gm = engine_before("kimi-linear-tiny", torch.float32, "prefill")
    inputs = inputs_for("kimi-linear-tiny", "prefill")
    ref = run_graph(gm, inputs)
    assert run_pass(gm, P11) == expected_folds("kimi-linear-tiny", torch.float32)
    assert rel_err(run_graph(gm, inputs)[0][0], ref[0][0]) <= FP32_TOL


def test_folds_into_p8_gemv():
    gm = engine_before("kimi-linear-tiny", torch.bfloat16)
    run_pass(gm, "p08_small_m_gemm", choice="gemv")
    inputs = inputs_for("kimi-linear-tiny", "decode", torch.bfloat16)
    ref = run_graph(gm, inputs)
    assert run_pass(gm, P11) == 12
    with_c = [n for n in gm.graph.nodes if n.target == GEMV and n.args[2] is not None]
    assert len(with_c) == 12 and op_counts(gm)[aten.addmm.default] == 0
    got = run_graph(gm, inputs)
    for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
        if isinstance(b, torch.Tensor):
            assert rel_err(a, b) == 0.0  # k3.gemv adds c after rounding the product: the unfused step exactly


def _traced(fn, *args):
    gm = make_fx(fn, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)
    gm.meta["k3"] = {"mode": "decode"}
    return gm


def test_refusals():
    w = torch.randn(6, 4)
    x, r = torch.randn(3, 4), torch.randn(3, 6)
    cases = {
        "result read twice": lambda x, r: _twice(x, r, w),
        "broadcast row of M": lambda x, r: x @ w.t() + r[:, :1],
        "alpha": lambda x, r: torch.add(r, x @ w.t(), alpha=2.0),
        "type promotion": lambda x, r: (x.double() @ w.double().t()) + r,
    }
    for what, fn in cases.items():
        gm = _traced(fn, x, r)
        code = gm.code
        assert run_pass(gm, P11) == 0, what
        assert gm.code == code, what
    gm = _traced(lambda x, r: r + x @ w.t() + torch.ones(6), x, r)  # folds the residual; the [N] add reads an add
    assert run_pass(gm, P11) == 1
    assert torch.allclose(gm(x, r), r + x @ w.t() + 1)


def _twice(x, r, w):
    y = x @ w.t()
    return (r + y) * y
