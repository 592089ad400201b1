"""P9's fused path (in-place all-reduce, then P7's Triton kernel on the reduced rows) under TRITON_INTERPRET=1
on CPU, over gloo with 2 ranks, against the composite (k3::all_reduce, then the reference k3::attn_res_norm).

Started in a subprocess by test_all_reduce_norm.py (TRITON_INTERPRET is read when a kernel is decorated).
Each rank contributes its own partial; both sides must see the same sum. bf16 cases get the interpreter's
3e-2 normwise tolerance (it rounds fp32 -> bf16 by truncation; see interpret_attn_res_norm.py).
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_all_reduce_norm.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from interpreted import report  # noqa: E402  (this folder is sys.path[0] when run as a script)

WORLD = 2


def cases(rank):
    for dtype in (torch.float32, torch.bfloat16):
        for bank in (0, 3):
            for with_x in (True, False):  # False: an AttnRes block boundary (p is the reduced sum)
                gen = torch.Generator().manual_seed(bank * 10 + with_x)
                n, d = 3, 96
                rows = [torch.randn(n, d, generator=gen).to(dtype) for _ in range(bank)]
                x = torch.randn(n, d, generator=gen).to(dtype) if with_x else None
                partials = [torch.randn(n, d, generator=gen).to(dtype) for _ in range(WORLD)]
                query = torch.randn(d, generator=gen) if bank else None
                weight = torch.randn(d, generator=gen).to(dtype)
                yield f"{dtype} bank={bank} x={'yes' if with_x else 'None'}", rows, x, partials[rank], query, weight


def _rank(rank):
    from k3compile.model_def.parallel.topology import parse_topology
    from k3compile.passes.kernels import all_reduce_norm as arn
    from k3compile.passes.kernels import attn_res_norm as p7
    from k3compile.runtime.parallel.groups import init_rank, shutdown_rank

    assert type(p7._attn_res_norm_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    init_rank(parse_topology(f"tp{WORLD}"), "gloo", timeout_s=60)
    failures, n = [], 0
    try:
        for name, bank, x, part, query, weight in cases(rank):
            n += 1
            with_fp32 = part.dtype == torch.bfloat16
            fused_part = part.clone()
            got = arn.all_reduce_attn_res_norm_triton(bank, x, fused_part, query, weight, 1e-5, 1e-6, "world",
                                                      with_fp32=with_fp32)
            summed = torch.ops.k3.all_reduce(part, "world")
            xx, dd = (summed, None) if x is None else (x, summed)
            ref = p7.attn_res_norm_reference(bank, xx, dd, query, weight, 1e-5, 1e-6)
            if not torch.equal(fused_part, summed):
                failures.append(f"rank {rank} {name}: partial does not hold the reduced sum")
            if with_fp32 and not torch.equal(got[2], got[0].float()):
                failures.append(f"rank {rank} {name}: the fp32 copy is not h.float()")
            tol = 1e-5 if part.dtype == torch.float32 else 3e-2
            for what, a, b in (("h", got[0], ref[0]), ("p", got[1], ref[1])):
                err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                if a.dtype != b.dtype or err > tol:
                    failures.append(f"rank {rank} {name}: {what} differs ({a.dtype} vs {b.dtype}, rel err {err:.3g})")
    finally:
        shutdown_rank()
    return failures, n


def main() -> int:
    from k3compile.runtime.parallel.launch import launch
    results = launch(_rank, WORLD, (), timeout_s=240)
    return report([f for fails, _ in results for f in fails], sum(n for _, n in results))


if __name__ == "__main__":
    sys.exit(main())
