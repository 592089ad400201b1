"""The sorted M-tiled MoE kernels (passes/kernels/moe_sorted.py): under the interpreter on CPU (align exact against
its torch contract, the experts against moe_experts_loop), and on CUDA at k3-mini-6b / Kimi-Linear-48B expert shapes,
inside a CUDA graph replayed on new routing, and as P6's op above its crossover."""
import pytest
import torch

from k3compile.model_def.ops.moe_math import moe_experts_loop
from k3compile.passes.kernels import moe_decode, moe_sorted

from .interpreted import run_interpreted


def test_kernels_under_interpreter_match_reference():
    run_interpreted("interpret_moe_sorted.py")


@pytest.mark.parametrize("pairs,experts,block_m", [(1, 8, 16), (512, 96, 16), (512, 256, 16), (2048, 896, 32)])
def test_max_blocks_bounds_every_routing(pairs, experts, block_m):
    """The static grid covers the worst case: every hit expert one padded block more than its share."""
    worst = sum(-(-c // block_m) for c in [pairs // min(experts, pairs) + 1] * (pairs % min(experts, pairs))
                + [pairs // min(experts, pairs)] * (min(experts, pairs) - pairs % min(experts, pairs)))
    assert moe_sorted.max_blocks(pairs, experts, block_m) >= worst
    assert moe_sorted.max_blocks(pairs, experts, block_m) >= -(-pairs // block_m)  # one expert takes all


def test_bad_launches_are_refused_by_name():
    moe_sorted.check_launch(moe_sorted.DEFAULT_LAUNCH, quantized=True)
    for launch, quantized, message in ((moe_sorted.SortedLaunch(block_m=8), False, "block_m=8"),
                                       (moe_sorted.SortedLaunch(up_n=48), False, "up_n=48"),
                                       (moe_sorted.SortedLaunch(down_k=16), True, "down_k=16 .* >= 32"),
                                       (moe_sorted.SortedLaunch(num_stages=0), False, "num_stages=0")):
        with pytest.raises(ValueError, match=message):
            moe_sorted.check_launch(launch, quantized)


def test_launch_rule_widens_blocks_only_for_crowded_experts():
    """32-row blocks from 16 pairs an expert on (k3-mini-6b batch 256 in session 16's sweep), 16 below."""
    assert moe_sorted.sorted_launch(256 * 8, 96).block_m == 32  # 21 pairs an expert
    assert moe_sorted.sorted_launch(64 * 8, 96).block_m == 16
    assert moe_sorted.sorted_launch(256 * 8, 256).block_m == 16  # 48B batch 256: 8 an expert
    assert moe_sorted.sorted_launch(1, 8) == moe_sorted.DEFAULT_LAUNCH


def test_align_reference_is_a_stable_sort_by_expert():
    ids = torch.tensor([[3, 0], [0, 2], [3, 1]])
    pairs, block_expert = moe_sorted.align_reference(ids, 4, 16)
    assert block_expert.tolist()[:4] == [0, 1, 2, 3] and set(block_expert.tolist()[4:]) == {4}
    assert pairs[:2].tolist() == [1, 2] and set(pairs[2:16].tolist()) == {6}  # expert 0: pairs 1 and 2, then padding
    assert pairs[16].item() == 5 and pairs[32].item() == 3 and pairs[48:50].tolist() == [0, 4]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = {"k3-mini-6b": (96, 8, 1024, 512, 1024, "situ"), "kimi-linear-48b": (256, 8, 2304, 1024, 2304, "silu")}


def _layer(name, seed=0):
    """Random bf16 expert weights made on the GPU (the 48B layer's 3.6 GB take seconds to make on the host)."""
    e, k, d, inter, do, act = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, d, generator=gen, device="cuda") / d ** 0.5).bfloat16()
    w2 = (torch.randn(e, do, inter, generator=gen, device="cuda") / inter ** 0.5).bfloat16()
    return w13, w2, k, act


def _rel(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name,tokens", [("k3-mini-6b", 16), ("k3-mini-6b", 64), ("k3-mini-6b", 256),
                                         ("kimi-linear-48b", 64)])
def test_cuda_experts_match_reference_at_model_shapes(name, tokens):
    w13, w2, k, act = _layer(name)
    ids, wts = moe_decode.random_routing(tokens, w13.shape[0], k, "cuda", seed=tokens)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(moe_sorted.align(ids, w13.shape[0], 16),
                                                       moe_sorted.align_reference(ids.cpu(), w13.shape[0], 16)))
    x = torch.randn(tokens, w13.shape[2], device="cuda").bfloat16()
    got = moe_sorted.moe_experts_sorted(x, ids, wts, w13, w2, act, 4.0, 25.0)
    want = moe_experts_loop(x.float(), ids, wts, w13.float(), w2.float(), act, 4.0, 25.0)
    bf16_ops = moe_experts_loop(x, ids, wts, w13, w2, act, 4.0, 25.0)  # the unfused path's own bf16 error
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert _rel(got, want) <= max(1e-2, 1.5 * _rel(bf16_ops, want))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["k3-mini-6b", "kimi-linear-48b"])
def test_cuda_mxfp4_experts_match_their_dequantization(name):
    from k3compile.model_def.ops import mxfp4

    # 32 experts at a time (the same codes: groups run along the rows): the 48B layer at once took ~20 GB, out of
    # memory on an 80 GB card shared by four test workers (session 19)
    def quantize(w):
        parts = [mxfp4.quantize(c) for c in w.split(32)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    w13, w2, k, act = _layer(name, seed=5)
    experts, d = w13.shape[0], w13.shape[2]
    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    del w13, w2
    ids, wts = moe_decode.random_routing(64, experts, k, "cuda", seed=5)
    x = torch.randn(64, d, device="cuda").bfloat16()
    got = moe_sorted.moe_experts_sorted(x, ids, wts, q13, q2, act, 4.0, 25.0, w13_scale=s13, w2_scale=s2)
    want = moe_experts_loop(x.float(), ids, wts, mxfp4.dequantize(q13, s13), mxfp4.dequantize(q2, s2), act, 4.0, 25.0)
    assert _rel(got, want) <= 1e-2


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replays_on_new_routing():
    """Static shapes and no host sync: one capture, replayed on other routing and inputs, equals eager calls."""
    w13, w2, k, act = _layer("k3-mini-6b", seed=1)
    n = 64
    ids, wts = moe_decode.random_routing(n, w13.shape[0], k, "cuda", seed=1)
    x = torch.randn(n, w13.shape[2], device="cuda").bfloat16()
    moe_sorted.moe_experts_sorted(x, ids, wts, w13, w2, act, 4.0, 25.0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_sorted.moe_experts_sorted(x, ids, wts, w13, w2, act, 4.0, 25.0)
    for seed in (2, 3):
        new_ids, new_wts = moe_decode.random_routing(n, w13.shape[0], k, "cuda", seed=seed)
        if seed == 3:  # expert 5 in every token's choices (its run spans 4 blocks), the others distinct
            others, _ = moe_decode.random_routing(n, w13.shape[0] - 1, k - 1, "cuda", seed=seed)
            new_ids = torch.cat([torch.full_like(others[:, :1], 5), others + (others >= 5).long()], dim=1)
        ids.copy_(new_ids)
        wts.copy_(new_wts)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, moe_sorted.moe_experts_sorted(x, ids, wts, w13, w2, act, 4.0, 25.0))


@pytest.mark.gpu
@needs_cuda
def test_op_above_crossover_runs_the_sorted_experts_with_the_latent_tail():
    """P6's op with grouped_sorted at a batch above its crossover (k3-mini-6b's latent tail and shared expert):
    the same result as the op's grouped path within bf16 tolerance of the fp32 reference."""
    w13, w2, k, act = _layer("k3-mini-6b", seed=4)
    gen = torch.Generator(device="cuda").manual_seed(4)
    up = (torch.randn(2048, 1024, generator=gen, device="cuda") / 32).bfloat16()
    norm = (1 + 0.1 * torch.randn(1024, generator=gen, device="cuda")).bfloat16()
    shared_w2 = (torch.randn(2048, 1024, generator=gen, device="cuda") / 32).bfloat16()
    args = list(moe_decode.crossover_case(64, w13, w2, None, None, shared_w2, True, k, act, 4.0, 25.0,
                                          torch.bfloat16, up, norm, 1e-5))
    op = torch.ops.k3.fused_moe_decode.default
    options = (False, None, None, False, False, None, False, False, False, False, True)  # ... grouped_sorted
    got = op(*args[:13], 16, *args[13:16], *options)
    finished = op(*args[:13], 16, *args[13:16], *options, True)  # sorted_finish: sum + latent RMSNorm in one kernel
    grouped = op(*args[:13], 16, *args[13:16])
    fp32 = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    fp32[2] = args[2]
    want = moe_decode.fused_moe_reference(*fp32[:13], *fp32[13:16])
    assert _rel(got, want) <= max(1e-2, 1.5 * _rel(grouped, want))
    assert _rel(finished, want) <= max(1e-2, 1.5 * _rel(grouped, want))
