"""GPU: the ReplaySSM fold leaves the state P5's fused decode kernel writes, bit for bit (torch.equal).

Path A decodes each request's accepted tokens one by one with P5's kernel (passes/kernels/kda_decode.py).
Path B stores the window inputs with P5's arithmetic (passes/kernels/kda_verify_inputs.py, the pool
untouched), then commits: one fold launch for all layers and heads + the conv rollback.
"""
import pytest
import torch

from k3compile.model_def.cache import CacheSpec, CacheTensors
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec

pytestmark = pytest.mark.gpu


def decode_vs_fold(head_dim, dtype, lower_bound, dev="cuda", batch=4, layout="s8"):
    """(pools after P5 decode, pools after verify inputs + commit); also run on CPU by interpret_fold.py.
    P5 decodes with the V split its launch `layout` picks for the whole batch (each step decodes the requests
    that accepted that far, as one batch of `batch` would); the fold and the inputs use that batch's blocks."""
    from k3compile.model_def.ops.kda_launch import kda_launch
    from k3compile.passes.kernels.kda_decode import fused_kda_decode_triton
    from k3compile.passes.kernels.kda_verify_inputs import kda_verify_inputs_triton
    from k3compile.runtime.spec.fold_kernel import commit

    h, n_kda, L, width = 2, 2, 6, 4
    c = h * head_dim
    spec = CacheSpec(n_kda=n_kda, kda_heads=h, kda_head_k=head_dim, kda_head_v=head_dim, conv_channels=3 * c,
                     conv_window=width - 1, n_mla=1, kv_width=8, dtype=dtype)
    slots = [5, 1, 3, 2] + list(range(6, batch + 2))
    accept = ([1, 6, 3, 4] + [1 + i % L for i in range(batch)])[:batch]
    slots = slots[:batch]
    b = len(slots)
    launch = kda_launch(layout, b, h, head_dim, head_dim)  # the whole batch's: blocks and warps as well as the split
    gen = torch.Generator(device=dev).manual_seed(0)  # noqa
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    pools = [CacheTensors.allocate(spec, b + 3, 1, 4, device=dev) for _ in range(2)]
    ssm0, conv0 = r(*pools[0].ssm.shape) * 0.3, r(*pools[0].conv.shape).to(dtype)
    for p in pools:
        p.ssm.copy_(ssm0)
        p.conv.copy_(conv0)
    layers = []
    for _ in range(n_kda):
        layers.append(dict(xq=r(b, L, c).to(dtype), xk=r(b, L, c).to(dtype), xv=r(b, L, c).to(dtype),
                           f=r(b, L, c).to(dtype), bl=r(b, L, h).to(dtype), gate=r(b, L, h, head_dim).to(dtype),
                           wq=r(c, width).to(dtype), wk=r(c, width).to(dtype), wv=r(c, width).to(dtype),
                           dt=r(c), alog=r(h) * 0.5, normw=r(head_dim)))
    st = torch.tensor(slots, device=dev)
    for t in range(L):  # A: P5 decode of the accepted tokens
        rows = [i for i in range(b) if accept[i] > t]
        for li, w in enumerate(layers):
            pick = lambda x: x[rows, t].contiguous()  # noqa: E731
            fused_kda_decode_triton(pick(w["xq"]), pick(w["xk"]), pick(w["xv"]), w["wq"], w["wk"], w["wv"],
                                    pick(w["f"]), w["dt"], w["alog"], pick(w["bl"]), pick(w["gate"]), w["normw"],
                                    pools[0].conv, pools[0].ssm, li, st[rows], lower_bound, 1e-5, v_split=launch.v_split,
                                    block_v=launch.block_v, num_warps=launch.num_warps)
    window = DraftWindow.allocate(DraftWindowSpec(spec, L), b, device=dev)
    for li, w in enumerate(layers):  # B: window inputs, then one commit
        kda_verify_inputs_triton(w["xk"], w["xv"], w["wk"], w["wv"], w["f"], w["dt"], w["alog"], w["bl"],
                                 pools[1].conv, li, st, window.k, window.v, window.g, window.beta, lower_bound,
                                 decode_batch=b, layout=layout)
        window.x[:, li] = torch.cat([w["xq"], w["xk"], w["xv"]], -1)
    assert torch.equal(pools[1].ssm, ssm0) and torch.equal(pools[1].conv, conv0), "verify wrote the pools"
    commit(pools[1], window, slots, accept, use_kernel=True, decode_batch=b, layout=layout)
    return pools


@pytest.mark.parametrize("head_dim,dtype,lower_bound,batch,layout", [
    (128, torch.bfloat16, -5.0, 4, "s8"), (128, torch.bfloat16, None, 4, "s8"), (16, torch.float32, -5.0, 4, "s8"),
    (64, torch.bfloat16, -5.0, 4, "s8"), (128, torch.bfloat16, -5.0, 160, "s8")])  # 160 x 2 heads: no V split
def test_fold_is_bit_identical_to_p5_decode(head_dim, dtype, lower_bound, batch, layout):
    pools = decode_vs_fold(head_dim, dtype, lower_bound, batch=batch, layout=layout)
    torch.cuda.synchronize()
    diff = (pools[1].ssm - pools[0].ssm).abs().max().item()
    assert torch.equal(pools[1].ssm, pools[0].ssm), f"states differ (max abs diff {diff:.3e})"
    assert torch.equal(pools[1].conv, pools[0].conv)
