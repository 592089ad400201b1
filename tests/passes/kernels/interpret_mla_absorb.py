"""Run the MLA W_UK absorption kernels (alone, and with the prologue in one launch) under TRITON_INTERPRET=1 on CPU and compare with the reference.

Started in a subprocess by test_mla_absorb.py (TRITON_INTERPRET is read when the kernel is decorated). Prints one
line per failing case and exits 1 if any failed. No tl.dot in this kernel, so bf16 runs here too (the interpreter
truncates fp32 -> bf16: about one ulp).
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_mla_absorb.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import mla_absorb, mla_decode  # noqa: E402
from interpreted import TOL, rel_err, report  # noqa: E402  (this folder is sys.path[0] when run as a script)

GEN = torch.Generator().manual_seed(0)


def case(dtype, tokens, heads, nope, rope, dv, r, block_r):
    """q_nope as the graph has it: the first nope columns of each head's [nope + rope] query slice (strided view)."""
    q = torch.randn(tokens, heads * (nope + rope), generator=GEN).to(dtype).unflatten(-1, (heads, -1))
    q_nope = q[..., :nope]
    w = torch.randn(heads * (nope + dv), r, generator=GEN).to(dtype)
    got = mla_absorb.absorb_triton(q_nope, w, nope, block_r=block_r)
    want = mla_absorb.absorb_reference(q_nope, w, nope)
    assert got.is_contiguous() and got.shape == (tokens, heads, r)
    return rel_err(got, want), TOL[dtype]


def prologue_case(dtype, tokens, heads, nope, rope, dv, r, block_r, page=4):
    """The prologue + absorption kernel: the KV pool after it and q_lat equal the prologue reference then the
    absorption reference; ckv and the query are column blocks of one merged GEMM output, as in the graph."""
    merged = torch.randn(tokens, heads * (nope + rope) + r + rope, generator=GEN).to(dtype)
    q_nope = merged[:, : heads * (nope + rope)].unflatten(-1, (heads, -1))[..., :nope]
    ckv = merged[:, heads * (nope + rope):]
    kv = torch.randn(tokens + 3, 2, page, r + rope, generator=GEN).to(dtype)
    kv_ref = kv.clone()
    loc = torch.randperm((tokens + 3) * page, generator=GEN)[:tokens]
    kv_w = (1 + 0.1 * torch.randn(r, generator=GEN)).to(dtype)
    w = torch.randn(heads * (nope + dv), r, generator=GEN).to(dtype)
    got = mla_absorb.prologue_absorb_triton(ckv, kv_w, 1e-6, kv, 1, loc, q_nope, w, nope, block_r=block_r)
    mla_decode.prologue_reference(ckv, kv_w, 1e-6, kv_ref, 1, loc)
    want = mla_absorb.absorb_reference(q_nope, w, nope)
    return max(rel_err(got, want), rel_err(kv, kv_ref)), TOL[dtype]


PROLOGUE_CASES = [
    (torch.float32, 1, 2, 16, 8, 16, 32, 16),
    (torch.float32, 3, 3, 24, 8, 8, 64, 32),
    (torch.bfloat16, 2, 2, 16, 8, 16, 32, 16),
    (torch.float32, 2, 2, 16, 8, 16, 16, 64),  # r below the default block (k3-tiny's r = 16): one column block
]

CASES = [
    (torch.float32, 1, 2, 16, 8, 16, 32, 16),
    (torch.float32, 3, 4, 24, 8, 8, 64, 64),  # nope not a power of two (masked), one column block
    (torch.float32, 8, 2, 16, 0, 16, 32, 32),  # no rope columns: q_nope is the whole (contiguous) query
    (torch.bfloat16, 2, 2, 16, 8, 16, 32, 16),
    (torch.bfloat16, 5, 3, 16, 8, 32, 64, 32),
]

if __name__ == "__main__":
    failures = []
    for fn, c in [(case, c) for c in CASES] + [(prologue_case, c) for c in PROLOGUE_CASES]:
        err, tol = fn(*c)
        if not err <= tol:
            failures.append(f"{fn.__name__}{c}: rel err {err:.3g} > {tol}")
    sys.exit(report(failures, len(CASES) + len(PROLOGUE_CASES)))
