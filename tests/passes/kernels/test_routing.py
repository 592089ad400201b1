"""Fused MoE routing (k3::fused_route): reference vs transformers, edge cases, the Triton kernel
(under the interpreter on CPU, natively on CUDA), and the op's registration and traceability."""
import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.passes.kernels.routing import route_reference, route_triton

from .interpreted import run_interpreted

FUSED_ROUTE = torch.ops.k3.fused_route.default


def _hf_router(num_experts, top_k, groups, topk_group, scaling, renormalize, hidden=16, seed=0):
    transformers = pytest.importorskip("transformers")
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    config = transformers.KimiLinearConfig(
        hidden_size=hidden, num_local_experts=num_experts, num_experts_per_tok=top_k, n_group=groups,
        topk_group=topk_group, routed_scaling_factor=scaling, norm_topk_prob=renormalize)
    router = KimiLinearTopkRouter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=gen))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(num_experts, generator=gen))
    return router


def _by_expert(weights, ids):
    """Sort each token's (id, weight) pairs by id so set-valued routings can be compared."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize("num_experts,top_k,groups,topk_group,scaling,renormalize", [
    (8, 2, 1, 1, 2.446, True),     # Kimi-Linear style
    (64, 6, 1, 1, 1.0, True),      # K3 style (scaling 1.0)
    (64, 6, 4, 2, 2.446, True),    # group limiting
    (96, 8, 8, 3, 2.827, False),   # group limiting, no renormalisation
    (16, 16, 1, 1, 1.0, True),     # k == E
])
def test_reference_matches_transformers_router(num_experts, top_k, groups, topk_group, scaling, renormalize):
    router = _hf_router(num_experts, top_k, groups, topk_group, scaling, renormalize)
    hidden = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = route_reference(logits, router.e_score_correction_bias, top_k, renormalize, scaling,
                                   groups, topk_group)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (18, top_k)
    hf_weights, hf_ids = _by_expert(hf_weights, hf_ids)
    weights, ids = _by_expert(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)


def test_ids_are_in_descending_choice_order():
    gen = torch.Generator().manual_seed(2)
    logits, bias = torch.randn(11, 64, generator=gen), 0.1 * torch.randn(64, generator=gen)
    _, ids = route_reference(logits, bias, 8, True, 1.0)
    choice = (logits.sigmoid() + bias).gather(1, ids)
    assert (choice[:, :-1] > choice[:, 1:]).all()


def test_ties_go_to_the_lowest_expert_index():
    weights, ids = route_reference(torch.zeros(2, 16), torch.zeros(16), 4, True, 2.0)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(weights, torch.full((2, 4), 0.5))  # 2.0 / 4
    logits = torch.zeros(1, 8)
    logits[0, [6, 2, 5]] = 3.0  # three-way tie at the top, then a five-way tie
    _, ids = route_reference(logits, torch.zeros(8), 5, True, 1.0)
    assert ids.tolist() == [[2, 5, 6, 0, 1]]


def test_k_equals_num_experts_returns_every_expert():
    gen = torch.Generator().manual_seed(3)
    weights, ids = route_reference(torch.randn(4, 8, generator=gen), torch.zeros(8), 8, True, 2.446)
    assert torch.equal(ids.sort(dim=-1).values, torch.arange(8).expand(4, 8))
    torch.testing.assert_close(weights.sum(-1), torch.full((4,), 2.446))


def test_large_bias_selects_but_does_not_weight():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 32, generator=gen) - 4.0
    bias = torch.zeros(32)
    bias[[7, 19]] = 100.0
    weights, ids = route_reference(logits, bias, 2, False, 1.0)
    assert ids.sort(dim=-1).values.tolist() == [[7, 19]] * 3
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, ids))  # unbiased scores
    assert (weights < 0.5).all()


def test_bf16_logits_compute_in_fp32():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 64, generator=gen).bfloat16()
    bias = 0.1 * torch.randn(64, generator=gen)
    weights, ids = route_reference(logits, bias, 8, True, 2.446)
    ref_weights, ref_ids = route_reference(logits.float(), bias, 8, True, 2.446)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_group_limit_ranks_groups_by_their_top_two():
    # Group 0 holds the single best expert (0.9) but group 1's top two sum higher (0.6 + 0.6).
    bias = torch.tensor([0.4, -0.5, 0.1, 0.1, -0.5, -0.5, -0.5, -0.5])
    _, ids = route_reference(torch.zeros(1, 8), bias, 2, True, 1.0, num_expert_group=4, topk_group=1)
    assert ids.tolist() == [[2, 3]]
    _, ids = route_reference(torch.zeros(1, 8), bias, 2, True, 1.0, num_expert_group=1, topk_group=1)
    assert ids.tolist() == [[0, 2]]


def test_nan_logit_ranks_first_and_shows_in_weights():
    logits = torch.zeros(2, 8)
    logits[1, 5] = float("nan")
    weights, ids = route_reference(logits, torch.zeros(8), 2, True, 1.0)
    assert ids[1, 0] == 5 and torch.isnan(weights[1]).all() and not torch.isnan(weights[0]).any()


@pytest.mark.parametrize("logits,bias,top_k,groups,topk_group,message", [
    (torch.zeros(2, 3, 8), torch.zeros(8), 2, 1, 1, "logits must be \\[tokens, experts\\]"),
    (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(8), 2, 1, 1, "logits must be a float"),
    (torch.zeros(2, 8), torch.zeros(7), 2, 1, 1, "bias must be \\[experts\\] = \\[8\\]"),
    (torch.zeros(2, 8), torch.zeros(8, dtype=torch.int64), 2, 1, 1, "bias must be a float"),
    (torch.zeros(2, 8), torch.zeros(8), 9, 1, 1, "top_k = 9 must be in 1..8"),
    (torch.zeros(2, 8), torch.zeros(8), 0, 1, 1, "top_k = 0"),
    (torch.zeros(2, 8), torch.zeros(8), 2, 3, 1, "do not split into num_expert_group = 3"),
    (torch.zeros(2, 8), torch.zeros(8), 2, 4, 5, "topk_group = 5 must be in 1..num_expert_group"),
    (torch.zeros(2, 8), torch.zeros(8), 2, 8, 2, "needs >= 2 experts"),
    (torch.zeros(2, 8), torch.zeros(8), 5, 4, 2, "top_k = 5 must be in 1..4"),
])
def test_bad_arguments_raise_clear_errors(logits, bias, top_k, groups, topk_group, message):
    with pytest.raises(ValueError, match=message):
        route_reference(logits, bias, top_k, True, 1.0, groups, topk_group)
    with pytest.raises(ValueError, match=message):
        FUSED_ROUTE(logits, bias, top_k, True, 1.0, groups, topk_group)


def test_triton_kernel_under_interpreter_matches_reference():
    run_interpreted("interpret_routing.py")


def test_op_passes_opcheck_on_cpu():
    gen = torch.Generator().manual_seed(6)
    samples = [
        (torch.randn(5, 64, generator=gen), 0.1 * torch.randn(64, generator=gen), 8, True, 2.446, 1, 1),
        (torch.randn(3, 64, generator=gen), 0.1 * torch.randn(64, generator=gen), 4, False, 1.0, 4, 2),
        (torch.randn(4, 32, generator=gen).bfloat16(), torch.zeros(32), 2, True, 1.0, 1, 1),
    ]
    for args in samples:
        torch.library.opcheck(FUSED_ROUTE, args)
        weights, ids = FUSED_ROUTE(*args)
        ref_weights, ref_ids = route_reference(*args)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def _route_fn(logits, bias):
    weights, ids = torch.ops.k3.fused_route(logits, bias, 4, True, 2.446)
    return weights, ids


@pytest.mark.parametrize("tracing_mode", ["real", "fake", "symbolic"])
def test_op_stays_one_node_under_make_fx(tracing_mode):
    logits, bias = torch.randn(6, 32), torch.zeros(32)
    graph = make_fx(_route_fn, tracing_mode=tracing_mode)(logits, bias)
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert [t for t in calls if t is not operator.getitem] == [FUSED_ROUTE]
    torch.testing.assert_close(graph(logits, bias), route_reference(logits, bias, 4, True, 2.446))


def test_op_stays_one_node_under_torch_export():
    class Router(torch.nn.Module):
        def forward(self, logits, bias):
            return _route_fn(logits, bias)

    tokens = torch.export.Dim("tokens", min=1)
    exported = torch.export.export(Router(), (torch.randn(6, 32), torch.zeros(32)),
                                   dynamic_shapes=({0: tokens}, None))
    calls = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert [t for t in calls if t is not operator.getitem] == [FUSED_ROUTE]


# ------------------------------------------------------------------------------------- CUDA

def _assert_equivalent_routing(weights, ids, logits, bias, top_k, renormalize, scaling, groups, topk_group):
    """The kernel's sigmoid may differ from torch's by an ulp, which can swap two experts whose
    choice scores are that close. Accept exactly that: the picked experts' reference choice
    scores must equal the reference top-k's, slot by slot, to 1e-6, and weights must be the
    reference scores of the experts actually picked."""
    logits, bias = logits.cpu(), bias.cpu()
    ids, weights = ids.cpu(), weights.cpu()
    ref_weights, ref_ids = route_reference(logits, bias, top_k, renormalize, scaling, groups, topk_group)
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    torch.testing.assert_close(choice.gather(1, ids), choice.gather(1, ref_ids), rtol=0, atol=1e-6)
    expected = scores.gather(1, ids)
    if renormalize:
        expected = expected / (expected.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(weights, expected * scaling, rtol=0, atol=1e-6)
    mismatched_rows = (ids != ref_ids).any(-1).sum().item()
    assert mismatched_rows <= max(1, ids.shape[0] // 50), f"{mismatched_rows} tokens routed differently"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,num_experts,top_k,groups,topk_group,dtype", [
    (1, 896, 16, 1, 1, torch.bfloat16),     # K3 decode
    (256, 896, 16, 1, 1, torch.bfloat16),   # K3 decode, big batch
    (4096, 896, 16, 1, 1, torch.float32),   # K3 prefill chunk
    (64, 256, 8, 1, 1, torch.bfloat16),     # Kimi-Linear
    (64, 256, 8, 8, 4, torch.float32),      # DeepSeek-V3 style groups
    (33, 1024, 16, 1, 1, torch.float16),    # kernel limit
])
def test_cuda_op_matches_reference(tokens, num_experts, top_k, groups, topk_group, dtype):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(tokens, num_experts, generator=gen).to(dtype)
    bias = 0.01 * torch.randn(num_experts, generator=gen)
    weights, ids = FUSED_ROUTE(logits.cuda(), bias.cuda(), top_k, True, 2.446, groups, topk_group)
    assert weights.is_cuda and weights.dtype == torch.float32 and ids.dtype == torch.int64
    _assert_equivalent_routing(weights, ids, logits, bias, top_k, True, 2.446, groups, topk_group)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_ties_and_fallback():
    weights, ids = route_triton(torch.zeros(3, 896, device="cuda"), torch.zeros(896, device="cuda"), 16, True, 1.0)
    assert ids.cpu().tolist() == [list(range(16))] * 3
    logits = torch.randn(5, 2048)  # beyond the kernel: the op falls back to the reference on the GPU
    weights, ids = FUSED_ROUTE(logits.cuda(), torch.zeros(2048, device="cuda"), 16, True, 1.0, 1, 1)
    _assert_equivalent_routing(weights, ids, logits, torch.zeros(2048), 16, True, 1.0, 1, 1)


# --------------------------------------------------------------- the absorbed form (router GEMM + routing)

def _router_case(tokens, num_experts, hidden, x_dtype=torch.bfloat16, w_dtype=torch.float32, seed=8):
    """x, the router weight and bias at a trained router's scale (logits of order 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(x_dtype)
    w = (torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5).to(w_dtype)
    return x, w, 0.01 * torch.randn(num_experts, generator=gen)


def test_absorbed_op_on_cpu_is_the_unfused_composition():
    x, w, bias = _router_case(6, 64, 48)
    for absorb in (0, 4, 16):  # the threshold only picks the CUDA kernel; on CPU every batch is the reference
        weights, ids = FUSED_ROUTE(x, bias, 8, True, 2.446, 4, 2, w, absorb)
        logits = torch.mm(x.float(), w.float().t())  # what the graph ran before P4
        ref_weights, ref_ids = route_reference(logits, bias, 8, True, 2.446, 4, 2)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_absorbed_op_passes_opcheck_and_checks_its_arguments():
    x, w, bias = _router_case(5, 32, 24)
    for args in ((x, bias, 4, True, 2.446, 1, 1, w, 16), (x.float(), bias, 2, False, 1.0, 4, 2, w.bfloat16(), 1)):
        torch.library.opcheck(FUSED_ROUTE, args)
    with pytest.raises(ValueError, match=r"router_weight must be \[experts, hidden = 24\]"):
        FUSED_ROUTE(x, bias, 4, True, 1.0, 1, 1, w[:, :20], 16)
    with pytest.raises(ValueError, match="must be fp32, bf16 or fp16"):
        FUSED_ROUTE(x.double(), bias, 4, True, 1.0, 1, 1, w, 16)
    with pytest.raises(ValueError, match=r"bias must be \[experts\] = \[32\]"):
        FUSED_ROUTE(x, bias[:16], 4, True, 1.0, 1, 1, w, 16)


def _assert_close_routing(weights, ids, x, w, bias, top_k, renormalize, scaling, groups, topk_group):
    """Against the CPU reference from the same x and W. The kernel's fp32 dot products sum in another order
    than cuBLAS / the CPU's mm, so two experts whose choice scores agree to a few ulps may swap: the picked
    experts' reference choice scores must equal the reference top-k's slot by slot (atol 1e-5: a 2304-long
    fp32 dot product's rounding, through the sigmoid), weights by relative error (2e-5) against the
    reference scores of the experts actually picked."""
    ids, weights = ids.cpu(), weights.cpu()
    logits = torch.mm(x.float().cpu(), w.float().cpu().t())
    ref_weights, ref_ids = route_reference(logits, bias.cpu(), top_k, renormalize, scaling, groups, topk_group)
    scores = logits.sigmoid()
    choice = scores + bias.cpu().float()
    torch.testing.assert_close(choice.gather(1, ids), choice.gather(1, ref_ids), rtol=0, atol=1e-5)
    expected = scores.gather(1, ids)
    if renormalize:
        expected = expected / (expected.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(weights, expected * scaling, rtol=2e-5, atol=0)
    mismatched_rows = (ids != ref_ids).any(-1).sum().item()
    assert mismatched_rows <= max(1, ids.shape[0] // 50), f"{mismatched_rows} tokens routed differently"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,num_experts,hidden,top_k,groups,topk_group", [
    (1, 256, 2304, 8, 1, 1),    # Kimi-Linear-48B decode
    (3, 256, 2304, 8, 1, 1),
    (16, 256, 2304, 8, 1, 1),   # the default absorbing threshold
    (1, 96, 2048, 8, 1, 1),     # k3-mini-6b
    (8, 256, 2304, 8, 8, 4),    # group limiting
])
def test_cuda_absorbed_kernel_matches_reference(tokens, num_experts, hidden, top_k, groups, topk_group):
    from k3compile.passes.kernels.routing import linear_route_triton
    x, w, bias = (t.cuda() for t in _router_case(tokens, num_experts, hidden))
    for _ in range(2):  # the second launch relies on the arrival counters having been zeroed again
        weights, ids = linear_route_triton(x, w, bias, top_k, True, 2.446, groups, topk_group)
        _assert_close_routing(weights, ids, x, w, bias, top_k, True, 2.446, groups, topk_group)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_absorbed_op_replays_from_a_cuda_graph_and_switches_at_the_threshold():
    x, w, bias = (t.cuda() for t in _router_case(4, 256, 2304))
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        FUSED_ROUTE(static_x, bias, 8, True, 2.446, 1, 1, w, 16)  # warm-up: compiles, allocates the counters
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = FUSED_ROUTE(static_x, bias, 8, True, 2.446, 1, 1, w, 16)
    for seed in range(3):  # replays start from zeroed counters each time
        new_x = _router_case(4, 256, 2304, seed=seed)[0].cuda()
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        _assert_close_routing(weights, ids, new_x, w, bias, 8, True, 2.446, 1, 1)

    def kernels(tokens, absorb):
        xs = x[:1].expand(tokens, -1).contiguous()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            FUSED_ROUTE(xs, bias, 8, True, 2.446, 1, 1, w, absorb)
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    absorbed, split = kernels(4, 16), kernels(32, 16)
    assert [n for n in absorbed if "route" in n] == ["_linear_route_kernel"] and len(absorbed) == 1
    assert "_fused_route_kernel" in split and "_linear_route_kernel" not in split and len(split) >= 2
