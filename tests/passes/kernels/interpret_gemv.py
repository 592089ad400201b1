"""Run the GEMV Triton kernel under TRITON_INTERPRET=1 on CPU and compare with the aten reference.

Started in a subprocess by test_gemv.py (TRITON_INTERPRET is read when the kernel is decorated).
Prints one line per failing case and exits 1 if any failed."""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_gemv.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import arrivals, gemv  # noqa: E402
import interpreted  # noqa: E402,F401  (its shim: no re-patching of triton.language inside a launch; sys.path[0])

TOL = 1e-2  # 16-bit output: two roundings (product, then + c) of an fp32 sum


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def cases():
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    for m in (1, 5):
        for n, k in ((40, 96), (130, 72)):
            for split in (1, 3):
                yield f"M={m} N={n} K={k} split={split}", randn(m, k), randn(n, k), None, 32, 32, split
    yield "bias [N]", randn(2, 64), randn(48, 64), randn(48), 32, 32, 2
    yield "residual [M, N]", randn(4, 64), randn(48, 64), randn(4, 48), 16, 16, 1
    yield "residual [M, N] split", randn(4, 160), randn(48, 160), randn(4, 48), 16, 32, 4
    x = randn(3, 130)[:, :64]  # strided rows: a column block of a merged GEMM's output
    yield "strided x", x, randn(32, 64), None, 16, 32, 2
    yield "fp16", randn(5, 64, dtype=torch.float16), randn(24, 64, dtype=torch.float16), None, 16, 16, 2
    rows = gemv.DESIGNS["rows"]  # the rows design: M <= 4, any power-of-two block_n
    for m in (1, 3, 4):
        for n, k, bn, bk, split in ((40, 96, 4, 32, 1), (130, 72, 16, 16, 3), (7, 200, 2, 64, 2)):
            yield f"rows M={m} N={n} K={k} bn={bn} split={split}", randn(m, k), randn(n, k), None, bn, bk, split, rows
    yield "rows residual [M, N] split", randn(2, 160), randn(48, 160), randn(2, 48), 8, 32, 4, rows
    yield "rows bias [N]", randn(1, 64), randn(48, 64), randn(48), 4, 16, 1, rows
    yield "rows strided x", randn(3, 130)[:, :64], randn(32, 64), None, 4, 32, 2, rows
    # num_warps (P8's warps candidates): the program's arithmetic does not depend on it
    for warps in (2, 8):
        yield f"rows w{warps}", randn(1, 96), randn(40, 96), randn(40), 4, 32, 2, rows, warps
        yield f"dot w{warps}", randn(3, 96), randn(40, 96), None, 16, 32, 2, 0, warps


failed = n = 0
for name, x, w, c, bn, bk, split, *launch in cases():
    design = launch[0] if launch else 0
    warps = launch[1] if len(launch) > 1 else 4
    n += 1
    want = gemv.gemv_reference(x, w, c)
    # the exact result (fp64): kernel and aten both round the product, then the sum, to 16 bits; their
    # roundings may differ by an ulp where K is summed in another order, so both are held to the exact one
    exact = x.double() @ w.double().t() + (0 if c is None else c.double())
    # twice: the split-K counters must be back at zero after a launch; the second launch asks for PDL (here: the
    # first K step peeled off, its weights loaded first), which must not change a bit
    first = None
    for rep, pdl in enumerate((False, True)):
        got = gemv.gemv_triton(x, w, c, bn, bk, split, num_warps=warps, design=design, use_pdl=pdl)
        err = max(rel(got, exact), rel(want, exact))
        if got.dtype != want.dtype or got.shape != want.shape or not err <= TOL:
            failed += 1
            print(f"FAIL {name} (launch {rep + 1}): rel err {err:.3g}, {got.dtype} {tuple(got.shape)}")
        elif first is not None and not torch.equal(got, first):
            failed += 1
            print(f"FAIL {name}: the peeled (PDL) launch differs from the plain one")
        first = got
    counters = arrivals.current(torch.device("cpu"), "gemv")
    if counters is not None and int(counters.abs().sum()) != 0:
        failed += 1
        print(f"FAIL {name}: split-K counters not reset")
# k3.gemv's tiers (run_gemv: what the op launches on CUDA): the rows tile up to 2 rows, a split-K dot tile up to 4,
# the aten calls above; each tier's launch is the kernel of that configuration, bit for bit
gen = torch.Generator().manual_seed(1)
w = torch.randn(40, 96, generator=gen).bfloat16()
first, upper = (4, 32, 2, gemv.DESIGNS["rows"], 2), [4, 16, 32, 3, gemv.DESIGNS["dot"], 4]
for m, want_cfg in ((1, first), (2, first), (3, tuple(upper[1:])), (4, tuple(upper[1:])), (6, None)):
    n += 1
    x = torch.randn(m, 96, generator=gen).bfloat16()
    got = gemv.run_gemv(x, w, None, 2, *first[:4], True, first[4], 0, False, upper)
    if want_cfg is None:
        want = gemv.gemv_reference(x, w)
    else:
        bn, bk, split, design, warps = want_cfg
        want = gemv.gemv_triton(x, w, None, bn, bk, split, num_warps=warps, design=design, use_pdl=True)
    exact = x.double() @ w.double().t()
    if not torch.equal(got, want) or not rel(got, exact) <= TOL:
        failed += 1
        print(f"FAIL tiers M={m}: not the launch of {want_cfg} (rel err {rel(got, exact):.3g})")
print(f"{n - failed}/{n} cases match")
sys.exit(1 if failed else 0)
