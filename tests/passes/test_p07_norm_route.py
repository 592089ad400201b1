"""p07_norm_route: after P1-P7, one k3.norm_route per MoE layer in bf16 decode graphs (K3-style AttnRes and
Kimi-Linear's plain residual), none in prefill or fp32 graphs; the fp32 router copies leave the weights for bf16
ones; numerics exactly those of the graph before the pass (CPU: the same references), close to the eager model;
the op's checks and registration; the kernel under the interpreter; on CUDA the kernel at the 48B shape."""
import operator

import pytest
import torch

from k3compile.passes.kernels import arrivals
from k3compile.passes.kernels import norm_route as nr
from k3compile.passes.registry import PassConfigError, get_pass

from .helpers import (MODELS, assert_as_before_and_close_to_eager, assert_one_graph_node, assert_pass_leaves_alone,
                      graph_after, layer_counts, model, op_counts, run_pass)

P = "p07_norm_route"
BEFORE = ("p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing", "p05_fused_kda_decode",
          "p06_fused_moe_decode", "p07_attn_res_norm")
FUSED = torch.ops.k3.norm_route.default
NORM_F32 = torch.ops.k3.attn_res_norm_f32.default
ROUTE = torch.ops.k3.fused_route.default


def _after_p7(name, mode, dtype=torch.bfloat16):
    """A private copy of the graph after P1-P7 (the passes run once per graph and session)."""
    return graph_after(name, mode, dtype, BEFORE)


def _weights(gm) -> dict:
    return {k: v for k, v in gm.state_dict().items()}


@pytest.mark.parametrize("name", MODELS)
def test_one_fused_node_per_moe_layer_in_bf16_decode(name):
    moe = layer_counts(model(name).config)["moe"]
    gm = _after_p7(name, "decode")
    before, weights0 = op_counts(gm), _weights(gm)
    assert before[NORM_F32] == before[ROUTE] == moe
    assert run_pass(gm, P) == moe
    after, weights = op_counts(gm), _weights(gm)
    assert after[FUSED] == moe and after[NORM_F32] == 0 and after[ROUTE] == 0
    assert after[torch.ops.k3.attn_res_norm.default] == before[torch.ops.k3.attn_res_norm.default]
    for node in [n for n in gm.graph.nodes if n.target == FUSED]:
        w = node.args[9]
        assert w.op == "get_attr" and getattr(gm, w.target).dtype == torch.bfloat16  # the checkpoint's dtype
        assert node.args[15] == 16  # P4's absorb_router_max_tokens
        # its weights / ids feed P6's fused MoE directly, h the MoE's input
        assert {u.target for u in node.users} == {operator.getitem}
    # the fp32 router copies are gone, bf16 ones (half the bytes) in their place
    gone = set(weights0) - set(weights)
    new = set(weights) - set(weights0)
    assert len(gone) == len(new) == moe
    assert all(weights0[k].dtype == torch.float32 for k in gone)
    assert all(weights[k].dtype == torch.bfloat16 and k.endswith("_bf16") for k in new)
    assert sum(weights[k].numel() for k in new) == sum(weights0[k].numel() for k in gone)
    assert_pass_leaves_alone(gm, P)


@pytest.mark.parametrize("options, trailing", [({"tail": "rounds"}, ()), ({}, ("bitonic",)),
                                              ({"target_programs": 64}, ("bitonic", 64)),
                                              ({"tail": "lean", "target_programs": 32}, ("lean", 32))])
def test_launch_options_ride_on_the_node_only_when_set(options, trailing):
    name = MODELS[0]
    moe = layer_counts(model(name).config)["moe"]
    gm = _after_p7(name, "decode")
    assert run_pass(gm, P, **options) == moe
    nodes = [n for n in gm.graph.nodes if n.target == FUSED]
    assert len(nodes) == moe
    assert all(tuple(n.args[16:]) == trailing for n in nodes)  # rounds: the 16 arguments of engines before them


@pytest.mark.parametrize("options, message", [({"tail": "sorted"}, "tail must be one of rounds, lean, bitonic"),
                                              ({"target_programs": -1}, "target_programs must be >= 0")])
def test_bad_launch_options_are_refused(options, message):
    with pytest.raises(PassConfigError, match=message):
        get_pass(P).config_cls(**options).validate()


@pytest.mark.parametrize("name,mode,dtype", [(n, "prefill", torch.bfloat16) for n in MODELS]
                         + [("k3-tiny", "decode", torch.float32)])
def test_prefill_and_fp32_graphs_are_left_alone(name, mode, dtype):
    gm = _after_p7(name, mode, dtype)
    assert_pass_leaves_alone(gm, P)


@pytest.mark.parametrize("name", MODELS)
def test_numerics_equal_the_graph_before_and_close_to_eager(name):
    before = _after_p7(name, "decode")
    gm = _after_p7(name, "decode")
    assert run_pass(gm, P) == layer_counts(model(name).config)["moe"]
    assert_as_before_and_close_to_eager(gm, before, name)  # same references on CPU


def _args(gen, n=3, d=32, e=16, bank_rows=1):
    bf = torch.bfloat16
    bank = [torch.randn(n, d, generator=gen).to(bf) for _ in range(bank_rows)]
    return (bank, torch.randn(n, d, generator=gen).to(bf), torch.randn(n, d, generator=gen).to(bf),
            torch.randn(d, generator=gen) if bank_rows else None, torch.randn(d, generator=gen).to(bf), 1e-5, 1e-6,
            True, 0.1 * torch.randn(e, generator=gen), torch.randn(e, d, generator=gen).to(bf), 4, True, 2.5, 4, 2, 16)


def test_op_is_the_composition_and_one_node():
    gen = torch.Generator().manual_seed(0)
    args = _args(gen)
    h, p, w, ids = FUSED(*args)
    h7, p7, h32 = torch.ops.k3.attn_res_norm_f32(*args[:8])
    w4, ids4 = ROUTE(h32, args[8], *args[10:15], args[9].float(), 16)
    assert torch.equal(h, h7) and torch.equal(p, p7) and torch.equal(w, w4) and torch.equal(ids, ids4)
    torch.library.opcheck(FUSED, args)
    torch.library.opcheck(FUSED, _args(gen, bank_rows=0))
    assert_one_graph_node(FUSED, args)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.__setitem__(9, torch.zeros(16, 8)), "router_weight must be"),
    (lambda a: a.__setitem__(8, torch.zeros(15)), "bias must be"),
    (lambda a: a.__setitem__(2, torch.zeros(2, 32)), "delta must match x"),
    (lambda a: a.__setitem__(10, 9), "top_k = 9"),
])
def test_bad_arguments_raise_clear_errors(change, message):
    args = list(_args(torch.Generator().manual_seed(1)))
    change(args)
    with pytest.raises(ValueError, match=message):
        FUSED(*args)


# ------------------------------------------------------------------------------------- CUDA

def _shape_args(tokens, dim, experts, bank_rows, gen, top_k=8, groups=1, topk_group=1):
    bf = torch.bfloat16
    bank = [(torch.randn(tokens, dim, generator=gen) * (j + 1)).to(bf).cuda() for j in range(bank_rows)]
    x, delta = ((torch.randn(tokens, dim, generator=gen)).to(bf).cuda() for _ in range(2))
    query = (0.05 * torch.randn(dim, generator=gen)).cuda() if bank_rows else None
    norm_w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(bf).cuda()
    bias = (0.01 * torch.randn(experts, generator=gen)).cuda()
    router_w = (torch.randn(experts, dim, generator=gen) / dim ** 0.5).to(bf).cuda()
    return bank, x, delta, query, norm_w, bias, router_w, (top_k, True, 2.446, groups, topk_group)


def _check_cuda(got, bank, x, delta, query, norm_w, bias, router_w, route):
    h, p, w, ids = got
    h7, p7, h32 = torch.ops.k3.attn_res_norm_f32(bank, x, delta, query, norm_w, 1e-5, 1e-6, False)
    assert torch.equal(p, p7)
    assert ((h.float() - h7.float()).abs().max() / h7.float().abs().max()).item() <= 1e-2
    # the routing of the kernel's own h, on cuBLAS: ids agree except near-ties, weights to fp32 rounding
    ref_w, ref_ids = nr.routing.linear_route_reference(h.float().cpu(), router_w.cpu(), bias.cpu(), *route)
    if not torch.equal(ids.cpu(), ref_ids):
        choice = nr.routing.router_logits(h.float().cpu(), router_w.cpu()).sigmoid() + bias.cpu()
        torch.testing.assert_close(choice.gather(1, ids.cpu()), choice.gather(1, ref_ids), rtol=0, atol=1e-6)
    else:
        torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("shape", ["kimi-linear-48b", "k3-mini-6b"])
def test_cuda_kernel_at_real_shapes(tokens, shape):
    """48B: D=2304, E=256 top-8, no bank; k3-mini-6b: D=2048, a 4-row AttnRes bank (E=256 top-8 here)."""
    dim, bank_rows = (2304, 0) if shape == "kimi-linear-48b" else (2048, 4)
    gen = torch.Generator().manual_seed(tokens)
    bank, x, delta, query, norm_w, bias, router_w, route = _shape_args(tokens, dim, 256, bank_rows, gen)
    args = (bank, x, delta, query, norm_w, 1e-5, 1e-6, True, bias, router_w, *route, 16)
    for _ in range(2):  # the second launch finds the counters zeroed again
        _check_cuda(FUSED(*args), bank, x, delta, query, norm_w, bias, router_w, route)
    assert not arrivals.current(x.device, nr.ARRIVALS_OWNER).any()
    # above max_tokens the op runs today's pair: the same h / p, the same ids up to near-ties
    _check_cuda(FUSED(*args[:-1], 0), bank, x, delta, query, norm_w, bias, router_w, route)


def _one_hot_router(experts, dim, gen):
    """Router rows with one nonzero from a few values: every logit is one exact product and many tie exactly."""
    w = torch.zeros(experts, dim)
    w[torch.arange(experts), torch.randint(0, 8, (experts,), generator=gen)] = \
        torch.tensor([0.5, 1.0, -1.0])[torch.randint(0, 3, (experts,), generator=gen)]
    return w.to(torch.bfloat16).cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("shape", ["kimi-linear-48b", "k3-mini-6b"])
@pytest.mark.parametrize("ties", [False, True])
def test_cuda_tails_and_grids_give_the_default_results(tokens, shape, ties):
    """P7's launch options (tail, target_programs) at the real shapes: 48B D=2304, no bank, E=256 top-8; k3-mini-6b
    D=2048, a 4-row bank, E=96 top-8. h, p and ids bit-equal to the default launch (the same logits, an exact
    top-k); weights to fp32 rounding (the k-sum may run in another order); and the CPU reference as _check_cuda."""
    dim, bank_rows, experts = (2304, 0, 256) if shape == "kimi-linear-48b" else (2048, 4, 96)
    gen = torch.Generator().manual_seed(11 + tokens)
    bank, x, delta, query, norm_w, bias, router_w, route = _shape_args(tokens, dim, experts, bank_rows, gen)
    if ties:
        router_w = _one_hot_router(experts, dim, gen)
        bias = torch.tensor([0.0, 0.25])[torch.randint(0, 2, (experts,), generator=gen)].cuda()
    args = (bank, x, delta, query, norm_w, 1e-5, 1e-6, True, bias, router_w, *route, 16)
    base = FUSED(*args)
    for options in (("lean",), ("bitonic",), ("rounds", 32), ("bitonic", 32)):
        for _ in range(2):  # the second launch finds the counters zeroed again (the relaxed reset)
            got = FUSED(*args, *options)
            for a, b in zip(got[:2], base[:2]):
                assert torch.equal(a, b), options
            assert torch.equal(got[3], base[3]), options
            torch.testing.assert_close(got[2], base[2], rtol=1e-6, atol=0)
            _check_cuda(got, bank, x, delta, query, norm_w, bias, router_w, route)
        torch.cuda.synchronize()
        assert not arrivals.current(x.device, nr.ARRIVALS_OWNER).any(), options


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tail", ["rounds", "bitonic"])
def test_cuda_graph_replays_the_fused_kernel(tail):
    gen = torch.Generator().manual_seed(5)
    bank, x, delta, query, norm_w, bias, router_w, route = _shape_args(8, 2304, 256, 0, gen)
    args = (bank, x, delta, query, norm_w, 1e-5, 1e-6, True, bias, router_w, *route, 16, tail)
    eager = FUSED(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = FUSED(*args)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, eager):
        assert torch.equal(a, b)
    x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))  # new inputs, same graph
    graph.replay()
    torch.cuda.synchronize()
    _check_cuda(out, bank, x, delta, query, norm_w, bias, router_w, route)
