"""P12's ops: the expert rows + finalize equal k3::moe_experts (+ the shared add), the Triton finalize under
the interpreter, the collective over gloo (2 ranks) against a plain all-reduce, bad arguments, and on CUDA
(marked gpu) the grouped-GEMM rows + Triton finalize + NCCL."""
import pytest
import torch

from k3compile.model_def.ops import library  # noqa: F401  (registers k3::moe_experts)
from k3compile.model_def.ops import moe_math
from k3compile.passes.kernels import moe_finalize  # noqa: F401  (registers the ops)

from .interpreted import run_interpreted


def _moe_case(n=6, k=3, e=5, d=32, inter=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, d, generator=g, device=device).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g, device=device)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g, device=device)
    w13 = (torch.randn(e, 2 * inter, d, generator=g, device=device) / d ** 0.5).to(dtype)
    w2 = (torch.randn(e, d, inter, generator=g, device=device) / inter ** 0.5).to(dtype)
    shared = torch.randn(n, d, generator=g, device=device).to(dtype)
    return x, ids, weights, w13, w2, shared


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_rows_then_finalize_equal_the_expert_op(act):
    x, ids, weights, w13, w2, shared = _moe_case()
    rows, slot_rows = torch.ops.k3.moe_expert_rows(x, ids, w13, w2, act, 2.0, 3.0)
    want = torch.ops.k3.moe_experts(x, ids, weights, w13, w2, act, 2.0, 3.0)
    torch.testing.assert_close(torch.ops.k3.moe_finalize(rows, slot_rows, weights, None), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.ops.k3.moe_finalize(rows, slot_rows, weights, shared), want + shared,
                               rtol=1e-6, atol=1e-6)
    # the gather path (CUDA without grouped GEMM) lays rows out the same way
    g_rows, g_slots = moe_math.expert_rows_gather(x, ids, w13, w2, act, 2.0, 3.0)
    assert torch.equal(g_slots, slot_rows)
    torch.testing.assert_close(g_rows, rows, rtol=1e-5, atol=1e-5)


def test_triton_finalize_under_interpreter_matches_reference():
    run_interpreted("interpret_moe_finalize.py")


def _rank(rank):
    from k3compile.model_def.parallel.topology import parse_topology
    from k3compile.runtime.parallel.groups import init_rank, shutdown_rank
    init_rank(parse_topology("tp2"), "gloo", timeout_s=60)
    try:
        x, ids, weights, w13, w2, shared = _moe_case(seed=rank)  # each rank its own experts' outputs
        rows, slot_rows = torch.ops.k3.moe_expert_rows(x, ids, w13, w2, "silu", 1.0, 1.0)
        got = torch.ops.k3.moe_finalize_all_reduce(rows, slot_rows, weights, shared, "world")
        want = torch.ops.k3.all_reduce(torch.ops.k3.moe_experts(x, ids, weights, w13, w2, "silu", 1.0, 1.0) + shared,
                                       "world")
        return got, want
    finally:
        shutdown_rank()


def test_collective_over_gloo_equals_finalize_then_all_reduce():
    from k3compile.runtime.parallel.launch import launch
    results = launch(_rank, 2, (), timeout_s=120)
    for got, want in results:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)  # every rank holds the same sum


@pytest.mark.parametrize("rows,slot_rows,weights,shared,message", [
    (torch.zeros(5, 8), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), None, "need 6 rows"),
    (torch.zeros(6, 8), torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2), None, "topk_weights must be"),
    (torch.zeros(6, 8), torch.zeros(2, 3), torch.zeros(2, 3), None, "integer tensor"),
    (torch.zeros(6, 8), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.zeros(2, 4), "shared must be"),
])
def test_bad_arguments_raise_clear_errors(rows, slot_rows, weights, shared, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.k3.moe_finalize(rows, slot_rows, weights, shared)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_and_triton_finalize_match_the_cpu_reference(dtype):
    """bf16 on sm90: grouped-GEMM rows in expert order (slot_rows a permutation); fp32: the gather path."""
    case = _moe_case(n=37, k=4, e=8, d=512, inter=256, dtype=dtype, seed=3)
    x, ids, weights, w13, w2, shared = (t.cuda() for t in case)
    rows, slot_rows = torch.ops.k3.moe_expert_rows(x, ids, w13, w2, "silu", 1.0, 1.0)
    got = torch.ops.k3.moe_finalize(rows, slot_rows, weights, shared)
    want = moe_math.moe_experts_loop(*(t.cpu() for t in (x, ids, weights, w13, w2)), "silu", 1.0, 1.0) + case[5]
    err = ((got.cpu().float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), err
