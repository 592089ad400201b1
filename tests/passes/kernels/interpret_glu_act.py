"""Run the dense GLU activation kernel under TRITON_INTERPRET=1 on CPU and compare with the reference
(`model_def.ops.moe_math.glu_act`). Started in a subprocess by test_glu_act.py. Prints one line per failing case and
exits 1 if any failed. bf16 within 1e-2 (the interpreter truncates fp32 -> bf16: one ulp; silu's two
roundings 2e-2), fp32 within 1e-5."""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_glu_act.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.model_def.ops.moe_math import glu_act  # noqa: E402
from k3compile.passes.kernels import glu_act as kernel  # noqa: E402
from interpreted import TOL, rel_err, run_cases  # noqa: E402  (this folder is sys.path[0] when run as a script)

GEN = torch.Generator().manual_seed(0)


def case(n, inter, act, dtype, block=kernel.BLOCK, merged=True):
    """gate / up as the merged gate-up GEMM's column blocks (strided rows), or separate tensors; values spread over
    the SiTU's saturating range (|x| up to ~30)"""
    if merged:
        gu = (torch.randn(n, 2 * inter + 3, generator=GEN) * 8).to(dtype)
        gate, up = gu[:, :inter], gu[:, inter: 2 * inter]
    else:
        gate, up = ((torch.randn(n, inter, generator=GEN) * 8).to(dtype) for _ in range(2))
    got = kernel.glu_act_triton(gate, up, act, 4.0, 25.0, block=block)
    want = glu_act(gate, up, act, 4.0, 25.0)
    if got.shape != want.shape or got.dtype != want.dtype or not got.is_contiguous():
        return float("inf"), 0.0
    # silu rounds twice (silu(g), then the product), each truncated by the interpreter: up to 2 bf16 ulps
    tol = 2 * TOL[dtype] if (act, dtype) == ("silu", torch.bfloat16) else TOL[dtype]
    return (rel_err(got, want) if n else 0.0), tol


def cases():
    for act in ("situ", "silu"):
        for dtype in (torch.float32, torch.bfloat16):
            yield f"{act} {dtype} 3 x 40 merged, block 16", lambda a=act, d=dtype: case(3, 40, a, d, block=16)
            yield f"{act} {dtype} 1 x 64 separate", lambda a=act, d=dtype: case(1, 64, a, d, merged=False)
            yield f"{act} {dtype} 5 x 100 merged, default block", lambda a=act, d=dtype: case(5, 100, a, d)
    yield "no rows", lambda: case(0, 32, "situ", torch.bfloat16)


def main() -> int:
    assert type(kernel._glu_act_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    return run_cases(cases())


if __name__ == "__main__":
    sys.exit(main())
