"""Run the verify-inputs Triton kernel (the CUDA side of `k3::kda_verify_inputs`, pass P16) under
TRITON_INTERPRET=1 on CPU and compare the draft window it writes with the op's CPU reference.

Started in a subprocess by test_kda_verify_inputs.py (Triton reads the flag when the kernel is
decorated). The graph's layout is used: [B*n, C] rows of a merged GEMM's output (strided), split per
request by the op. fp32: every window tensor within rel 1e-6 of the reference; the pools untouched.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_kda_verify_inputs.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.model_def.cache import CacheSpec, CacheTensors  # noqa: E402
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec  # noqa: E402
from k3compile.passes.kernels import kda_verify_inputs as kvi  # noqa: E402
from interpreted import report  # noqa: E402  (this folder is sys.path[0] when run as a script)

TOL = 1e-6


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def case(heads, head_dim, n, slots, lower_bound, with_dt=True, width=4, layer=1, seed=0):
    c = heads * head_dim
    spec = CacheSpec(n_kda=2, kda_heads=heads, kda_head_k=head_dim, kda_head_v=head_dim, conv_channels=3 * c,
                     conv_window=width - 1, n_mla=1, kv_width=8, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    cache = CacheTensors.allocate(spec, max(slots) + 2, 1, 4)
    cache.conv.copy_(r(*cache.conv.shape))
    b = len(slots)
    merged = r(b * n, 3 * c + c + heads + 5)  # one GEMM's output: x_q | x_k | x_v | f | b | more columns
    x_k, x_v = merged[:, c: 2 * c], merged[:, 2 * c: 3 * c]
    f, beta_logits = merged[:, 3 * c: 4 * c], merged[:, 4 * c: 4 * c + heads]
    wk, wv = r(c, width), r(c, width)
    dt, a_log = (r(c) if with_dt else None), r(heads) * 0.5
    st = torch.tensor(slots)
    conv0 = cache.conv.clone()
    wins = [DraftWindow.allocate(DraftWindowSpec(spec, n + 1), b + 1) for _ in range(2)]
    torch.ops.k3.kda_verify_inputs(x_k, x_v, wk, wv, f, dt, a_log, beta_logits, cache.conv, layer, st,
                                   *wins[0].tensors()[1:5], lower_bound)
    per_request = lambda t: t.unflatten(0, (b, -1))  # noqa: E731  (what the op's CUDA kernel does)
    kvi.kda_verify_inputs_triton(per_request(x_k), per_request(x_v), wk, wv, per_request(f),
                                 dt if with_dt else torch.zeros(c), a_log, per_request(beta_logits), cache.conv,
                                 layer, st, *wins[1].tensors()[1:5], lower_bound, decode_batch=b)
    errs = [rel(a, b) for a, b in zip(wins[1].tensors()[1:5], wins[0].tensors()[1:5])]
    return max(errs) <= TOL and torch.equal(cache.conv, conv0), errs


CASES = [
    ("K3 lower bound, 3 requests x 4 positions", dict(heads=2, head_dim=16, n=4, slots=[3, 0, 2], lower_bound=-5.0)),
    ("Kimi-Linear softplus", dict(heads=2, head_dim=16, n=4, slots=[1, 4], lower_bound=None)),
    ("dt_bias folded into f (P11's addmm)", dict(heads=2, head_dim=16, n=3, slots=[2, 1], lower_bound=-5.0,
                                                 with_dt=False)),
    ("K=32, conv width 2, layer 0", dict(heads=1, head_dim=32, n=2, slots=[0], lower_bound=None, width=2, layer=0)),
]

failures = []
for name, kw in CASES:
    ok, errs = case(**kw)
    if not ok:
        failures.append(f"{name}: rel errs k, v, g, beta = {', '.join(f'{e:.2e}' for e in errs)}")
sys.exit(report(failures, len(CASES)))
