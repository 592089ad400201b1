"""Run the sorted fused-MoE kernels (passes/kernels/moe_sorted.py) under TRITON_INTERPRET=1 on CPU: the align kernel
against its torch contract (exact: the same stable order), the whole path against moe_experts_loop (the grouped
path's exact reference) in fp32 (1e-5) and bf16 (1e-2), SiLU and SiTU, shapes whose every tile edge is ragged, experts
with no pair and experts with several blocks. Started in a subprocess by test_moe_sorted.py; prints one line per
failing case and exits 1 if any failed."""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_moe_sorted.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.model_def.ops import mxfp4  # noqa: E402
from k3compile.model_def.ops.moe_math import moe_experts_loop  # noqa: E402
from k3compile.passes.kernels import moe_sorted  # noqa: E402
from interpreted import TOL, rel_err, run_cases  # noqa: E402  (this folder is sys.path[0] when run as a script)

GEN = torch.Generator().manual_seed(0)
SMALL = moe_sorted.SortedLaunch(block_m=16, up_n=16, up_k=16, down_n=32, down_k=16, num_warps=4, num_stages=1)


def routing(n, k, e, skewed=False):
    """Distinct experts per token (uniform, or most pairs on expert 0 and 1 so they span several blocks)."""
    scores = torch.rand(n, e, generator=GEN)
    if skewed:
        scores[:, :2] += 10
    ids = scores.argsort(-1, descending=True)[:, :k]
    wts = torch.rand(n, k, generator=GEN)
    return ids, wts / wts.sum(-1, keepdim=True)


def align_case(n, k, e, block_m, skewed=False):
    ids, _ = routing(n, k, e, skewed)
    got = moe_sorted.align(ids, e, block_m)
    want = moe_sorted.align_reference(ids, e, block_m)
    same = all(torch.equal(g, w) for g, w in zip(got, want))
    return (0.0 if same else float("inf")), 0.0


def experts_case(n, k, e, d, inter, do, act, dtype, skewed=False, launch=SMALL):
    ids, wts = routing(n, k, e, skewed)
    x = torch.randn(n, d, generator=GEN).to(dtype)
    w13 = (torch.randn(e, 2 * inter, d, generator=GEN) / d ** 0.5).to(dtype)
    w2 = (torch.randn(e, do, inter, generator=GEN) / inter ** 0.5).to(dtype)
    got = moe_sorted.moe_experts_sorted(x, ids, wts, w13, w2, act, 4.0, 25.0, launch=launch)
    # the reference in fp32 (one rounding at the end): the kernels accumulate in fp32 and round h once
    want = moe_experts_loop(x.float(), ids, wts, w13.float(), w2.float(), act, 4.0, 25.0)
    if got.shape != want.shape or got.dtype != dtype:
        return float("inf"), 0.0
    return rel_err(got, want), 2 * TOL[dtype]


def mxfp4_case(n, k, e, d, inter, do, act, dtype, launch=SMALL._replace(up_k=32, down_k=32)):
    """MXFP4 experts (mxfp4.quantize's codes, scales spread over 2^-3..2^3 so that every group's exponent differs)
    against the loop on their exact dequantization."""
    ids, wts = routing(n, k, e)
    x = torch.randn(n, d, generator=GEN).to(dtype)
    w13 = torch.randn(e, 2 * inter, d, generator=GEN) * 2.0 ** torch.randint(-3, 4, (e, 2 * inter, d // 32),
                                                                           generator=GEN).repeat_interleave(32, -1)
    w2 = torch.randn(e, do, inter, generator=GEN) * 2.0 ** torch.randint(-3, 4, (e, do, inter // 32),
                                                                       generator=GEN).repeat_interleave(32, -1)
    (q13, s13), (q2, s2) = mxfp4.quantize(w13 / d ** 0.5), mxfp4.quantize(w2 / inter ** 0.5)
    got = moe_sorted.moe_experts_sorted(x, ids, wts, q13, q2, act, 4.0, 25.0, launch=launch, w13_scale=s13,
                                        w2_scale=s2)
    want = moe_experts_loop(x.float(), ids, wts, mxfp4.dequantize(q13, s13), mxfp4.dequantize(q2, s2), act, 4.0, 25.0)
    if got.shape != want.shape or got.dtype != dtype:
        return float("inf"), 0.0
    return rel_err(got, want), 2 * TOL[dtype]


def finish_case(n, k, e, d, inter, do, dtype, norm):
    """finish=True: the finish kernel's sum (and K3's latent RMSNorm with model_def's roundings) against the loop's
    fp32 result, summed, rounded and normalized the same way."""
    ids, wts = routing(n, k, e)
    x = torch.randn(n, d, generator=GEN).to(dtype)
    w13 = (torch.randn(e, 2 * inter, d, generator=GEN) / d ** 0.5).to(dtype)
    w2 = (torch.randn(e, do, inter, generator=GEN) / inter ** 0.5).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(do, generator=GEN)).to(dtype) if norm else None
    got = moe_sorted.moe_experts_sorted(x, ids, wts, w13, w2, "situ", 4.0, 25.0, launch=SMALL, finish=True,
                                        norm_w=norm_w, eps=1e-6)
    want = moe_experts_loop(x.float(), ids, wts, w13.float(), w2.float(), "situ", 4.0, 25.0).to(dtype)
    if norm:
        uf = want.float()
        want = norm_w * (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    if got.shape != want.shape or got.dtype != dtype:
        return float("inf"), 0.0
    return rel_err(got, want), 2 * TOL[dtype]


def cases():
    for n, k, e, m in ((1, 2, 8, 16), (5, 3, 4, 16), (7, 2, 40, 16), (40, 2, 3, 16), (33, 4, 9, 32)):
        yield f"align n {n} k {k} E {e} M {m}", lambda a=(n, k, e, m): align_case(*a)
    yield "align skewed 50 x 4 of 12 experts", lambda: align_case(50, 4, 12, 16, skewed=True)
    yield "align 9 x 16 of K3's 896 experts (chunks of 8)", lambda: align_case(9, 16, 896, 16)
    for act in ("situ", "silu"):
        for dtype in (torch.float32, torch.bfloat16):
            yield f"{act} {dtype} 1 token", lambda a=act, t=dtype: experts_case(1, 2, 8, 40, 24, 36, a, t)
            yield f"{act} {dtype} 9 tokens", lambda a=act, t=dtype: experts_case(9, 3, 6, 40, 24, 36, a, t)
            yield f"{act} {dtype} skewed 24 tokens", lambda a=act, t=dtype: experts_case(24, 2, 5, 32, 16, 48, a, t,
                                                                                         skewed=True)
    for act, dtype in (("situ", torch.bfloat16), ("silu", torch.float32)):
        yield f"mxfp4 {act} {dtype} 9 tokens", lambda a=act, t=dtype: mxfp4_case(9, 3, 6, 96, 64, 40, a, t)
        yield f"mxfp4 {act} {dtype} K step 64", lambda a=act, t=dtype: mxfp4_case(
            5, 2, 4, 128, 96, 64, a, t, launch=SMALL._replace(up_k=64, down_k=64))
    for dtype in (torch.float32, torch.bfloat16):
        for norm in (False, True):
            yield f"finish {dtype} norm {norm}", lambda t=dtype, m=norm: finish_case(7, 3, 5, 32, 16, 40, t, m)
    yield "bf16 default launch", lambda: experts_case(6, 2, 4, 128, 64, 64, "situ", torch.bfloat16,
                                                      launch=moe_sorted.SortedLaunch(num_stages=1))


def main() -> int:
    assert type(moe_sorted._expert_sorted_up_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    return run_cases(cases())


if __name__ == "__main__":
    sys.exit(main())
