"""Run the fused MoE decode op with the shared expert's gate/up in kernel A (shared_w13) under TRITON_INTERPRET=1.

Started in a subprocess by test_moe_decode.py. Per case: the op with shared_w13 against the reference (its
gate/up as the unfused graph computes them: one GEMM on x, then split), launched twice on the same inputs
(both outputs equal: the second launch finds the split design's counters zeroed), and once more with
shared_l2_prefetch (kernel A's shared slot first in launch order): the same bits. Cases: SiLU-GLU and
SiTU-GLU, k = 3 (not a power of two), shared width Is equal to, below and above I (the shared slot's column
blocks then run past or stop short of the routed ones), kernel A's "rows" and "tiles" designs (MXFP4 routed
experts with the bf16/fp32 shared weight: the tiles design), every down design, PDL asked for (a no-op here:
pdl_available() is False under the interpreter, so the path is the one CUDA runs without it). Tiny shapes.
Prints one line per failing case and exits 1 if any failed.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_moe_shared_slot.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.model_def.ops import mxfp4  # noqa: E402
from k3compile.passes.kernels import moe_decode  # noqa: E402
from interpreted import TOL, rel_err, report  # noqa: E402  (this script's folder is on sys.path)



def cases():
    """(name, op kwargs, dtype, designs, (block_n, block_k) or None for the op's tile rule, use_pdl)"""
    gen = torch.Generator().manual_seed(11)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    # (act, N, E, k, D, I, Is, Do, MXFP4, dtype, designs, tile, pdl)
    grid = [("silu", 1, 6, 3, 64, 32, 32, 40, False, torch.float32, ("rows", "split"), (16, 32), False),
            ("situ", 2, 6, 3, 64, 32, 24, 40, False, torch.float32, ("rows", "split"), (16, 32), True),
            ("situ", 2, 8, 2, 64, 16, 48, 32, False, torch.float32, ("tiles", "tiles"), (16, 32), False),
            ("silu", 2, 8, 2, 64, 32, 32, 32, False, torch.float32, ("rows", "rows"), (16, 32), False),
            ("silu", 2, 6, 3, 64, 32, 40, 48, False, torch.bfloat16, ("rows", "split"), None, True),
            ("situ", 1, 6, 3, 64, 32, 32, 40, True, torch.float32, ("tiles", "split"), (16, 32), False)]
    for act, n, e, k, d, i, s, do, quant, dtype, designs, tile, pdl in grid:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
        wts = torch.rand(n, k, generator=gen)
        w13, w2 = randn(e, 2 * i, d, scale=d ** -0.5), randn(e, do, i, scale=i ** -0.5)
        kw = dict(x=randn(n, d).to(dtype), topk_ids=ids, topk_weights=wts, act=act, beta=4.0, linear_beta=25.0,
                  shared_w13=randn(2 * s, d, scale=d ** -0.5).to(dtype),
                  shared_w2=randn(do, s, scale=s ** -0.5).to(dtype))
        if quant:
            (w13p, w13s), (w2p, w2s) = mxfp4.quantize(w13), mxfp4.quantize(w2)
            kw.update(w13=w13p, w2=w2p, w13_scale=w13s, w2_scale=w2s)
        else:
            kw.update(w13=w13.to(dtype), w2=w2.to(dtype))
        yield (f"{act} N={n} E={e} k={k} D={d} I={i} Is={s} Do={do} {'mxfp4' if quant else 'dense'} {dtype} "
               f"{designs} pdl={pdl}"), kw, dtype, designs, tile, pdl


def main() -> int:
    assert type(moe_decode._expert_up_rows_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    failures, n = [], 0
    for name, kw, dtype, designs, tile, pdl in cases():
        n += 1
        ref = moe_decode.fused_moe_reference(**{key: v.float() if isinstance(v, torch.Tensor) and v.dtype == dtype
                                                else v for key, v in kw.items()}).to(dtype)
        block_n, block_k = tile or (None, None)
        got, again = (moe_decode.fused_moe_triton(**kw, block_n=block_n, block_k=block_k, designs=designs,
                                                  use_pdl=pdl) for _ in range(2))
        if got.dtype != ref.dtype or got.shape != ref.shape:
            failures.append(f"{name}: got {got.dtype} {list(got.shape)}, want {ref.dtype} {list(ref.shape)}")
            continue
        err = rel_err(got, ref)
        if not err <= TOL[dtype]:
            failures.append(f"{name} tile={tile}: rel err {err:.3g} > {TOL[dtype]:g}")
        if not torch.equal(got, again):
            failures.append(f"{name}: two launches on the same inputs differ")
        # shared_l2_prefetch: kernel A's grid transposed, the shared slot first (the prefetch itself needs PDL,
        # which the interpreter has not): the same programs computing the same sums, so the same bits
        first = moe_decode.fused_moe_triton(**kw, block_n=block_n, block_k=block_k, designs=designs, use_pdl=pdl,
                                            shared_l2_prefetch=True, down_l2_prefetch=True)
        if not torch.equal(got, first):
            failures.append(f"{name}: shared slot first (shared_l2_prefetch) changed the output")
    return report(failures, n)


if __name__ == "__main__":
    sys.exit(main())
