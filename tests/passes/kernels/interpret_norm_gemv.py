"""Run the fused norm + GEMV Triton kernel under TRITON_INTERPRET=1 on CPU and compare with the references.

Started in a subprocess by test_norm_gemv.py (TRITON_INTERPRET is read when the kernel is decorated).
Prints one line per failing case and exits 1 if any failed."""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_norm_gemv.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import arrivals, gemv  # noqa: E402
from k3compile.passes.kernels import attn_res_norm as arn  # noqa: E402
from k3compile.passes.kernels import norm_gemv as ng  # noqa: E402
from interpreted import report  # noqa: E402  (this folder is sys.path[0] when run as a script)

TOL = 1e-2  # 16-bit output of an fp32 sum (the interpreter rounds to 16 bits by its own rule)


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def cases():
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    dot, rows = gemv.DESIGNS["dot"], gemv.DESIGNS["rows"]
    yield "dot M=5 split 3", randn(5, 96), randn(5, 96), randn(96, scale=0.5) + 1, randn(40, 96), None, 32, 32, 3, dot
    yield "dot M=1", randn(1, 72), randn(1, 72), randn(72, scale=0.5) + 1, randn(130, 72), None, 16, 32, 1, dot
    yield "rows M=3 split 3", randn(3, 96), randn(3, 96), randn(96, scale=0.5) + 1, randn(40, 96), None, 16, 16, 3, rows
    yield "rows M=1 bn=2", randn(1, 72), randn(1, 72), randn(72, scale=0.5) + 1, randn(130, 72), None, 2, 64, 1, rows
    yield "no delta (p = x)", randn(2, 64), None, randn(64) + 1, randn(24, 64), None, 16, 16, 2, dot
    yield "rows bias [N], no delta", randn(1, 64), None, randn(64) + 1, randn(24, 64), randn(24), 4, 16, 2, rows
    yield ("rows residual [M, N]", randn(2, 160), randn(2, 160), randn(160) + 1, randn(48, 160), randn(2, 48),
           8, 32, 4, rows)
    yield ("fp16", randn(3, 64, dtype=torch.float16), randn(3, 64, dtype=torch.float16),
           randn(64, dtype=torch.float16) + 1, randn(24, 64, dtype=torch.float16), None, 16, 16, 2, dot)
    # a wide row: the inverse RMS must come from the whole row, not the program's K slice
    yield ("K=1152 rows split 4", randn(1, 1152, scale=8), randn(1, 1152), randn(1152) + 1, randn(8, 1152), None,
           4, 128, 4, rows)


failures, n = [], 0
for name, x, delta, nw, w, c, bn, bk, split, design in cases():
    n += 1
    eps = 1e-6
    # P7's own kernel on the same inputs: the interpreter rounds to 16 bits its own way, so p must equal P7's p
    # bit for bit and y is held to the exact product of P7's h
    h7, p7 = arn.attn_res_norm_triton([], x, delta, None, nw, 0.0, eps)
    exact = h7.double() @ w.double().t() + (0 if c is None else c.double())
    first = None
    for rep, pdl in enumerate((False, True) if split > 1 else (True,)):  # split: counters back at zero after one
        y, p = ng.norm_gemv_triton(x, delta, nw, eps, w, c, bn, bk, split, design=design, use_pdl=pdl)
        err = rel(y, exact)
        if y.dtype != w.dtype or y.shape != (x.shape[0], w.shape[0]) or not err <= TOL:
            failures.append(f"{name} (launch {rep + 1}): rel err {err:.3g}, {y.dtype} {tuple(y.shape)}")
        elif not torch.equal(p, p7):
            failures.append(f"{name}: p differs from P7's")
        elif first is not None and not torch.equal(y, first):
            failures.append(f"{name}: the second launch differs from the first")
        first = y
    counters = arrivals.current(torch.device("cpu"), ng.ARRIVALS_OWNER)
    if counters is not None and int(counters.abs().sum()) != 0:
        failures.append(f"{name}: split-K counters not reset")
sys.exit(report(failures, n))
