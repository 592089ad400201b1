"""Run the attn_res_norm Triton kernel under TRITON_INTERPRET=1 on CPU and compare with the reference.

Both kernels (the one-pass bank tile and the streaming one) on every case they take. Started in a
subprocess by test_attn_res_norm.py (TRITON_INTERPRET is read when the kernel is
decorated). Prints one line per failing case and exits 1 if any failed. The interpreter rounds
fp32 -> bf16 by truncation (the GPU rounds to nearest even), so bf16 cases get the bf16
normwise tolerance widened to 3e-2 (a few truncated ulps; the GPU test holds bf16 to 1e-2).
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_attn_res_norm.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import attn_res_norm as arn  # noqa: E402
from interpreted import report  # noqa: E402  (this folder is sys.path[0] when run as a script)


def cases():
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    for dtype in (torch.float32, torch.bfloat16):
        for bank in (0, 1, 3, 8):
            # one program per token: 1 and 2 tokens cover the row strides (the interpreter's cost grows with them)
            for n, d in ((1, 64), (2, 100), (2, 2304)):
                rows = [randn(n, d, dtype=dtype) * (j + 1) for j in range(bank)]
                yield (f"{dtype} bank={bank} N={n} D={d}", rows, randn(n, d, dtype=dtype), randn(n, d, dtype=dtype),
                       randn(d) if bank else None, randn(d, dtype=dtype))
    # fp32 norm weight on bf16 activations: the output promotes to fp32 (as torch does)
    yield ("bf16 x, fp32 weight", [randn(2, 64).bfloat16()], randn(2, 64).bfloat16(), randn(2, 64).bfloat16(),
           randn(64), randn(64))
    yield "no tokens", [randn(0, 64)], randn(0, 64), randn(0, 64), randn(64), randn(64)
    # a bank row 2 bytes past 16-byte alignment: the one-pass kernel does not take it (streaming only)
    odd = torch.randn(3 * 64 + 1, generator=gen).bfloat16()[1:].view(3, 64)
    assert not arn.one_pass_applies([odd], odd)
    yield "misaligned bank row", [odd], randn(3, 64).bfloat16(), randn(3, 64).bfloat16(), randn(64), randn(64).bfloat16()
    # delta None (a block boundary: p restarts from zeros, so p = x)
    for bank in (0, 2):
        yield (f"no delta bank={bank}", [randn(3, 96).bfloat16() for _ in range(bank)], randn(3, 96).bfloat16(), None,
               randn(96) if bank else None, randn(96).bfloat16())


def main() -> int:
    assert type(arn._attn_res_norm_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    failures, n = [], 0
    for (name, bank, x, delta, query, weight), one_pass in ((c, o) for c in cases() for o in (False, None)):
        if one_pass is None and not arn.one_pass_applies(bank, x):
            continue  # the streaming kernel is the only one there (and was just run)
        name = f"{name} {'one-pass' if one_pass is None else 'streaming'}"
        n += 1
        with_fp32 = x.dtype == torch.bfloat16  # k3::attn_res_norm_f32's extra output: h's fp32 copy
        h, p, *h32 = arn.attn_res_norm_triton(bank, x, delta, query, weight, 1e-5, 1e-6, with_fp32=with_fp32,
                                              one_pass=one_pass)
        if with_fp32 and not (h32[0].dtype == torch.float32 and torch.equal(h32[0], h.float())):
            failures.append(f"{name}: the fp32 copy is not h.float()")
        h0, p0 = arn.attn_res_norm_reference(bank, x, delta, query, weight, 1e-5, 1e-6)
        tol = 1e-5 if x.dtype == torch.float32 else 3e-2  # normwise; see the module doc on bf16
        if h.dtype != h0.dtype or p.dtype != p0.dtype or h.shape != h0.shape:
            failures.append(f"{name}: dtypes/shapes {h.dtype} {p.dtype} {tuple(h.shape)}")
            continue
        for what, a, b in (("h", h, h0), ("p", p, p0)):
            if b.numel() == 0:
                continue
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            if err > tol:
                failures.append(f"{name}: {what} differs, max rel err {err:.3g} > {tol:g}")
    return report(failures, n)


if __name__ == "__main__":
    sys.exit(main())
