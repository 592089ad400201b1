"""Run kernel C with the AttnRes norm tail (kernels/moe_out_norm.py) under TRITON_INTERPRET=1 on CPU.

Started by test_moe_out_norm.py through interpreted.run_interpreted. Each case runs the op's kernels on a small latent
MoE and compares (h, p) with
  * the references (the MoE's, then P7's norm) on the same inputs in fp32: normwise relative error within 3e-2 (the
    interpreter rounds fp32 -> bf16 by truncation, as interpret_attn_res_norm.py says; the GPU test holds 1e-2);
  * the pair the pass replaces, run as kernels (P6's kernels without the tail, then P7's one-pass kernel on their
    output): p bit for bit (p = residual + y: y must be the complete row when the tail reads it), h within 1e-2;
and checks that every launch left its arrival counters at zero. Prints one line per failing case, exits 1 if any.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_moe_out_norm.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import arrivals, moe_decode  # noqa: E402
from k3compile.passes.kernels import attn_res_norm as arn  # noqa: E402
from k3compile.passes.kernels import moe_out_norm as mon  # noqa: E402
from interpreted import rel_err, report  # noqa: E402  (this script's folder is on sys.path)

INTERPRETED_BF16_TOL = 3e-2  # truncating fp32 -> bf16 casts (see the module doc)


def cases():
    """(name, norm args (bank, residual, query, norm_weight, res_eps, norm_eps), MoE args, launch options)"""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    # (tokens, bank rows, residual?, latent norm?, options): D = 48 output columns (not a power of two), latent 32,
    # top-2 of 8 experts, the shared expert's GLU on the output side; block_n 16: 3 column blocks per token (the
    # counter's path), 64: one block (the tail without counters); latent_prewait; more warps for the tail
    grid = [(1, 3, True, True, dict(block_n=16)),
            (3, 2, True, False, dict(block_n=16, latent_prewait=True)),
            (2, 0, True, True, dict(block_n=64)),
            (2, 1, False, True, dict(block_n=16, tail_warps=8)),
            (2, 2, True, True, dict(tail_block_n=8, latent_prewait=True)),  # the tail's own column block: 6 blocks
            (1, 7, True, True, dict())]  # the op's own tile rule; 7 bank rows (padded to 8)
    dtype, d, lat, e, k, s = torch.bfloat16, 48, 32, 8, 2, 24
    for n, rows, res, lnorm, opts in grid:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
        moe = [randn(n, lat).to(dtype), ids, torch.rand(n, k, generator=gen),
               randn(e, 64, lat, scale=lat ** -0.5).to(dtype), randn(e, lat, lat, scale=lat ** -0.5).to(dtype),
               None, None, randn(n, s).to(dtype), randn(n, s).to(dtype), randn(d, s, scale=s ** -0.5).to(dtype),
               "situ", 4.0, 25.0, randn(d, lat, scale=lat ** -0.5).to(dtype),
               (1 + 0.1 * randn(lat)).to(dtype) if lnorm else None, 1e-5, None]
        bank = [randn(n, d).to(dtype) for _ in range(rows)]
        norm = (bank, randn(n, d).to(dtype) if res else None, randn(d) if rows else None,
                (1 + 0.1 * randn(d)).to(dtype), 1e-6, 1e-5)
        yield f"N={n} bank={rows} residual={res} latent_norm={lnorm} {opts}", norm, moe, opts


def main() -> int:
    assert type(mon._latent_out_norm_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    failures, n = [], 0
    for name, norm, moe, opts in cases():
        n += 1
        wrong = []  # this case's failures: one report line
        bank, residual, query, norm_w, res_eps, norm_eps = norm
        tail = {key: opts.pop(key) for key in ("tail_warps", "tail_block_n") if key in opts}
        h, p = mon.fused_moe_norm_triton(*norm, *moe, **tail, **opts)
        # the references on the same inputs in fp32 (the kernels accumulate in fp32; the bf16 references would round
        # y, p, the mix and the normed row on the way, each rounding moving h by up to 2^-9)
        def f32(v):
            return v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        y_ref = moe_decode.fused_moe_reference(*map(f32, moe))
        nx, delta = mon._norm_inputs(y_ref, [f32(r) for r in bank], f32(residual))
        h_ref, p_ref = arn.attn_res_norm_reference([f32(r) for r in bank], nx, delta, query, f32(norm_w), res_eps,
                                                   norm_eps)
        h_ref, p_ref = h_ref.to(h.dtype), p_ref.to(p.dtype)
        # the pair as kernels: P6's kernels (no tail), then P7's kernel on their y
        y = moe_decode.fused_moe_triton(*moe, **opts)
        nx, delta = mon._norm_inputs(y, bank, residual)
        h_pair, p_pair = arn.attn_res_norm_triton(bank, nx, delta, query, norm_w, res_eps, norm_eps)
        for what, got, want, tol in (("h vs reference", h, h_ref, INTERPRETED_BF16_TOL),
                                     ("p vs reference", p, p_ref, INTERPRETED_BF16_TOL),
                                     ("h vs the pair's kernels", h, h_pair, 1e-2)):
            if got.shape != want.shape or got.dtype != want.dtype:
                wrong.append(f"{what}: got {got.dtype} {list(got.shape)}, want {want.dtype} {list(want.shape)}")
            elif not rel_err(got, want) <= tol:
                wrong.append(f"{what}: rel err {rel_err(got, want):.3g} > {tol:g}")
        if not torch.equal(p, p_pair):
            wrong.append(f"p differs from the pair's kernels (rel err {rel_err(p, p_pair):.3g})")
        counters = arrivals.current(moe[0].device, mon.ARRIVALS_OWNER)
        if counters is not None and counters.any():
            wrong.append("arrival counters left non-zero")
        if wrong:
            failures.append(f"{name}: {'; '.join(wrong)}")
    return report(failures, n)


if __name__ == "__main__":
    sys.exit(main())
