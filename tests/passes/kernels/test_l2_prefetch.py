"""kernels/l2_prefetch: the host-side rules (alignment, per-launch budget) and, on an sm90 GPU, that a kernel which
prefetches its rows before reading them computes the same values (a prefetch moves nothing into registers)."""
import pytest
import torch

from k3compile.passes.kernels import l2_prefetch
from k3compile.passes.kernels.pdl import pdl_available

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _row_sums(w_ptr, y_ptr, K, KC, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIECES: tl.constexpr,
                 PREFETCH: tl.constexpr):
        pid = tl.program_id(0)
        if PREFETCH:
            l2_prefetch.prefetch_rows_l2(w_ptr + pid * BLOCK_N * K, BLOCK_N, KC * 2, K * 2, PIECES)
        tl.extra.cuda.gdc_wait()
        r = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            acc += tl.sum(tl.load(w_ptr + r[:, None] * K + kk[None, :], mask=kk[None, :] < K).to(tl.float32), 1)
        tl.store(y_ptr + r, acc)



def test_region_ok_needs_16_byte_pointer_pitch_and_offset():
    w = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert l2_prefetch.region_ok(w, 128)
    assert not l2_prefetch.region_ok(w, 126)
    assert not l2_prefetch.region_ok(w, 128, first_byte=8)
    assert not l2_prefetch.region_ok(w.view(-1)[1:], 128)  # 2 bytes past an aligned start


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not pdl_available(), reason="needs an sm90 GPU with PDL")
@pytest.mark.parametrize("rows, k, kc", [(4, 2304, 2304), (8, 2304, 624), (256, 512, 512), (2, 1024, 16)])
def test_prefetching_kernel_reads_the_same_values(rows, k, kc):
    w = torch.randn(rows * 64, k, device="cuda", dtype=torch.bfloat16)
    outs = []
    for prefetch in (False, True):
        y = torch.empty(rows * 64, device="cuda")
        _row_sums[(64,)](w, y, k, kc, BLOCK_N=rows, BLOCK_K=256, PIECES=128, PREFETCH=prefetch, num_warps=4,
                        launch_pdl=True)
        outs.append(y)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])  # same loads, same order: the same fp32 sums
    torch.testing.assert_close(outs[1], w.float().sum(1), rtol=1e-4, atol=1e-2)
