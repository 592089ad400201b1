"""P4 fused routing: one k3.fused_route per MoE layer with the config's knobs read off the graph,
group limiting, renorm off, the bf16 graphs, refusals, numerics vs the unpassed graph and eager."""
import functools
import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.capture import capture_step
from k3compile.model_def.init import init_random
from k3compile.model_def.loader import build_model
from k3compile.model_def.ops.moe_math import route
from k3compile.passes.graph_utils import is_call, val_of
from k3compile.passes.kernels import routing  # noqa: F401  (torch.ops.k3.fused_route)
from k3compile.passes.manager import snapshot
from k3compile.passes.p04_fused_routing import FusedRoutingConfig
from k3compile.passes.registry import PassConfigError
from k3compile.passes.verify import step_inputs

from .helpers import (BF16_TOL, FP32_TOL, MODELS, MODES, assert_same_step, eager_step, graph, inputs_for,
                      layer_counts, model, op_counts, randomized_inputs, run_graph, run_pass)

aten = torch.ops.aten
P4 = "p04_fused_routing"
FUSED = torch.ops.k3.fused_route.default


def _fused_args(gm) -> list[tuple]:
    """The scalar arguments (the absorbed form's router weight, args[7], left out)."""
    return [tuple(a for i, a in enumerate(n.args) if i >= 2 and i != 7) for n in gm.graph.nodes if n.target == FUSED]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("absorb", [0, 16])
def test_one_fused_route_per_moe_layer(name, mode, absorb):
    cfg = model(name).config
    n = layer_counts(cfg)
    gm = graph(name, mode)
    before = op_counts(gm)
    nodes0 = len(gm.graph.nodes)
    assert run_pass(gm, P4, absorb_router_max_tokens=absorb) == n["moe"]
    after = op_counts(gm)
    assert after[FUSED] == n["moe"]
    for op in (aten.topk.default, aten.gather.default):
        assert before[op] == n["moe"] and after[op] == 0
    assert after[aten.sigmoid.default] == before[aten.sigmoid.default] - n["moe"]
    # per layer: sigmoid, add, topk, 2 getitems, gather, sum, add(eps), div, mul -> fused_route + 2 getitems;
    # absorbing (the raw fp32 capture: P1 has not merged the router GEMM) also takes the router's mm and t
    assert len(gm.graph.nodes) == nodes0 - (9 if absorb else 7) * n["moe"]
    assert after[aten.mm.default] == before[aten.mm.default] - (n["moe"] if absorb else 0)
    expected = (cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor, 1, 1)
    assert _fused_args(gm) == [expected + ((absorb,) if absorb else ())] * n["moe"]
    for node in gm.graph.nodes:  # the bias is the router's correction-bias buffer
        if node.target == FUSED:
            assert node.args[1].op == "get_attr" and node.args[1].target.endswith("e_score_correction_bias")
    code = gm.code
    assert run_pass(gm, P4, absorb_router_max_tokens=absorb) == 0
    assert gm.code == code


@pytest.mark.parametrize("name,mode,dtype", [("k3-tiny", "prefill", torch.float32),
                                             ("kimi-linear-tiny", "decode", torch.float32),
                                             ("k3-tiny", "decode", torch.bfloat16),
                                             ("kimi-linear-tiny", "prefill", torch.bfloat16)])
def test_numerics_vs_unpassed_graph_and_eager(name, mode, dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    before, gm = graph(name, mode, dtype), graph(name, mode, dtype)
    assert run_pass(gm, P4) == layer_counts(model(name).config)["moe"]
    x = inputs_for(name, mode, dtype)
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")
    assert_same_step(got, eager_step(model(name, dtype), mode, x), tol, "vs eager model")


@functools.lru_cache(maxsize=None)
def _grouped_model():
    """Kimi-Linear-like, 3 layers (dense, 2 MoE), 8 experts in 4 groups keeping 2, no renormalization."""
    base = model("kimi-linear-tiny").config
    cfg = base.replace(name="grouped", num_hidden_layers=3, layer_types=("kda", "mla", "kda"), num_expert_group=4,
                       topk_group=2, moe_renormalize=False, routed_scaling_factor=1.5)
    m = build_model(cfg)
    init_random(m, 0)
    return m


def test_group_limit_and_no_renorm_are_read_off_the_graph():
    m = _grouped_model()
    gm = capture_step(m, "decode")
    before = snapshot(gm)
    assert op_counts(gm)[aten.masked_fill.Scalar] == 2
    assert run_pass(gm, P4) == 2
    assert _fused_args(gm) == [(2, False, 1.5, 4, 2, 16)] * 2  # router GEMM absorbed (raw fp32 capture)
    counts = op_counts(gm)
    for op in (aten.topk.default, aten.masked_fill.Scalar, aten.scatter_.value, aten.bitwise_not.default):
        assert counts[op] == 0, op
    x = randomized_inputs(step_inputs(m, "decode"), 3)
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), FP32_TOL, "grouped routing vs unpassed graph")
    assert_same_step(got, eager_step(m, "decode", x), FP32_TOL, "grouped routing vs eager")


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="symbolic")(*args)


def test_bf16_logits_cast_is_absorbed():
    def fn(logits, bias):
        return route(logits.float(), bias, 3, True, 2.0)
    logits, bias = torch.randn(5, 16).bfloat16(), 0.1 * torch.randn(16)
    gm, ref = _trace(fn, logits, bias), _trace(fn, logits, bias)
    assert run_pass(gm, P4) == 1
    fused = next(n for n in gm.graph.nodes if n.target == FUSED)
    assert fused.args[0].op == "placeholder"  # fused_route upcasts itself
    assert op_counts(gm)[aten._to_copy.default] == 0
    for t in (5, 9):
        logits = torch.randn(t, 16).bfloat16()
        (w, i), (w0, i0) = gm(logits, bias), ref(logits, bias)
        assert torch.equal(i, i0) and torch.allclose(w, w0, rtol=1e-6, atol=0)


def _chain(logits, bias, leak: bool):
    scores = logits.sigmoid()
    ids = (scores + bias).topk(2, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    out = (w * 2.0, ids)
    return out + (scores.sum(),) if leak else out


def test_intermediates_read_elsewhere_block_the_match():
    args = (torch.randn(4, 8), torch.randn(8))
    leaky = _trace(lambda a, b: _chain(a, b, True), *args)
    code = leaky.code
    assert run_pass(leaky, P4) == 0
    assert leaky.code == code
    clean = _trace(lambda a, b: _chain(a, b, False), *args)
    assert run_pass(clean, P4) == 1
    assert _fused_args(clean) == [(2, True, 2.0, 1, 1)]


def test_other_constants_do_not_match():
    def other_eps(logits, bias):  # a different renorm epsilon is a different function
        scores = logits.sigmoid()
        ids = (scores + bias).topk(2, dim=-1).indices
        w = scores.gather(1, ids)
        return w / (w.sum(-1, keepdim=True) + 1e-6), ids

    def smallest(logits, bias):  # topk(largest=False) is not routing
        scores = logits.sigmoid()
        ids = (scores + bias).topk(2, dim=-1, largest=False).indices
        return scores.gather(1, ids), ids

    for fn in (other_eps, smallest):
        gm = _trace(fn, torch.randn(4, 8), torch.randn(8))
        assert run_pass(gm, P4) == 0, fn.__name__


def _absorbed(gm) -> list:
    return [n for n in gm.graph.nodes if n.target == FUSED and len(n.args) == 9]


@pytest.mark.parametrize("name,mode", [("kimi-linear-tiny", "decode"), ("k3-tiny", "prefill")])
def test_bf16_router_gemm_is_absorbed(name, mode):
    """bf16 models: the router's fp32 GEMM (on x.float(), with the fp32 weight) goes into the node."""
    n = layer_counts(model(name).config)["moe"]
    before, gm = graph(name, mode, torch.bfloat16), graph(name, mode, torch.bfloat16)
    counts0 = op_counts(gm)
    assert run_pass(gm, P4) == n
    counts = op_counts(gm)
    absorbed = _absorbed(gm)
    assert len(absorbed) == n and counts[FUSED] == n
    for op in (aten.mm.default, aten.t.default):  # one router GEMM per MoE layer gone
        assert counts[op] == counts0[op] - n, op
    cfg = model(name).config
    for node in absorbed:  # the GEMM's own operands: x = _to_copy(h, fp32), W upcast to fp32
        x, weight = node.args[0], node.args[7]
        assert node.args[8] == 16  # the config's default absorb_router_max_tokens
        assert is_call(x, aten._to_copy.default) and val_of(x.args[0]).dtype == torch.bfloat16
        assert val_of(x).dtype == val_of(weight).dtype == torch.float32
        assert tuple(val_of(weight).shape) == (cfg.num_experts, cfg.hidden_size)
    x = inputs_for(name, mode, torch.bfloat16)
    got, want = run_graph(gm, x), run_graph(before, x)
    assert_same_step(got, want, 0.0, "absorbed router vs unpassed graph (CPU: the same ops)")


def test_absorbing_off_keeps_the_router_gemm():
    name, n = "kimi-linear-tiny", layer_counts(model("kimi-linear-tiny").config)["moe"]
    gm = graph(name, "decode", torch.bfloat16)
    counts0 = op_counts(gm)
    assert run_pass(gm, P4, absorb_router_max_tokens=0) == n
    counts = op_counts(gm)
    assert not _absorbed(gm) and counts[FUSED] == n
    assert counts[aten.mm.default] == counts0[aten.mm.default]
    with pytest.raises(PassConfigError, match="absorb_router_max_tokens"):
        FusedRoutingConfig(absorb_router_max_tokens=-1).validate()


def test_fp32_merged_router_gemm_is_not_absorbed():
    """fp32 models: after P1 the router logits are a column block of the MoE front's merged GEMM: kept."""
    gm = graph("kimi-linear-tiny", "decode")
    assert run_pass(gm, "p01_gemm_merge") > 0
    mm0 = op_counts(gm)[aten.mm.default]
    assert run_pass(gm, P4) == layer_counts(model("kimi-linear-tiny").config)["moe"]
    assert not _absorbed(gm) and op_counts(gm)[aten.mm.default] == mm0


def _router(x, w, bias, leak: bool):
    logits = torch.mm(x.float(), w.float().t())
    weights, ids = route(logits, bias, 2, True, 2.0)
    return (weights, ids, logits.sum()) if leak else (weights, ids)


def test_router_gemm_read_elsewhere_is_not_absorbed():
    args = (torch.randn(4, 16).bfloat16(), torch.randn(8, 16).bfloat16(), torch.randn(8))
    gm = _trace(lambda x, w, b: _router(x, w, b, True), *args)
    assert run_pass(gm, P4) == 1 and not _absorbed(gm)
    clean = _trace(lambda x, w, b: _router(x, w, b, False), *args)
    assert run_pass(clean, P4) == 1 and len(_absorbed(clean)) == 1
    assert op_counts(clean)[aten.mm.default] == 0 and op_counts(clean)[aten._to_copy.default] == 2
    fused = _absorbed(clean)[0]
    assert all(is_call(a, aten._to_copy.default) for a in (fused.args[0], fused.args[7]))  # the mm's operands
    for t in (4, 7):
        args = (torch.randn(t, 16).bfloat16(), args[1], args[2])
        (w, i), (w0, i0) = clean(*args), _router(*args, False)
        assert torch.equal(i, i0) and torch.equal(w, w0)


def test_p7_still_writes_the_routers_fp32_input():
    """P4 leaves the router's x = _to_copy(h, fp32) in place, so P7's norm kernel writes that copy as its
    second output (attn_res_norm_f32, one per MoE layer) and the absorbed node reads it: no cast kernel."""
    name = "kimi-linear-tiny"
    moe = layer_counts(model(name).config)["moe"]
    before, gm = graph(name, "decode", torch.bfloat16), graph(name, "decode", torch.bfloat16)
    assert run_pass(gm, P4) == moe
    run_pass(gm, "p07_attn_res_norm")
    f32 = torch.ops.k3.attn_res_norm_f32.default
    assert op_counts(gm)[f32] == moe
    for node in _absorbed(gm):
        assert node.args[0].target is operator.getitem and node.args[0].args[0].target == f32
    x = inputs_for(name, "decode", torch.bfloat16)
    assert_same_step(run_graph(gm, x), run_graph(before, x), BF16_TOL, "P4 + P7 vs unpassed graph")
