"""The GEMV-chain kernel (passes/kernels/gemv_chain.py: S dependent GEMVs in one launch, tiles ordered by tickets)
against separate GEMMs: under the Triton interpreter on CPU, and on CUDA at k3-mini-6b's shapes, replayed from a
CUDA graph (the waits must end, replay after replay)."""
import pytest
import torch

from k3compile.passes.kernels.gemv_chain import check_chain, gemv_chain_reference

from .interpreted import run_interpreted

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_triton_kernel_under_interpreter_matches_separate_gemms():
    run_interpreted("interpret_gemv_chain.py", timeout=300)


@pytest.mark.parametrize("x_shape, w_shapes, match", [
    ((1, 64), [], "at least one weight"),
    ((5, 64), [(32, 64)], "1 <= M <= 4"),
    ((1, 64), [(32, 64), (16, 48)], "weight 1 must be \\[N, 32\\]"),
    ((1, 64), [(32, 60)], "weight 0 must be \\[N, 64\\]"),
])
def test_bad_chains_are_refused_with_the_reason(x_shape, w_shapes, match):
    x = torch.zeros(x_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        check_chain(x, [torch.zeros(s, dtype=torch.bfloat16) for s in w_shapes])


def test_reference_is_the_chain_of_mms():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=gen)
    ws = [torch.randn(6, 8, generator=gen), torch.randn(4, 6, generator=gen)]
    ys = gemv_chain_reference(x, ws)
    assert torch.equal(ys[1], (x @ ws[0].t()) @ ws[1].t())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("widths, block_n, block_k, backoff_ns, persistent", [
    ((2048,) * 9, 4, 1024, 0, False),             # eight k3-mini o_proj-sized stages (8.4 MB each)
    ((2048,) * 9, 4, 1024, 128, False),           # the same, waiting tiles sleeping between reads
    ((2048, 4096, 2048, 4096, 2048), 4, 1024, 0, False),
    ((2048, 3072, 2048), 16, 256, 0, False),
    ((2048,) * 9, 4, 1024, 0, True),              # one program per SM walking its tiles
    ((2048, 4096, 2048, 4096, 2048), 2, 2048, 0, True),  # the whole K of a 2048-wide stage before the wait
])
def test_cuda_chain_in_a_graph_matches_separate_gemms(widths, block_n, block_k, backoff_ns, persistent):
    from k3compile.passes.kernels.gemv_chain import GemvChain
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(widths[i + 1], widths[i], generator=gen, device="cuda") / widths[i] ** 0.5).bfloat16()
          for i in range(len(widths) - 1)]
    chain = GemvChain(ws, 1, block_n=block_n, block_k=block_k, backoff_ns=backoff_ns, persistent=persistent)
    chain.launch()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.launch()
    for seed in (1, 2):  # new inputs each replay
        chain.input.copy_(torch.randn(1, widths[0], generator=gen, device="cuda").bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        # whole launches only: every ticket was taken (the persistent form takes none), every stage counted
        assert int(chain.counters[0]) % chain.tiles == 0
        assert int(chain.counters[-1]) == (seed + 1) * (chain.tiles - int(chain.prefix[-2]))
        prev = chain.input.clone()
        for w, got in zip(ws, chain.outputs):
            exact = prev.double() @ w.double().t()
            err = float((got.double() - exact).abs().max() / exact.abs().max())
            assert err <= 1e-2, f"replay {seed}: rel err {err:.3g}"
            prev = got.clone()


@pytest.mark.parametrize("kwargs, match", [
    ({"block_n": 3}, "block_n must be a power of two"),
    ({"block_k": 8}, "block_k must be a power of two >= 16"),
    ({"backoff_ns": -1}, "backoff_ns must be in"),
])
def test_bad_launches_are_refused_with_the_reason(kwargs, match):
    pytest.importorskip("triton")
    from k3compile.passes.kernels.gemv_chain import GemvChain
    with pytest.raises(ValueError, match=match):
        GemvChain([torch.zeros(16, 32, dtype=torch.bfloat16)], 1, **kwargs)


def test_chain_buffers_lay_out_every_stage():
    pytest.importorskip("triton")
    from k3compile.passes.kernels.gemv_chain import GemvChain
    chain = GemvChain([torch.zeros(24, 32, dtype=torch.bfloat16), torch.zeros(40, 24, dtype=torch.bfloat16)], 2,
                      block_n=8, block_k=16)
    assert chain.input.shape == (2, 32) and [tuple(o.shape) for o in chain.outputs] == [(2, 24), (2, 40)]
    assert chain.prefix.tolist() == [0, 3, 8] and chain.tiles == 8  # ceil(24 / 8), then ceil(40 / 8) tiles
    assert chain.meta.tolist() == [0, 24, 32, 0, 32, 24 * 32, 40, 24, 32, 56]
