"""P12's finalize kernel under TRITON_INTERPRET=1 on CPU against the reference (moe_math.finalize): identity
and permuted slot_rows (the grouped GEMM's expert order), with and without the shared partial, fp32 and bf16,
column blocks that do and do not divide D. Started in a subprocess by test_moe_finalize.py. bf16 gets the
interpreter's 3e-2 normwise tolerance (it rounds fp32 -> bf16 by truncation)."""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_moe_finalize.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.model_def.ops import moe_math  # noqa: E402
from k3compile.passes.kernels import moe_finalize as mf  # noqa: E402
from interpreted import report  # noqa: E402  (this folder is sys.path[0] when run as a script)


def main() -> int:
    assert type(mf._finalize_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    gen = torch.Generator().manual_seed(0)
    failures, n = [], 0
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, k, d, block in ((1, 1, 64, 1024), (5, 4, 96, 32), (3, 8, 200, 64), (0, 2, 64, 1024)):
            for permuted in (False, True):
                for with_shared in (False, True):
                    name = f"{dtype} N={tokens} k={k} D={d} block={block} permuted={permuted} shared={with_shared}"
                    n += 1
                    rows = torch.randn(tokens * k, d, generator=gen).to(dtype)
                    order = torch.randperm(tokens * k, generator=gen) if permuted else torch.arange(tokens * k)
                    slot_rows = order.view(tokens, k)
                    weights = torch.rand(tokens, k, generator=gen)
                    shared = torch.randn(tokens, d, generator=gen).to(dtype) if with_shared else None
                    got = mf.moe_finalize_triton(rows, slot_rows, weights, shared, block_d=block)
                    ref = moe_math.finalize(rows, slot_rows, weights, shared)
                    if got.dtype != ref.dtype or got.shape != ref.shape:
                        failures.append(f"{name}: {got.dtype} {tuple(got.shape)} vs {ref.dtype} {tuple(ref.shape)}")
                        continue
                    if ref.numel() == 0:
                        continue
                    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    tol = 1e-6 if dtype == torch.float32 else 3e-2
                    if err > tol:
                        failures.append(f"{name}: max rel err {err:.3g} > {tol:g}")
    return report(failures, n)


if __name__ == "__main__":
    sys.exit(main())
