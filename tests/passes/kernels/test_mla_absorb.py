"""kernels/mla_absorb: the W_UK absorption reference is MLAMixer's einsum, the Triton kernel under the interpreter
on CPU and at the 48B shape on a GPU (with PDL, in a CUDA graph after the prologue) matches it."""
import pytest
import torch

from k3compile.passes.kernels import mla_absorb

from .interpreted import rel_err, run_interpreted

G = torch.Generator().manual_seed(0)


def test_reference_is_the_mixers_einsum_on_kv_b_projs_nope_rows():
    heads, nope, dv, r = 3, 4, 5, 8
    w = torch.randn(heads * (nope + dv), r, generator=G)
    q = torch.randn(2, heads, nope, generator=G)
    w_uk = w.unflatten(0, (heads, -1))[:, :nope]
    want = torch.stack([torch.stack([q[b, h] @ w_uk[h] for h in range(heads)]) for b in range(2)])
    torch.testing.assert_close(mla_absorb.absorb_reference(q, w, nope), want)
    torch.testing.assert_close(torch.ops.k3.mla_absorb_q(q, w, nope, False), want)


def test_triton_kernel_under_interpreter_matches_reference():
    run_interpreted("interpret_mla_absorb.py")


def test_bad_arguments_raise_clear_errors():
    w = torch.randn(2 * 12, 16)
    with pytest.raises(ValueError, match="q_nope must be"):
        mla_absorb.absorb_reference(torch.randn(1, 2, 5), w, 4)
    with pytest.raises(ValueError, match="not \\[2 heads"):
        mla_absorb.absorb_reference(torch.randn(1, 2, 12), w, 12)
    with pytest.raises(ValueError, match="not \\[5 heads"):
        mla_absorb.absorb_reference(torch.randn(1, 5, 4), w, 4)


def test_op_passes_opcheck():
    q = torch.randn(3, 2, 24, generator=G)[..., :16]
    torch.library.opcheck(torch.ops.k3.mla_absorb_q.default, (q, torch.randn(2 * 24, 32, generator=G), 16, True))


def test_prologue_absorb_op_is_prologue_then_absorption_and_passes_opcheck():
    from k3compile.passes.kernels.mla_decode import prologue_reference
    merged = torch.randn(3, 2 * 24 + 40, generator=G)
    q, ckv = merged[:, :48].unflatten(-1, (2, 24))[..., :16], merged[:, 48:]
    kv, w, kv_w = torch.randn(4, 2, 4, 40, generator=G), torch.randn(2 * 24, 32, generator=G), torch.rand(32) + 0.5
    loc = torch.tensor([1, 6, 13])
    kv_ref = kv.clone()
    got = torch.ops.k3.mla_decode_prologue_absorb(ckv, kv_w, 1e-6, kv, 1, loc, q, w, 16, True)
    prologue_reference(ckv, kv_w, 1e-6, kv_ref, 1, loc)
    torch.testing.assert_close(kv, kv_ref)
    torch.testing.assert_close(got, mla_absorb.absorb_reference(q, w, 16))
    torch.library.opcheck(torch.ops.k3.mla_decode_prologue_absorb.default, (ckv, kv_w, 1e-6, kv, 1, loc, q, w, 16, True))


def _inputs_48b(batch, dtype=torch.bfloat16):
    """The 48B shape: 32 heads, nope 128 of a 192-wide query head, v 128, r 512; q a strided view as in the graph."""
    heads, nope, rope, dv, r = 32, 128, 64, 128, 512
    q = torch.randn(batch, heads * (nope + rope), generator=G).to(dtype).cuda().unflatten(-1, (heads, -1))
    w = (torch.randn(heads * (nope + dv), r, generator=G) * 0.05).to(dtype).cuda()
    return q[..., :nope], w, nope


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_cuda_absorb_matches_reference_at_48b_shape(batch):
    q, w, nope = _inputs_48b(batch)
    want = torch.einsum("bhd,hdr->bhr", q.float(), mla_absorb.w_uk_of(w, q.shape[1], nope).float())
    for pdl in (False, True):
        got = mla_absorb.absorb_triton(q, w, nope, pdl)
        assert rel_err(got, want) < 1e-2
    assert rel_err(torch.ops.k3.mla_absorb_q(q, w, nope, True), want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_absorb_in_a_cuda_graph_with_pdl_after_a_producer():
    """q written by a kernel just before (as the input GEMM / prologue do), replayed with new values."""
    q_src, w, nope = _inputs_48b(4)
    q = torch.empty_like(q_src)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2):
            q.copy_(q_src)
            torch.ops.k3.mla_absorb_q(q, w, nope, True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q.copy_(q_src)
        out = torch.ops.k3.mla_absorb_q(q, w, nope, True)
    q_src.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, mla_absorb.absorb_reference(q_src.float(), w.float(), nope)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_cuda_prologue_and_absorb_in_one_launch_match_references(batch):
    """mla_absorb.prologue_absorb_triton at the 48B shape (Kimi Linear, no q-LoRA), PDL on where available: the
    pool row and q_lat as the prologue and absorption references give them."""
    from k3compile.passes.kernels.mla_decode import prologue_reference
    from k3compile.passes.kernels.pdl import pdl_available
    heads, nope, rope, dv, r, page = 32, 128, 64, 128, 512, 16
    merged = torch.randn(batch, heads * (nope + rope) + r + rope, generator=G).bfloat16().cuda()
    q = merged[:, : heads * (nope + rope)].unflatten(-1, (heads, -1))[..., :nope]
    ckv = merged[:, heads * (nope + rope):]
    kv = torch.randn(batch * 2 + 1, 2, page, r + rope, generator=G).bfloat16().cuda()
    kv_ref = kv.clone()
    loc = (torch.randperm(batch * 2 * page, generator=G)[:batch] + page).cuda()
    kv_w = (1 + 0.1 * torch.randn(r, generator=G)).bfloat16().cuda()
    w = (torch.randn(heads * (nope + dv), r, generator=G) * 0.05).bfloat16().cuda()
    got = mla_absorb.prologue_absorb_triton(ckv, kv_w, 1e-6, kv, 1, loc, q, w, nope, pdl_available())
    prologue_reference(ckv, kv_w, 1e-6, kv_ref, 1, loc)
    assert rel_err(kv, kv_ref) <= 1e-2 and (kv != kv_ref).float().mean().item() < 0.01  # rounding ties only
    want = torch.einsum("bhd,hdr->bhr", q.float(), mla_absorb.w_uk_of(w, heads, nope).float())
    assert rel_err(got, want) < 1e-2
