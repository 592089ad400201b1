"""Run the MLA decode Triton kernels under TRITON_INTERPRET=1 on CPU and compare with the references.

Started in a subprocess by test_mla_decode.py (TRITON_INTERPRET is read when the kernels are
decorated). Prints one line per failing case and exits 1 if any failed.

The attention cases are fp32: the interpreter's tl.dot on bf16 operands returns garbage (Triton
3.9 interprets the raw 16-bit patterns), so bf16 attention is tested on the GPU only. The prologue
has no dot and is tested in bf16 too (the interpreter truncates fp32 -> bf16, hence one ulp).
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_mla_decode.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import mla_decode as mla  # noqa: E402
from interpreted import run_cases  # noqa: E402  (this folder is sys.path[0] when run as a script)

GEN = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


def attention_case(lens, page, heads=2, r=16, rope=8, splits=None, layers=2, layer=1, dv=None, merge_cols=None,
                   gated=False):
    """Requests with different lengths, pages scattered over the pool (non-contiguous page tables),
    q_rope a strided view (as in the graph), the pool's page stride padded like a unified arena."""
    b = len(lens)
    max_pages = max((n + page - 1) // page for n in lens) + 1
    pages = b * max_pages + 3
    arena = randn(pages, layers * page * (r + rope) + 8)  # padded page stride
    kv = arena[:, : layers * page * (r + rope)].view(pages, layers, page, r + rope)
    table = (torch.randperm(pages - 1, generator=GEN)[: b * max_pages] + 1).view(b, max_pages).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    q_nope = randn(b, heads, r)
    q_rope = randn(b, heads, rope + 5)[..., 5:]
    scale = (r + rope) ** -0.5
    if dv is None:
        got = mla.decode_triton(q_nope, q_rope, kv, layer, table, seq, scale, num_splits=splits, merge_cols=merge_cols)
        want = mla.decode_reference(q_nope, q_rope, kv, layer, table, seq, scale)
    else:  # W_UV applied by the merge kernel: a view of kv_b_proj's weight, as the op passes it (block_dv < dv)
        nope = 8
        w_uv = mla.w_uv_of(randn(heads * (nope + dv), r), heads, nope)
        # MLA's output gate: a column block of a wider GEMM output (strided rows), as P15's gate_out passes it
        gate = randn(b, heads * dv + 7)[:, 3: 3 + heads * dv] * 3 if gated else None
        got = mla.decode_triton(q_nope, q_rope, kv, layer, table, seq, scale, num_splits=splits, w_uv=w_uv, block_dv=8,
                                merge_cols=merge_cols, gate=gate)
        want = mla.decode_out_reference(q_nope, q_rope, kv, layer, table, seq, scale, w_uv, gate)
        if merge_cols and r // merge_cols > 1 and mla.arrival_counts("cpu", 1).any():
            return float("inf"), 0.0  # the last arrival must leave every count at zero for the next launch
    return ((got - want).abs().max() / want.abs().max()).item(), 1e-5


def w_uv_bound_case(tokens, bound, gated):
    """What k3.mla_decode_fused_out launches (decode_out_run) for `tokens` tokens under the op's w_uv_max_tokens
    `bound`: the merge kernel applying W_UV (and the gate) up to it, the plain merge + einsum above; LAUNCH_TABLE's
    choice (the whole-row merge above 4 tokens); both against the reference."""
    heads, r, rope, nope, dv, page = 2, 16, 8, 8, 12, 16  # lens up to 38: 3 of the 4 pages each
    lens = [3 + 5 * i for i in range(tokens)]
    pages = tokens * 4 + 3
    kv = randn(pages, 2, page, r + rope)
    table = (torch.randperm(pages - 1, generator=GEN)[: tokens * 4] + 1).view(tokens, 4).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    q_nope, q_rope = randn(tokens, heads, r), randn(tokens, heads, rope + 5)[..., 5:]
    w_uv = mla.w_uv_of(randn(heads * (nope + dv), r), heads, nope)
    gate = randn(tokens, heads * dv + 7)[:, 3: 3 + heads * dv] * 3 if gated else None
    scale = (r + rope) ** -0.5
    got = mla.decode_out_run(q_nope, q_rope, kv, 1, table, seq, scale, w_uv, True, gate=gate, w_uv_max_tokens=bound)
    want = mla.decode_out_reference(q_nope, q_rope, kv, 1, table, seq, scale, w_uv, gate)
    if mla.arrival_counts("cpu", 1).any():
        return float("inf"), 0.0
    return ((got - want).abs().max() / want.abs().max()).item(), 1e-5


def prologue_case(dtype, n, with_q, page):
    r, rope, q_dim = 16, 8, 24
    kv = randn(12, 2, page, r + rope, dtype=dtype)
    kv_ref = kv.clone()
    merged = randn(n, q_dim + r + rope + 8, dtype=dtype)  # the merged GEMM's output: column blocks
    q_a = merged[:, :q_dim] if with_q else None
    ckv = merged[:, q_dim: q_dim + r + rope]
    w_kv, w_q = randn(r, dtype=dtype), randn(q_dim, dtype=dtype) if with_q else None
    loc = torch.randperm(12 * page, generator=GEN)[:n]
    got = mla.prologue_triton(ckv, w_kv, 1e-6, kv, 1, loc, q_a, w_q, 1e-6)
    want = mla.prologue_reference(ckv, w_kv, 1e-6, kv_ref, 1, loc, q_a, w_q, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    err = ((kv.float() - kv_ref.float()).abs().max() / kv_ref.float().abs().max()).item()
    if with_q:
        err = max(err, ((got.float() - want.float()).abs().max() / want.float().abs().max()).item())
    elif got.numel() != 0:
        err = float("inf")
    return err, tol


def cases():
    for page in (1, 16):
        yield f"lens 1,5,40 page {page}", lambda p=page: attention_case([1, 5, 40], p)
        yield f"lens 70,17,3 page {page} 3 splits", lambda p=page: attention_case([70, 17, 3], p, splits=3)
    yield "page 4, 3 heads, r=32, 4 splits", lambda: attention_case([33, 2], 4, heads=3, r=32, splits=4)
    yield "more splits than tiles", lambda: attention_case([5, 1], 16, splits=8)
    yield "20 heads (two head blocks)", lambda: attention_case([9, 64], 16, heads=20, layer=0)
    yield "length 1 only", lambda: attention_case([1], 1)
    for dtype in (torch.float32, torch.bfloat16):
        for with_q in (False, True):
            for page in (1, 16):
                yield (f"prologue {dtype} q={with_q} page {page}",
                       lambda d=dtype, q=with_q, p=page: prologue_case(d, 5, q, p))
    # merge_cols 0: the whole-row merge kernels; 4, 8: column blocks (with W_UV: the last-arrival sum); the cases
    # above take LAUNCH_TABLE's choice, here r = 16 (one column block)
    for cols in (0, 4):
        yield f"merge cols {cols}, 3 splits", lambda c=cols: attention_case([70, 17, 1, 3], 16, splits=3, merge_cols=c)
        yield (f"W_UV in the merge, 3 heads, 1 token, merge cols {cols}",
               lambda c=cols: attention_case([5], 4, heads=3, dv=16, merge_cols=c))
    for cols in (0, 4, 8):
        yield (f"W_UV in the merge, dv 12, 3 splits, merge cols {cols}",
               lambda c=cols: attention_case([70, 17, 3], 16, splits=3, dv=12, merge_cols=c))
    yield "W_UV in the merge, 64 splits (more than tiles), merge cols 4", lambda: attention_case(
        [40, 9], 4, splits=64, dv=12, merge_cols=4)
    # the output gate (P15's gate_out) in each merge + W_UV kernel: whole row (0), one column block (16 = r), and
    # column blocks summed by the last arrival (4)
    for cols in (0, 16, 4):
        yield (f"W_UV + output gate in the merge, dv 12, 3 splits, merge cols {cols}",
               lambda c=cols: attention_case([70, 17, 3], 16, splits=3, dv=12, merge_cols=c, gated=True))
    # the op's token bound for W_UV in the merge (P15's w_uv_max_tokens): 8 tokens above the default bound (merge +
    # einsum) and within a bound of 8 (the whole-row merge + W_UV kernel), with and without the gate; 2 tokens
    for tokens, bound, gated in ((8, 4, False), (8, 8, False), (8, 8, True), (2, 8, True)):
        yield (f"op path: {tokens} tokens, w_uv_max_tokens {bound}, gated {gated}",
               lambda t=tokens, b=bound, g=gated: w_uv_bound_case(t, b, g))


def main() -> int:
    assert type(mla._decode_split_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    return run_cases(cases())


if __name__ == "__main__":
    sys.exit(main())
