"""k3::attn_res_norm: the reference is model_def's composition (residual add, attn_res_read, RMSNorm),
the Triton kernel under the interpreter on CPU and natively on CUDA at K3 / Kimi-Linear shapes, errors,
and the op's registration."""
import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.model_def.layers.attn_res import attn_res_read
from k3compile.model_def.layers.common import RMSNorm
from k3compile.passes.kernels.attn_res_norm import attn_res_norm_reference, attn_res_norm_triton

from .interpreted import run_interpreted

FUSED = torch.ops.k3.attn_res_norm.default


def _model_def(bank, x, delta, proj, gamma, norm_weight, eps):
    """What model_def computes: p = x + delta; h = RMSNorm(attn_res_read(bank + [p]))."""
    norm = RMSNorm(x.shape[1], eps)
    norm.weight.data = norm_weight
    p = x + delta
    with torch.no_grad():
        return norm(attn_res_read(list(bank) + [p], proj, gamma, eps)), p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bank_rows", [0, 1, 4, 8])
def test_reference_is_the_model_def_composition(dtype, bank_rows):
    gen = torch.Generator().manual_seed(bank_rows)
    n, d = 5, 48
    bank = [torch.randn(n, d, generator=gen).to(dtype) for _ in range(bank_rows)]
    x, delta = torch.randn(n, d, generator=gen).to(dtype), torch.randn(n, d, generator=gen).to(dtype)
    proj, gamma = torch.randn(1, d, generator=gen).to(dtype), torch.randn(d, generator=gen).to(dtype)
    weight = torch.randn(d, generator=gen).to(dtype)
    query = proj.float().view(-1) * gamma.float()
    h, p = attn_res_norm_reference(bank, x, delta, query if bank else None, weight, 1e-5, 1e-5)
    h0, p0 = _model_def(bank, x, delta, proj, gamma, weight, 1e-5)
    assert torch.equal(p, p0) and h.dtype == h0.dtype
    torch.testing.assert_close(h, h0, rtol=1e-6, atol=1e-6)  # same ops, same order


def test_triton_kernel_under_interpreter_matches_reference():
    run_interpreted("interpret_attn_res_norm.py")


@pytest.mark.parametrize("bank,x,delta,query,weight,message", [
    ([], torch.zeros(2, 8), torch.zeros(3, 8), None, torch.ones(8), "delta must match x"),
    ([torch.zeros(2, 4)], torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), torch.ones(8), "bank row 0"),
    ([torch.zeros(2, 8)], torch.zeros(2, 8), torch.zeros(2, 8), None, torch.ones(8), "needs query"),
    ([], torch.zeros(2, 8), torch.zeros(2, 8), None, torch.ones(4), "norm_weight must be"),
    ([torch.zeros(2, 8)] * 9, torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), torch.ones(8), "at most 8"),
    ([], torch.zeros(8), torch.zeros(8), None, torch.ones(8), "x must be"),
])
def test_bad_arguments_raise_clear_errors(bank, x, delta, query, weight, message):
    with pytest.raises(ValueError, match=message):
        FUSED(bank, x, delta, query, weight, 1e-5, 1e-5)


def test_op_passes_opcheck_and_stays_one_node():
    gen = torch.Generator().manual_seed(1)
    bank = [torch.randn(3, 16, generator=gen) for _ in range(2)]
    args = (bank, torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen), torch.randn(16, generator=gen),
            torch.randn(16, generator=gen), 1e-5, 1e-6)
    torch.library.opcheck(FUSED, args)
    torch.library.opcheck(FUSED, ([],) + args[1:3] + (None,) + args[4:])
    torch.library.opcheck(FUSED, (bank, args[1], None) + args[3:])  # delta None: p = x
    assert torch.equal(FUSED(bank, args[1], None, *args[3:])[1], args[1])
    gm = make_fx(lambda *a: FUSED(*a), tracing_mode="symbolic")(bank, *args[1:5], 1e-5, 1e-6)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert calls == [FUSED]


# ------------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,dim,bank_rows,dtype", [
    (1, 7168, 8, torch.bfloat16),      # K3 final read, decode
    (64, 7168, 3, torch.bfloat16),     # K3, batch 64
    (1, 2304, 0, torch.bfloat16),      # Kimi-Linear-48B add + RMSNorm, decode
    (64, 2304, 0, torch.bfloat16),
    (4096, 2048, 5, torch.bfloat16),   # k3-mini prefill chunk
    (7, 2048, 2, torch.float32),
])
def test_cuda_kernel_matches_reference(tokens, dim, bank_rows, dtype):
    gen = torch.Generator().manual_seed(tokens + dim)
    bank = [torch.randn(tokens, dim, generator=gen).to(dtype) * (j + 1) for j in range(bank_rows)]
    x, delta = torch.randn(tokens, dim, generator=gen).to(dtype), torch.randn(tokens, dim, generator=gen).to(dtype)
    query = 0.05 * torch.randn(dim, generator=gen) if bank_rows else None
    weight = torch.randn(dim, generator=gen).to(dtype)
    h0, p0 = attn_res_norm_reference(bank, x, delta, query, weight, 1e-5, 1e-5)
    cuda = [t.cuda() for t in bank], x.cuda(), delta.cuda(), None if query is None else query.cuda(), weight.cuda()
    h, p = FUSED(*cuda, 1e-5, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.equal(p.cpu(), p0)  # one fp32 add rounded once, both sides
    assert ((h.float().cpu() - h0.float()).abs().max() / h0.float().abs().max()).item() <= tol
    h2, _ = attn_res_norm_triton(*cuda, 1e-5, 1e-5)
    assert torch.equal(h, h2)  # the op's CUDA kernel is the Triton kernel
    h3, p3, h32 = torch.ops.k3.attn_res_norm_f32(*cuda, 1e-5, 1e-5, True)  # with PDL where available
    assert torch.equal(h3, h) and torch.equal(p3, p) and torch.equal(h32, h.float())
    # the streaming kernel (the only one before the bank tile) computes the same, to fp32 summation order
    h4, p4 = attn_res_norm_triton(*cuda, 1e-5, 1e-5, one_pass=False)
    assert torch.equal(p4, p)
    assert ((h4.float() - h.float()).abs().max() / h.float().abs().max()).item() <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("bank_rows", [1, 4, 8])
def test_cuda_one_pass_kernel_at_k3_mini_6b(tokens, bank_rows):
    """k3-mini-6b's reads (dim 2048, up to 8 bank rows) take the one-pass kernel; with and without delta,
    with PDL, with the fp32 copy, inside a CUDA graph."""
    from k3compile.passes.kernels.attn_res_norm import one_pass_applies
    dim, gen = 2048, torch.Generator().manual_seed(tokens * 10 + bank_rows)
    bank = [(torch.randn(tokens, dim, generator=gen) * (j + 1)).bfloat16().cuda() for j in range(bank_rows)]
    x, delta = (torch.randn(tokens, dim, generator=gen).bfloat16().cuda() for _ in range(2))
    query, weight = 0.05 * torch.randn(dim, generator=gen).cuda(), torch.randn(dim, generator=gen).bfloat16().cuda()
    assert one_pass_applies(bank, x)
    for d in (delta, None):
        h0, p0 = attn_res_norm_reference([b.cpu() for b in bank], x.cpu(), None if d is None else d.cpu(),
                                         query.cpu(), weight.cpu(), 1e-5, 1e-5)
        h, p, h32 = attn_res_norm_triton(bank, x, d, query, weight, 1e-5, 1e-5, pdl=True, with_fp32=True)
        assert torch.equal(p.cpu(), p0) and torch.equal(h32, h.float())
        assert ((h.float().cpu() - h0.float()).abs().max() / h0.float().abs().max()).item() <= 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hg, pg = FUSED(bank, x, d, query, weight, 1e-5, 1e-5, True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(hg, h) and torch.equal(pg, p)
