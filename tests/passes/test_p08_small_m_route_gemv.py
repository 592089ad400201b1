"""p08_small_m_route_gemv: after P1-P7's norm_route and P8 (choice=gemv), one k3.norm_route_gemv per K3 MoE layer (the
router's norm + the MoE front GEMV on its h), carrying both ops' arguments; none in Kimi Linear (no front GEMV) or
without k3.gemv; numerics exactly those of the graph before the pass on CPU (the same ops) and close to eager; the
op's checks and registration; the kernel under the interpreter (tests/passes/kernels/interpret_norm_route.py); on
CUDA the kernel at k3-mini-6b's shape under a CUDA graph with PDL."""
import operator

import pytest
import torch

from k3compile.passes.kernels import arrivals
from k3compile.passes.kernels import gemv as gv
from k3compile.passes.kernels import norm_route as nr
from k3compile.passes.pipeline import PipelineConfig, pipeline_from_flags
from k3compile.passes.registry import PassConfigError, get_pass

from .helpers import MODELS, assert_as_before_and_close_to_eager, assert_one_graph_node, assert_pass_leaves_alone, \
    graph_after_p8, layer_counts, model, op_counts, rel_err, run_pass

P = "p08_small_m_route_gemv"
FUSED = torch.ops.k3.norm_route_gemv.default
ROUTE = torch.ops.k3.norm_route.default
GEMV = torch.ops.k3.gemv.default


def _expected(name) -> int:
    """K3: every MoE layer (its front GEMV reads the router's h); Kimi Linear: none (the shared gate/up is a slot of
    P6's kernel A, the routed experts read h themselves)."""
    return {"k3-tiny": layer_counts(model(name).config)["moe"], "kimi-linear-tiny": 0}[name]


@pytest.mark.parametrize("name", MODELS)
def test_one_fused_node_per_moe_front(name):
    gm = graph_after_p8(name)
    before = op_counts(gm)
    want = _expected(name)
    assert want == {"k3-tiny": 8, "kimi-linear-tiny": 0}[name]
    fed = {}  # each router's arguments and the gemv its h fed: both must reach the fused node
    for route in [n for n in gm.graph.nodes if n.target == ROUTE]:
        (h,) = [u for u in route.users if u.args[1] == 0] or [None]
        if h is not None and len(h.users) == 1 and next(iter(h.users)).target == GEMV:
            fed[route.args[9]] = (route.args, next(iter(h.users)).args[1:])
    assert len(fed) == want
    assert run_pass(gm, P) == want
    after = op_counts(gm)
    assert after[FUSED] == want and after[ROUTE] == before[ROUTE] - want and after[GEMV] == before[GEMV] - want
    for node in [n for n in gm.graph.nodes if n.target == FUSED]:
        route_args, gemv_args = fed[node.args[9]]
        assert tuple(node.args[:16]) == tuple(route_args[:16])
        assert tuple(node.args[16:18]) == (tuple(route_args[16:]) + ("rounds", 0)[len(route_args) - 16:])
        assert node.args[18] is gemv_args[0] and gemv_args[1] is None  # W; no bias
        assert tuple(node.args[19:19 + len(gemv_args) - 2]) == tuple(gemv_args[2:])  # max_m ..., as P8 tuned them
        weight = getattr(gm, node.args[18].target)
        assert tuple(node.args[20:23]) == gv.default_config(*weight.shape)  # P8's choice="gemv" configuration
        assert node.args[29] == nr.FUSED_MAX_TOKENS and len(node.args) == 30  # max_tokens; front_block unset
        assert {u.target for u in node.users} == {operator.getitem}
        assert 0 not in {u.args[1] for u in node.users}  # h: its one reader was the gemv
        assert 4 in {u.args[1] for u in node.users}
    assert_pass_leaves_alone(gm, P)


def test_folding_the_front_takes_p6s_up_prewait_off():
    """P6's up_prewait reads the expert ids before kernel A's gdc_wait, safe only while the router runs two launches
    before A. Once the front GEMV is folded into the router's launch, the router is the launch right before A: each
    MoE node that reads the fused node's ids gets up_prewait False (the other arguments unchanged)."""
    from .helpers import UP_TO_P7, graph_after
    gm = graph_after("k3-tiny", "decode", torch.bfloat16, UP_TO_P7[:5])
    run_pass(gm, "p06_fused_moe_decode", up_prewait=True)
    for name in UP_TO_P7[6:]:
        run_pass(gm, name)
    run_pass(gm, "p08_small_m_gemm", choice="gemv")
    moe = [n for n in gm.graph.nodes if n.target == torch.ops.k3.fused_moe_decode.default]
    assert moe and all(n.args[30] is True for n in moe)
    before = {n: n.args for n in moe}
    assert run_pass(gm, P) == _expected("k3-tiny")
    for n in moe:  # ids and weights (args 1, 2) now come from the fused node's outputs
        assert n.args[30] is False and n.args[1].args[0].target == torch.ops.k3.norm_route_gemv.default
        assert all(a is b for i, (a, b) in enumerate(zip(n.args, before[n])) if i not in (1, 2, 30))


@pytest.mark.parametrize("name,mode,choice", [("k3-tiny", "decode", "cublas"), ("k3-tiny", "prefill", "gemv")])
def test_graphs_without_gemv_or_router_are_left_alone(name, mode, choice):
    gm = graph_after_p8(name, mode, choice)
    assert op_counts(gm)[GEMV] == 0 or op_counts(gm)[ROUTE] == 0
    assert_pass_leaves_alone(gm, P)


@pytest.mark.parametrize("name", MODELS)
def test_numerics_equal_the_graph_before_and_close_to_eager(name):
    before = graph_after_p8(name)
    gm = graph_after_p8(name)
    assert run_pass(gm, P) == _expected(name)
    assert_as_before_and_close_to_eager(gm, before, name, seeds=(1,))  # the same ops on CPU


def test_off_by_default_after_p8_and_switchable():
    """Off until measured on the device; --enable-pass / enabled=true turn it on, after P8 and its norm_gemv."""
    order = PipelineConfig.default().order
    assert order.index(P) > order.index("p08_small_m_norm_gemv") > order.index("p08_small_m_gemm")
    assert not PipelineConfig.default().config(P).enabled and P not in PipelineConfig.default().enabled_passes()
    on = pipeline_from_flags(enable=[P]).enabled_passes()
    assert on.index(P) == on.index("p08_small_m_gemm") + 1
    assert P in pipeline_from_flags(pass_opts=[f"{P}.enabled=true"]).enabled_passes()
    with pytest.raises(PassConfigError, match="max_tokens"):
        get_pass(P).config_cls(max_tokens=nr.FUSED_MAX_TOKENS + 1).validate()
    with pytest.raises(PassConfigError, match="front_block"):
        get_pass(P).config_cls(front_block=12).validate()


def test_front_block_option_reaches_the_node():
    gm = graph_after_p8("k3-tiny")
    assert run_pass(gm, P, front_block=4) == _expected("k3-tiny")
    assert {n.args[30] for n in gm.graph.nodes if n.target == FUSED} == {4}


def _args(gen, n=3, d=32, experts=16, nf=24, bank_rows=2):
    """norm_route_gemv's arguments at a K3-like tiny shape: an AttnRes bank, E=16 top-4, a 24-row front."""
    bf = torch.bfloat16
    bank = [torch.randn(n, d, generator=gen).to(bf) for _ in range(bank_rows)]
    route = (bank, torch.randn(n, d, generator=gen).to(bf), torch.randn(n, d, generator=gen).to(bf),
             0.05 * torch.randn(d, generator=gen), (1 + 0.1 * torch.randn(d, generator=gen)).to(bf), 1e-5, 1e-6, True,
             0.1 * torch.randn(experts, generator=gen), torch.randn(experts, d, generator=gen).to(bf), 4, True, 1.0,
             1, 1, 16, "bitonic", 0)
    gemv = (torch.randn(nf, d, generator=gen).to(bf), 16, 64, 128, 1, gv.DESIGNS["dot"], True, 4, 0, False, None)
    return route + gemv + (nr.FUSED_MAX_TOKENS,)


def test_op_is_the_composition_and_one_node():
    gen = torch.Generator().manual_seed(0)
    for args in (_args(gen), _args(gen, n=1, bank_rows=0)):
        h, p, w, ids, y = FUSED(*args)
        h0, p0, w0, ids0 = ROUTE(*args[:18])
        assert all(torch.equal(a, b) for a, b in ((h, h0), (p, p0), (w, w0), (ids, ids0)))
        assert torch.equal(y, GEMV(h0, args[18], None, *args[19:29]))
        torch.library.opcheck(FUSED, args)
    args = _args(gen)
    assert_one_graph_node(FUSED, args)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.__setitem__(18, torch.zeros(24, 16).bfloat16()), r"\[N, D = 32\]"),
    (lambda a: a.__setitem__(18, torch.zeros(24, 32)), "share a dtype"),
    (lambda a: a.__setitem__(29, -1), "fused_max_tokens"),
    (lambda a: a.__setitem__(19, 17), "max_m"),
    (lambda a: a.append(3), "front_block"),
])
def test_bad_arguments_raise_clear_errors(change, message):
    args = list(_args(torch.Generator().manual_seed(1)))
    change(args)
    with pytest.raises(ValueError, match=message):
        FUSED(*args)


# ------------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", (1, 8))
def test_cuda_kernel_at_the_k3_mini_shape_in_a_graph_with_pdl(tokens):
    """k3-mini-6b's MoE front: D 2048, a 4-row AttnRes bank, E=96 top-8 router, front rows 2048 (latent 1024 +
    shared gate/up 2 x 512). Launched as the engine does (PDL, in a CUDA graph, replayed twice so the second finds the
    router's counters zeroed, then on new inputs): h, p, weights and ids bit-equal to k3.norm_route's own launch, y
    within bf16 rounding of the fp32 product of that h; and the op above fused_max_tokens (the pair)."""
    d, experts, nf, bf = 2048, 96, 2048, torch.bfloat16
    gen = torch.Generator().manual_seed(tokens)
    bank = [(torch.randn(tokens, d, generator=gen) * (j + 1)).to(bf).cuda() for j in range(4)]
    x, delta = (torch.randn(tokens, d, generator=gen).to(bf).cuda() for _ in range(2))
    query = (0.05 * torch.randn(d, generator=gen)).cuda()
    norm_w = (1 + 0.1 * torch.randn(d, generator=gen)).to(bf).cuda()
    bias = (0.01 * torch.randn(experts, generator=gen)).cuda()
    router_w = (torch.randn(experts, d, generator=gen) / d ** 0.5).to(bf).cuda()
    w = (torch.randn(nf, d, generator=gen) / d ** 0.5).to(bf).cuda()
    route = (bank, x, delta, query, norm_w, 1e-5, 1e-6, True, bias, router_w, 8, True, 2.446, 1, 1, 16, "bitonic", 0)
    gemv = (w, 16, 64, 128, 1, gv.DESIGNS["dot"], True, 4, 0, False, None)

    def check(out):
        base = ROUTE(*route)
        for a, b in zip(out[:4], base):
            assert torch.equal(a, b)
        assert rel_err(out[4].float(), base[0].float() @ w.float().t()) < 1e-2

    FUSED(*route, *gemv, 8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = FUSED(*route, *gemv, 8)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        check(out)
    assert not arrivals.current(x.device, nr.ARRIVALS_OWNER).any()
    x.copy_(torch.randn(x.shape, generator=gen).to(bf))  # new inputs, same graph
    graph.replay()
    torch.cuda.synchronize()
    check(out)
    check(FUSED(*route, *gemv, 0))  # the pair
    check(FUSED(*route, *gemv, 8, 32))  # another front tiling (the pass's front_block option)
