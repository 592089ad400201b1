"""Run the fused MoE decode Triton kernels under TRITON_INTERPRET=1 on CPU and compare with the reference.

Started in a subprocess by test_moe_decode.py (TRITON_INTERPRET is read when the kernels are
decorated, i.e. when moe_decode.py is first imported). Prints one line per failing case and exits 1
if any failed.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_moe_decode.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.model_def.ops import mxfp4  # noqa: E402
from k3compile.passes.kernels import moe_decode, moe_launch  # noqa: E402
from interpreted import TOL, rel_err, report  # noqa: E402  (this script's folder is on sys.path)



def cases():
    """(name, kwargs for the op, dtype)"""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    def routing(n, e, k, repeat=False):
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
        if repeat:  # every token hits expert 1 (and token 0's experts again in token 1)
            ids[:, 0] = 1
            if n > 1:
                ids[1] = ids[0]
        return ids, torch.rand(n, k, generator=gen)

    # (act, N, E, k, D, I, Do, MXFP4, shared, dtype): both activations, both weight formats, the three
    # shared-expert forms, fp32 and bf16, a width that is not a multiple of the block (D=96, Do=40), k=3 (not a
    # power of two); batches of 1 and 2 (2 with repeated experts): the interpreter's cost grows with the batch
    grid = [("silu", 1, 8, 2, 64, 32, 64, False, "glu", torch.float32),
            ("situ", 2, 8, 2, 64, 32, 64, False, "glu", torch.float32),
            ("silu", 2, 8, 2, 64, 32, 64, True, "none", torch.float32),
            ("situ", 2, 6, 3, 96, 64, 40, True, "activated", torch.float32),
            ("situ", 2, 8, 2, 64, 32, 64, True, "glu", torch.bfloat16),
            ("silu", 2, 6, 3, 96, 48, 40, False, "none", torch.bfloat16)]
    for act, n, e, k, d, i, do, quant, shared, dtype in grid:
        ids, wts = routing(n, e, k, repeat=n > 1)
        w13, w2 = randn(e, 2 * i, d, scale=d ** -0.5), randn(e, do, i, scale=i ** -0.5)
        kw = dict(x=randn(n, d).to(dtype), topk_ids=ids, topk_weights=wts)
        if quant:
            w13p, w13s = mxfp4.quantize(w13)
            w2p, w2s = mxfp4.quantize(w2)
            kw.update(w13=w13p, w2=w2p, w13_scale=w13s, w2_scale=w2s)
        else:
            kw.update(w13=w13.to(dtype), w2=w2.to(dtype))
        if shared != "none":
            s = 24
            kw.update(shared_w2=randn(do, s, scale=s ** -0.5).to(dtype), shared_in=randn(n, s).to(dtype))
            if shared == "glu":
                kw["shared_up"] = randn(n, s).to(dtype)
        kw.update(act=act, beta=4.0, linear_beta=25.0)
        name = f"{act} N={n} E={e} k={k} D={d} I={i} Do={do} {'mxfp4' if quant else 'dense'} shared={shared} {dtype}"
        yield name, kw, dtype
    # the latent MoE (K3): RMSNorm + up-projection, the shared expert on the output side; no norm; MXFP4
    for n, norm, quant, dtype in ((3, True, False, torch.float32), (2, False, True, torch.float32),
                                  (3, True, True, torch.bfloat16)):
        ids, wts = routing(n, 8, 2, repeat=True)
        w13, w2 = randn(8, 64, 32, scale=32 ** -0.5), randn(8, 32, 32, scale=32 ** -0.5)
        kw = dict(x=randn(n, 32).to(dtype), topk_ids=ids, topk_weights=wts, act="situ", beta=4.0, linear_beta=25.0,
                  latent_up_w=randn(48, 32, scale=32 ** -0.5).to(dtype), latent_eps=1e-5,
                  shared_w2=randn(48, 24, scale=24 ** -0.5).to(dtype), shared_in=randn(n, 24).to(dtype),
                  shared_up=randn(n, 24).to(dtype))
        if norm:
            kw["latent_norm_w"] = (1 + 0.1 * randn(32)).to(dtype)
        if quant:
            (p13, s13), (p2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
            kw.update(w13=p13, w2=p2, w13_scale=s13, w2_scale=s2)
        else:
            kw.update(w13=w13.to(dtype), w2=w2.to(dtype))
        yield f"latent N={n} norm={norm} {'mxfp4' if quant else 'dense'} {dtype}", kw, dtype
    # a strided x (a column block of a merged GEMM's output), int32 ids, block_k smaller than the width
    wide = randn(4, 100)
    ids, wts = routing(4, 8, 2)
    yield "strided x, int32 ids", dict(x=wide[:, 10:74], topk_ids=ids.int(), topk_weights=wts,
                                       w13=randn(8, 64, 64, scale=0.125), w2=randn(8, 64, 32, scale=0.17),
                                       act="situ", beta=4.0, linear_beta=25.0), torch.float32


def main() -> int:
    assert type(moe_decode._expert_up_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    failures, n = [], 0
    all_cases = list(cases())
    first_of_kind: dict[tuple, str] = {}  # (MXFP4?, latent?) -> the first case's name
    for name, kw, _ in all_cases:
        first_of_kind.setdefault(("w13_scale" in kw, "latent_up_w" in kw), name)
    for name, kw, dtype in all_cases:
        n += 1
        # the kernels accumulate in fp32 with no bf16 rounding in between: compare bf16 runs with the
        # reference on the same inputs upcast to fp32 (the bf16 reference rounds 3-4 times on the way)
        ref = moe_decode.fused_moe_reference(**{key: v.float() if isinstance(v, torch.Tensor) and v.dtype == dtype
                                                and dtype != torch.float32 else v for key, v in kw.items()})
        ref = ref.to(dtype)
        # designs None: kernel_designs' choice for this batch; dense weights also run every (up, down) pair of
        # designs, at the smallest tile (several K steps and masked rows: the cheapest run that covers them)
        pairs = [] if "w13_scale" in kw else [(up, down) for up in moe_launch.DESIGNS for down in moe_launch.DESIGNS]
        # the smallest tile with every design pair (several K steps, masked rows) on every case; a middle tile
        # and the op's own tile rule (None) on the first case of each kind, and None on every dense case: the
        # interpreter runs each program in Python, and MXFP4 at the op's larger tiles costs 10-45 s a run
        first = name in first_of_kind.values()
        tiles = ((32, 16),) + (((64, 32),) if first else ()) + (((None, None),) if first or "w13_scale" not in kw else ())
        for block_k, block_n in tiles:
            for design in [None] + (pairs if block_k == 32 else []):
                got = moe_decode.fused_moe_triton(**kw, block_k=block_k, block_n=block_n, designs=design)
                if got.dtype != ref.dtype or got.shape != ref.shape:
                    failures.append(f"{name}: got {got.dtype} {list(got.shape)}, want {ref.dtype} {list(ref.shape)}")
                    continue
                err = rel_err(got, ref)
                if not err <= TOL[dtype]:
                    failures.append(f"{name} block_k={block_k} block_n={block_n} designs={design}: rel err "
                                    f"{err:.3g} > {TOL[dtype]:g}")
    return report(failures, n)


if __name__ == "__main__":
    sys.exit(main())
