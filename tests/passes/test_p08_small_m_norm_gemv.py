"""p08_small_m_norm_gemv: after P1-P7 and P8 (choice=gemv), one k3.norm_gemv per plain pre-norm whose h feeds a
k3.gemv (every non-router norm of Kimi-Linear; only layer 0's bank-free norm of K3), carrying the gemv's
configuration; nothing without k3.gemv; numerics exactly those of the graph before the pass on CPU (the same
references) and close to eager; the op's checks and registration; the kernel under the interpreter; on CUDA the
kernel at the 48B in_proj shape under a CUDA graph with PDL."""
import operator

import pytest
import torch

from k3compile.passes.kernels import arrivals
from k3compile.passes.kernels import gemv as gv
from k3compile.passes.kernels import norm_gemv as ng
from k3compile.passes.pipeline import PipelineConfig, pipeline_from_flags
from k3compile.passes.registry import PassConfigError, get_pass

from .helpers import MODELS, assert_as_before_and_close_to_eager, assert_one_graph_node, assert_pass_leaves_alone, \
    graph_after_p8, layer_counts, model, op_counts, rel_err, run_pass

P = "p08_small_m_norm_gemv"
FUSED = torch.ops.k3.norm_gemv.default
NORM = torch.ops.k3.attn_res_norm.default
GEMV = torch.ops.k3.gemv.default


def _expected(name) -> int:
    """Kimi-Linear: every pre-norm but the MoE layers' (P7's 2L + 1 minus the norm_route ones); K3: the bank-free
    one (layer 0's norm of the embedding; every other read has a bank)."""
    n = layer_counts(model(name).config)
    return {"k3-tiny": 1, "kimi-linear-tiny": 2 * n["layers"] + 1 - n["moe"]}[name]


@pytest.mark.parametrize("name", MODELS)
def test_one_fused_node_per_norm_feeding_a_gemv(name):
    gm = graph_after_p8(name)
    before = op_counts(gm)
    want = _expected(name)
    assert want == {"k3-tiny": 1, "kimi-linear-tiny": 8}[name]
    configs = {}  # the gemv each norm fed: its configuration must reach the fused node
    for norm in [n for n in gm.graph.nodes if n.target == NORM and not n.args[0]]:
        (h,) = [u for u in norm.users if u.args[1] == 0]
        (g,) = h.users
        configs[norm.args[4]] = g.args[1:]
    assert run_pass(gm, P) == want
    after = op_counts(gm)
    assert after[FUSED] == want
    assert after[NORM] == before[NORM] - want and after[GEMV] == before[GEMV] - want
    for node in [n for n in gm.graph.nodes if n.target == FUSED]:
        assert tuple(node.args[4:13]) == tuple(configs[node.args[2]])  # W, c, max_m ... num_warps
        weight = getattr(gm, node.args[4].target)
        assert tuple(node.args[7:10]) == gv.default_config(*weight.shape)  # P8's choice="gemv" configuration
        assert node.args[10] == gv.DESIGNS["dot"] and node.args[11] is True and node.args[12] == 4
        assert node.args[13] == gv.MAX_M  # max_tokens, the default
        assert {u.target for u in node.users} == {operator.getitem}
    assert_pass_leaves_alone(gm, P)


@pytest.mark.parametrize("name,mode,choice", [("kimi-linear-tiny", "decode", "cublas"),
                                              ("kimi-linear-tiny", "prefill", "gemv")])
def test_graphs_without_gemv_are_left_alone(name, mode, choice):
    gm = graph_after_p8(name, mode, choice)
    assert op_counts(gm)[GEMV] == 0
    assert_pass_leaves_alone(gm, P)


@pytest.mark.parametrize("name", MODELS)
def test_numerics_equal_the_graph_before_and_close_to_eager(name):
    before = graph_after_p8(name)
    gm = graph_after_p8(name)
    assert run_pass(gm, P) == _expected(name)
    assert_as_before_and_close_to_eager(gm, before, name, seeds=(1,))  # same references on CPU


def test_off_by_default_right_after_p8_and_switchable():
    """Off by default (slower in the whole H200 step, see the config); --enable-pass / enabled=true turn it on."""
    order = PipelineConfig.default().order
    assert order.index(P) == order.index("p08_small_m_gemm") + 1
    assert not PipelineConfig.default().config(P).enabled and P not in PipelineConfig.default().enabled_passes()
    on = pipeline_from_flags(enable=[P]).enabled_passes()
    assert on.index(P) == on.index("p08_small_m_gemm") + 1
    assert P in pipeline_from_flags(pass_opts=[f"{P}.enabled=true"]).enabled_passes()
    with pytest.raises(PassConfigError, match="max_tokens"):
        get_pass(P).config_cls(max_tokens=17).validate()


def _args(gen, m=3, k=32, n=24, delta=True, c=False):
    bf = torch.bfloat16
    return (torch.randn(m, k, generator=gen).to(bf), torch.randn(m, k, generator=gen).to(bf) if delta else None,
            (1 + 0.1 * torch.randn(k, generator=gen)).to(bf), 1e-6, torch.randn(n, k, generator=gen).to(bf),
            torch.randn(n, generator=gen).to(bf) if c else None, 16, 64, 128, 1, gv.DESIGNS["dot"], True, 4, 16)


def test_op_is_the_composition_and_one_node():
    gen = torch.Generator().manual_seed(0)
    for args in (_args(gen), _args(gen, delta=False, c=True)):
        y, p = FUSED(*args)
        h7, p7 = NORM([], args[0], args[1], None, args[2], 0.0, args[3], True)
        assert torch.equal(p, p7) and torch.equal(y, GEMV(h7, args[4], args[5], *args[6:13]))
        torch.library.opcheck(FUSED, args)
    args = _args(gen)
    assert_one_graph_node(FUSED, args)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.__setitem__(1, torch.zeros(2, 32).bfloat16()), "delta must match x"),
    (lambda a: a.__setitem__(4, torch.zeros(24, 16).bfloat16()), "K = 32"),
    (lambda a: a.__setitem__(2, torch.ones(32)), "share a dtype"),
    (lambda a: a.__setitem__(6, 17), "max_m"),
    (lambda a: a.__setitem__(13, -1), "max_tokens"),
])
def test_bad_arguments_raise_clear_errors(change, message):
    args = list(_args(torch.Generator().manual_seed(1)))
    change(args)
    with pytest.raises(ValueError, match=message):
        FUSED(*args)


# ------------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", (1, 4, 8))
def test_cuda_kernel_at_the_48b_in_proj_shape_in_a_graph_with_pdl(m):
    """48B KDA merged in_proj (N 12576, K 2304): P8's candidates at this M (the rows design at 4 warps: each
    configuration is a compile, the suite's GPU time is short), launched as the engine
    does (PDL, in a CUDA graph, a second replay finding the split-K counters zeroed), against P7's kernel then the
    GEMV; and the op above max_tokens (the pair)."""
    from k3compile.passes.p08_small_m_gemm import _candidates
    n, k = 12576, 2304
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    delta = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).bfloat16()
    w = (0.02 * torch.randn(n, k, device="cuda", generator=gen)).bfloat16()
    h7, p7 = NORM([], x, delta, None, nw, 0.0, 1e-6, False)
    want = h7.float() @ w.float().t()
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for bn, bk, split, design, warps in _candidates(n, k, sm, (4,)):
        if design == gv.DESIGNS["rows"] and m > gv.ROWS_MAX_M:
            continue
        args = (x, delta, nw, 1e-6, w, None, m, bn, bk, split, design, True, warps, 16)
        FUSED(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, p = FUSED(*args)
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(p, p7), (bn, bk, split, design, warps)
            assert rel_err(y.float(), want) < 1e-2, (bn, bk, split, design, warps)
        counters = arrivals.current(x.device, ng.ARRIVALS_OWNER)
        assert counters is None or not counters.any()
    y, p = FUSED(x, delta, nw, 1e-6, w, None, m, 64, 128, 1, gv.DESIGNS["dot"], True, 4, 0)  # the pair
    assert torch.equal(p, p7) and rel_err(y.float(), want) < 1e-2
