"""MLA decode kernels: references equal the model_def ops they replace (k3::kv_write after the norms,
k3::mla_decode on the concatenated query), the Triton kernels under the interpreter on CPU and on
CUDA at Kimi-Linear-48B / K3 shapes (contexts 512 and 8k, page sizes 1 and 16, PDL, CUDA graphs),
errors, and the ops' registration."""

import pytest
import torch

from k3compile.model_def.ops import library  # noqa: F401  (torch.ops.k3.kv_write / mla_decode)
from k3compile.passes.kernels.mla_decode import (arrival_counts, decode_reference, decode_triton, prologue_reference,
                                                  w_uv_of, w_uv_prefetch_ok)

from .interpreted import run_interpreted

PROLOGUE = torch.ops.k3.mla_decode_prologue.default
FUSED = torch.ops.k3.mla_decode_fused.default
FUSED_OUT = torch.ops.k3.mla_decode_fused_out.default


def _rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _pool(pages, layers, page, width, dtype=torch.float32, seed=0):
    return torch.randn(pages, layers, page, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_q", [False, True])
def test_prologue_reference_is_norms_then_kv_write(dtype, with_q):
    gen = torch.Generator().manual_seed(2)
    r, rope, n = 16, 8, 4
    kv, kv_ref = _pool(6, 2, 4, r + rope, dtype), _pool(6, 2, 4, r + rope, dtype)
    ckv = torch.randn(n, r + rope, generator=gen).to(dtype)
    w = torch.randn(r, generator=gen).to(dtype)
    q_a, w_q = (torch.randn(n, 12, generator=gen).to(dtype), torch.randn(12, generator=gen).to(dtype)) if with_q \
        else (None, None)
    loc = torch.tensor([3, 17, 0, 9])
    q = PROLOGUE(ckv, w, 1e-6, kv, 1, loc, q_a, w_q, 1e-6)
    torch.ops.k3.kv_write(torch.cat([_rms(ckv[:, :r], w, 1e-6), ckv[:, r:]], -1), kv_ref, 1, loc)
    assert torch.equal(kv, kv_ref)
    if with_q:
        assert torch.equal(q, _rms(q_a, w_q, 1e-6))
    else:
        assert q.numel() == 0


def test_decode_reference_is_mla_decode_on_the_concatenated_query():
    gen = torch.Generator().manual_seed(3)
    kv = _pool(20, 2, 4, 24)
    table = torch.randperm(19, generator=gen)[:12].view(3, 4).int() + 1
    seq = torch.tensor([3, 16, 9], dtype=torch.int32)
    q_nope, q_rope = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 8, generator=gen)
    want = torch.ops.k3.mla_decode(torch.cat([q_nope, q_rope], -1), kv, 1, table, seq, 0.3, 16)
    assert torch.equal(FUSED(q_nope, q_rope, kv, 1, table, seq, 0.3, False), want)


def test_triton_kernels_under_interpreter_match_references():
    run_interpreted("interpret_mla_decode.py")


def test_bad_arguments_raise_clear_errors():
    kv = _pool(4, 2, 4, 24)
    table, seq = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="24 wide but the query is 16 \\+ 4"):
        FUSED(torch.zeros(2, 2, 16), torch.zeros(2, 2, 4), kv, 0, table, seq, 0.1, False)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        FUSED(torch.zeros(2, 2, 16), torch.zeros(2, 2, 8), kv, 2, table, seq, 0.1, False)
    with pytest.raises(ValueError, match="page_table"):
        FUSED(torch.zeros(2, 2, 16), torch.zeros(2, 2, 8), kv, 0, table[:1], seq, 0.1, False)
    with pytest.raises(ValueError, match="row width 24"):
        PROLOGUE(torch.zeros(2, 20), torch.ones(16), 1e-6, kv, 0, torch.zeros(2, dtype=torch.long), None, None, 0.0)
    with pytest.raises(ValueError, match="come together"):
        PROLOGUE(torch.zeros(2, 24), torch.ones(16), 1e-6, kv, 0, torch.zeros(2, dtype=torch.long), torch.zeros(2, 8),
                 None, 0.0)


def test_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(4)
    kv = _pool(8, 2, 4, 24)
    table = torch.randperm(7, generator=gen)[:6].view(2, 3).int() + 1
    seq = torch.tensor([5, 12], dtype=torch.int32)
    torch.library.opcheck(FUSED, (torch.randn(2, 2, 16), torch.randn(2, 2, 8), kv, 1, table, seq, 0.2, False))
    w_kv_b = torch.randn(2 * (4 + 8), 16)  # kv_b_proj: 2 heads x (nope 4 + dv 8) rows, r = 16
    torch.library.opcheck(FUSED_OUT, (torch.randn(2, 2, 16), torch.randn(2, 2, 8), kv, 1, table, seq, 0.2, w_kv_b, 4,
                                      False))
    torch.library.opcheck(FUSED_OUT, (torch.randn(2, 2, 16), torch.randn(2, 2, 8), kv, 1, table, seq, 0.2, w_kv_b, 4,
                                      False, None, False, torch.randn(2, 16)))  # with P15's output gate
    torch.library.opcheck(PROLOGUE, (torch.randn(2, 24), torch.randn(16), 1e-6, kv, 0, torch.tensor([1, 6]),
                                     torch.randn(2, 8), torch.randn(8), 1e-6))


# ------------------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _decode_inputs(batch, context, page, heads=32, r=512, rope=64, dtype=torch.bfloat16, seed=0):
    """Kimi-Linear-48B MLA shapes: requests of different lengths up to `context`, scattered pages."""
    gen = torch.Generator().manual_seed(seed)
    lens = [max(1, context - (i * 37) % max(1, context // 2)) for i in range(batch)]
    max_pages = (context + page - 1) // page
    pages = batch * max_pages + 1
    kv = torch.randn(pages, 1, page, r + rope, generator=gen).to(dtype).cuda()
    table = (torch.randperm(pages - 1, generator=gen)[: batch * max_pages] + 1).view(batch, max_pages).int().cuda()
    seq = torch.tensor(lens, dtype=torch.int32).cuda()
    q = torch.randn(batch, heads, 128 + rope, generator=gen).to(dtype).cuda()  # q_rope: a strided view, as in graphs
    q_nope = torch.randn(batch, heads, r, generator=gen).to(dtype).cuda()
    return q_nope, q[..., 128:], kv, table, seq


def _captured(step):
    """(graph, outputs) of `step` captured in a CUDA graph, compiled outside the capture first."""
    step()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = step()
    return graph, outs


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,context,page", [(1, 512, 16), (8, 512, 1), (64, 512, 16), (1, 8192, 16),
                                                (8, 8192, 16)])
def test_cuda_decode_matches_reference(batch, context, page):
    q_nope, q_rope, kv, table, seq = _decode_inputs(batch, context, page)
    # against the fp32 reference: the bf16 reference rounds its scores to bf16 before the softmax
    # (H200, [1-512-16]: 1.06e-2 between kernel and bf16 reference), the kernel keeps them in fp32
    want = decode_reference(q_nope.float(), q_rope.float(), kv.float(), 0, table, seq, 192 ** -0.5)
    got = FUSED(q_nope, q_rope, kv, 0, table, seq, 192 ** -0.5, False)
    assert _rel(got, want) <= 1e-2
    assert _rel(got, want) <= _rel(decode_reference(q_nope, q_rope, kv, 0, table, seq, 192 ** -0.5), want) + 2e-3
    if torch.cuda.get_device_capability()[0] >= 9:
        assert torch.equal(FUSED(q_nope, q_rope, kv, 0, table, seq, 192 ** -0.5, True), got)  # PDL changes no value


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,bound", [(1, 4), (4, 4), (8, 4), (8, 8), (16, 16)])  # up to the op's w_uv_max_tokens
# (P15's option; 4 by default) the merge kernel applies W_UV; above it cuBLAS after the merge
def test_cuda_decode_with_w_uv_matches_reference_in_a_cuda_graph(batch, bound):
    q_nope, q_rope, kv, table, seq = _decode_inputs(batch, 512, 16, seed=2)
    gen = torch.Generator().manual_seed(3)
    w_kv_b = (torch.randn(32 * 256, 512, generator=gen) * 512 ** -0.5).bfloat16().cuda()  # 48B: nope 128 + dv 128
    pdl = torch.cuda.get_device_capability()[0] >= 9
    args = (q_nope, q_rope, kv, 0, table, seq, 192 ** -0.5, w_kv_b, 128)
    out = FUSED_OUT(*args, pdl, None, False, None, bound)  # compile outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = FUSED_OUT(*args, pdl, None, False, None, bound)
    q_nope.normal_()
    graph.replay()
    torch.cuda.synchronize()
    # the unfused decode step's arithmetic: latent output in bf16, then the bf16 batched GEMM
    want = torch.einsum("bhr,hdr->bhd", FUSED(*args[:7], False), w_uv_of(w_kv_b, 32, 128)).flatten(-2)
    assert out.shape == (batch, 32 * 128) and _rel(out, want) <= 1e-2


@pytest.mark.gpu
@needs_cuda
def test_cuda_decode_in_a_cuda_graph_with_pdl():
    q_nope, q_rope, kv, table, seq = _decode_inputs(8, 512, 16, seed=1)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    out = decode_triton(q_nope, q_rope, kv, 0, table, seq, 0.07, pdl)  # compile outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = decode_triton(q_nope, q_rope, kv, 0, table, seq, 0.07, pdl)
    q_nope.normal_()
    seq.sub_(3)  # new lengths, same grid: the split is read from seq_lens on the device
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, decode_reference(q_nope.float(), q_rope.float(), kv.float(), 0, table, seq, 0.07)) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens,q_lora", [(1, None), (64, None), (1, 1536), (64, 1536)])
def test_cuda_prologue_matches_reference(tokens, q_lora):
    gen = torch.Generator().manual_seed(tokens)
    q_dim = q_lora or 32 * 192
    merged = torch.randn(tokens, q_dim + 576 + 4096, generator=gen).bfloat16().cuda()  # [q | ckv | gate] columns
    ckv = merged[:, q_dim: q_dim + 576]
    q_a = merged[:, :q_dim] if q_lora else None
    w = torch.randn(512, generator=gen).bfloat16().cuda()
    w_q = torch.randn(q_dim, generator=gen).bfloat16().cuda() if q_lora else None
    kv = torch.zeros(tokens * 2 + 1, 3, 16, 576, dtype=torch.bfloat16, device="cuda")
    kv_ref = kv.clone()
    loc = (torch.randperm(tokens * 2 * 16, generator=gen)[:tokens] + 16).cuda()
    q = PROLOGUE(ckv, w, 1e-6, kv, 2, loc, q_a, w_q, 1e-6)
    q0 = prologue_reference(ckv, w, 1e-6, kv_ref, 2, loc, q_a, w_q, 1e-6)
    assert _rel(kv, kv_ref) <= 1e-2 and (kv != kv_ref).float().mean().item() < 0.01  # rounding ties only
    if q_lora:
        assert _rel(q, q0) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,context", [(1, 512), (4, 512), (8, 4096)])
def test_cuda_column_block_merges_match_whole_row_and_reference(batch, context):
    """Every merge_cols the bench sweeps (and the whole-row kernels, 0), with W_UV up to OUT_MAX_TOKENS tokens and
    the plain merge above, in a CUDA graph with PDL over three layers sharing the arrival counts: equal to the fp32
    reference within bf16 rounding, deterministic (two replays bit-identical), counts back at zero."""
    q_nope, q_rope, kv1, table, seq = _decode_inputs(batch, context, 16, seed=5)
    kv = torch.cat([kv1, kv1.roll(1, 0), kv1.flip(2)], 1)  # three layers
    gen = torch.Generator().manual_seed(6)
    w_kv_b = (torch.randn(32 * 256, 512, generator=gen) * 512 ** -0.5).bfloat16().cuda()
    w_uv = w_uv_of(w_kv_b, 32, 128) if batch <= 4 else None
    pdl = torch.cuda.get_device_capability()[0] >= 9
    for cols in (0, 32, 64, 128):
        def step():
            return [decode_triton(q_nope, q_rope, kv, layer, table, seq, 192 ** -0.5, pdl, w_uv=w_uv, merge_cols=cols)
                    for layer in range(3)]
        graph, outs = _captured(step)
        graph.replay()
        first = [o.clone() for o in outs]
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(3):
            assert torch.equal(outs[layer], first[layer]), f"merge_cols {cols}: replays differ"
            o_lat = decode_reference(q_nope.float(), q_rope.float(), kv.float(), layer, table, seq, 192 ** -0.5)
            want = o_lat if w_uv is None else torch.einsum("bhr,hdr->bhd", o_lat.bfloat16().float(),
                                                           w_uv.float()).flatten(-2)
            assert _rel(outs[layer], want) <= 1.5e-2, f"merge_cols {cols} layer {layer}"
        assert not arrival_counts(q_nope.device, 1).any()


def test_w_uv_prefetch_needs_16_byte_blocks():
    w_kv_b = torch.empty(4 * 24, 64, dtype=torch.bfloat16)
    assert w_uv_prefetch_ok(w_uv_of(w_kv_b, 4, 8), 64)  # W_UV starts 8 rows (1 KB) in: aligned
    assert not w_uv_prefetch_ok(w_uv_of(w_kv_b, 4, 8), 4)  # a 4-column block is 8 bytes
    shifted = w_kv_b.view(-1)[1: 1 + 95 * 64].view(95, 64)  # 2 bytes past an aligned start
    assert not w_uv_prefetch_ok(w_uv_of(shifted, 1, 8), 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_w_uv_l2_prefetch_changes_no_value(batch):
    """P15's prefetch_w_uv at the 48B shape in a CUDA graph with PDL over three layers: the same bits as without."""
    q_nope, q_rope, kv1, table, seq = _decode_inputs(batch, 512, 16, seed=7)
    kv = torch.cat([kv1, kv1.roll(1, 0), kv1.flip(2)], 1)
    gen = torch.Generator().manual_seed(8)
    w_kv_bs = [(torch.randn(32 * 256, 512, generator=gen) * 512 ** -0.5).bfloat16().cuda() for _ in range(3)]
    assert all(w_uv_prefetch_ok(w_uv_of(w, 32, 128), 64) for w in w_kv_bs)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    results = []
    for prefetch in (False, True):
        def step():
            return [FUSED_OUT(q_nope, q_rope, kv, layer, table, seq, 192 ** -0.5, w_kv_bs[layer], 128, pdl, None,
                              prefetch) for layer in range(3)]
        graph, outs = _captured(step)
        graph.replay()
        torch.cuda.synchronize()
        results.append([o.clone() for o in outs])
    for layer in range(3):
        assert torch.equal(results[0][layer], results[1][layer]), f"layer {layer}: prefetch changed the output"
        o_lat = decode_reference(q_nope.float(), q_rope.float(), kv.float(), layer, table, seq, 192 ** -0.5)
        w_uv = w_uv_of(w_kv_bs[layer], 32, 128)
        want = torch.einsum("bhr,hdr->bhd", o_lat.bfloat16().float(), w_uv.float()).flatten(-2)
        assert _rel(results[1][layer], want) <= 1.5e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,bound", [(1, 4), (4, 4), (8, 4), (8, 8)])  # up to the op's w_uv_max_tokens the merge
# kernels gate (column blocks at 1-4, LAUNCH_TABLE; the whole row at 8); above it torch
def test_cuda_output_gate_matches_the_unfused_ops_at_k3_mini_shape(batch, bound):
    """P15's gate_out at k3-mini-6b's MLA shape (16 heads, r 512, nope 128, dv 128), the gate a column block of the
    merged input GEMM's output, in a CUDA graph with PDL over three layers: equal to the unfused step's arithmetic
    (the ungated op, then sigmoid and product in bf16) within bf16 rounding; the whole-row merge kernel too."""
    q_nope, q_rope, kv1, table, seq = _decode_inputs(batch, 512, 16, heads=16, seed=9)
    kv = torch.cat([kv1, kv1.roll(1, 0), kv1.flip(2)], 1)
    gen = torch.Generator().manual_seed(10)
    w_kv_b = (torch.randn(16 * 256, 512, generator=gen) * 512 ** -0.5).bfloat16().cuda()
    merged = (torch.randn(batch, 768 + 576 + 16 * 128, generator=gen) * 2).bfloat16().cuda()
    gate = merged[:, 768 + 576:]
    pdl = torch.cuda.get_device_capability()[0] >= 9

    def step():
        return [FUSED_OUT(q_nope, q_rope, kv, layer, table, seq, 192 ** -0.5, w_kv_b, 128, pdl, None, False, gate,
                          bound) for layer in range(3)]
    graph, outs = _captured(step)
    graph.replay()
    torch.cuda.synchronize()
    for layer in range(3):
        plain = FUSED_OUT(q_nope, q_rope, kv, layer, table, seq, 192 ** -0.5, w_kv_b, 128, pdl)
        want = plain * torch.sigmoid(gate)
        assert outs[layer].shape == (batch, 16 * 128) and _rel(outs[layer], want) <= 1e-2, f"layer {layer}"
    if batch <= bound:
        w_uv = w_uv_of(w_kv_b, 16, 128)
        whole = decode_triton(q_nope, q_rope, kv, 2, table, seq, 192 ** -0.5, pdl, w_uv=w_uv, merge_cols=0, gate=gate)
        assert _rel(whole, outs[2]) <= 1e-2
    assert not arrival_counts(q_nope.device, 1).any()


def test_output_gate_of_another_shape_or_dtype_is_refused():
    kv = _pool(8, 2, 4, 24)
    table, seq = torch.ones(2, 3, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    args = (torch.randn(2, 2, 16), torch.randn(2, 2, 8), kv, 1, table, seq, 0.2, torch.randn(2 * 12, 16), 4, False,
            None, False)
    for bad in (torch.randn(2, 15), torch.randn(2, 16, dtype=torch.float64)):
        with pytest.raises(ValueError, match="output gate must be"):
            FUSED_OUT(*args, bad)
