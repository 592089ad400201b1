"""Run the fused MoE decode op with the "split" down-projection (kernel B') under TRITON_INTERPRET=1 on CPU.

Started in a subprocess by test_moe_decode.py. Per case: the op with designs (up, "split") against the
reference (relative error), launched twice on the same inputs: both outputs bit-identical (the partials
are summed in slot order, never in arrival order) and the arrival counters zero after each launch (a
CUDA graph replays the kernel with no memset). Then with flag_deps (kernel A counts the h columns it stores per
B' K chunk, B' waits per chunk): bit-identical to it off, its counters zero again after the launch (every chunk
fully counted by A and read by all its readers), also with kernel A's shared slot (shared_w13: hs counted too) and
with A's launch from up_launch (column blocks wider than a K chunk, and narrower). Latent cases: kernel C with
latent_prewait bit-identical to it without, and with kernel A's up_prewait too (dense weights: A's rows design, one
and two K steps). Tiny shapes: the interpreter runs every program in Python.
Prints one line per failing case and exits 1 if any failed.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_moe_down_split.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.model_def.ops import mxfp4  # noqa: E402
from k3compile.passes.kernels import arrivals, moe_decode, moe_launch  # noqa: E402
from interpreted import TOL, rel_err, report  # noqa: E402  (this script's folder is on sys.path)

SplitConfig = moe_launch.SplitConfig



def cases():
    """(name, op kwargs, dtype, (block_n, block_k) or None for the op's tile rule)"""
    gen = torch.Generator().manual_seed(7)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    def routing(n, e, k):
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
        ids[:, 0] = 1  # every token hits expert 1
        return ids, torch.rand(n, k, generator=gen)

    # (act, N, E, k, D, I, Do, MXFP4, shared, dtype, tile): k = 3 (not a power of two, so SLOTS = 4 with a
    # shared expert and 3 without), Do = 40 (not a multiple of the block: masked columns in the last group),
    # several K steps (block_k 32 < I); the three shared-expert forms; one case at the op's own tile rule. With a
    # SplitConfig (B''s launch table entry): the next K tile prefetched (I = 96: three K steps), K cut in 3 chunks
    # (one tile each; the 24-wide shared K: one chunk and two empty ones), 2 chunks without prefetch, MXFP4 with 2
    # chunks (prefetch asked for, which MXFP4 ignores)
    grid = [("silu", 1, 6, 3, 64, 64, 40, False, "glu", torch.float32, (16, 32)),
            ("situ", 2, 6, 3, 64, 64, 40, False, "none", torch.float32, (16, 32)),
            ("situ", 2, 8, 2, 64, 32, 64, False, "activated", torch.bfloat16, None),
            ("silu", 2, 6, 3, 64, 64, 40, True, "glu", torch.float32, (16, 32)),
            ("situ", 1, 8, 2, 64, 64, 48, True, "none", torch.bfloat16, (8, 32)),
            ("silu", 1, 6, 3, 64, 96, 40, False, "glu", torch.float32, SplitConfig(16, 32, 4, 1, True)),
            ("situ", 2, 6, 3, 64, 96, 40, False, "activated", torch.float32, SplitConfig(16, 32, 4, 3, True)),
            ("silu", 2, 8, 2, 64, 64, 48, False, "glu", torch.bfloat16, SplitConfig(8, 32, 4, 2, False)),
            ("situ", 2, 6, 3, 64, 96, 40, False, "none", torch.float32, SplitConfig(16, 32, 2, 2, True)),
            ("silu", 1, 6, 3, 64, 64, 40, True, "glu", torch.float32, SplitConfig(16, 32, 4, 2, True))]
    for act, n, e, k, d, i, do, quant, shared, dtype, tile in grid:
        ids, wts = routing(n, e, k)
        w13, w2 = randn(e, 2 * i, d, scale=d ** -0.5), randn(e, do, i, scale=i ** -0.5)
        kw = dict(x=randn(n, d).to(dtype), topk_ids=ids, topk_weights=wts, act=act, beta=4.0, linear_beta=25.0)
        if quant:
            (w13p, w13s), (w2p, w2s) = mxfp4.quantize(w13), mxfp4.quantize(w2)
            kw.update(w13=w13p, w2=w2p, w13_scale=w13s, w2_scale=w2s)
        else:
            kw.update(w13=w13.to(dtype), w2=w2.to(dtype))
        if shared != "none":
            kw.update(shared_w2=randn(do, 24, scale=24 ** -0.5).to(dtype), shared_in=randn(n, 24).to(dtype))
            if shared == "glu":
                kw["shared_up"] = randn(n, 24).to(dtype)
        yield (f"{act} N={n} E={e} k={k} D={d} I={i} Do={do} {'mxfp4' if quant else 'dense'} shared={shared} "
               f"{dtype}"), kw, dtype, tile
    # the latent MoE (K3): B' stores u in fp32 (no shared slot), kernel C adds the norm, up-projection, shared;
    # latent width L = 32 (C's K tile covers the row: latent_prewait's W_up tile before the wait) and L = 64 with
    # 32-wide tiles (two K steps: only the shared expert before the wait)
    for norm, quant, lat in ((True, False, 32), (False, True, 32), (True, False, 64)):
        ids, wts = routing(2, 8, 3)
        w13, w2 = randn(8, 64, lat, scale=lat ** -0.5), randn(8, lat, 32, scale=32 ** -0.5)
        kw = dict(x=randn(2, lat), topk_ids=ids, topk_weights=wts, act="situ", beta=4.0, linear_beta=25.0,
                  latent_up_w=randn(48, lat, scale=lat ** -0.5), latent_eps=1e-5, shared_w2=randn(48, 24, scale=0.2),
                  shared_in=randn(2, 24), shared_up=randn(2, 24))
        if norm:
            kw["latent_norm_w"] = 1 + 0.1 * randn(lat)
        if quant:
            (p13, s13), (p2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
            kw.update(w13=p13, w2=p2, w13_scale=s13, w2_scale=s2)
        else:
            kw.update(w13=w13, w2=w2)
        yield (f"latent L={lat} k=3 norm={norm} {'mxfp4' if quant else 'dense'}", kw, torch.float32,
               SplitConfig(16, 32, 4, 2, True) if norm and lat == 32 else (16, 32))


def main() -> int:
    assert type(moe_decode._expert_down_split_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    failures, n = [], 0
    for name, kw, dtype, tile in cases():
        n += 1
        ref = moe_decode.fused_moe_reference(**{key: v.float() if isinstance(v, torch.Tensor) and v.dtype == dtype
                                                else v for key, v in kw.items()}).to(dtype)
        split = tile if isinstance(tile, SplitConfig) else None
        block_n, block_k = (None, None) if split or tile is None else tile
        up = "tiles" if "w13_scale" in kw else "rows"
        runs = []
        for _ in range(2):  # two launches: the counters must be zero again after the first
            runs.append(moe_decode.fused_moe_triton(**kw, block_n=block_n, block_k=block_k, designs=(up, "split"),
                                                    split=split))
            counters = arrivals.current("cpu", moe_decode.ARRIVALS_OWNER)
            if counters is None or counters.any():
                failures.append(f"{name}: arrival counters not zero after a launch")
        got = runs[0]
        if got.dtype != ref.dtype or got.shape != ref.shape:
            failures.append(f"{name}: got {got.dtype} {list(got.shape)}, want {ref.dtype} {list(ref.shape)}")
            continue
        err = rel_err(got, ref)
        if not err <= TOL[dtype]:
            failures.append(f"{name} tile={tile}: rel err {err:.3g} > {TOL[dtype]:g}")
        if not torch.equal(runs[0], runs[1]):
            failures.append(f"{name}: two launches on the same inputs differ")
        if "latent_up_w" in kw:  # kernel C with its shared expert (and W_up tile) ahead of the wait: the same bits
            pre = moe_decode.fused_moe_triton(**kw, block_n=block_n, block_k=block_k, designs=(up, "split"),
                                              split=split, latent_prewait=True)
            if not torch.equal(pre, runs[0]):
                failures.append(f"{name}: latent_prewait changes the output")
            if up == "rows":  # kernel A's expert and first K step of rows ahead of the wait (one or two K steps)
                both = moe_decode.fused_moe_triton(**kw, block_n=block_n, block_k=block_k, designs=(up, "split"),
                                                   split=split, latent_prewait=True, up_prewait=True)
                if not torch.equal(both, runs[0]):
                    failures.append(f"{name}: up_prewait changes the output")
            continue  # (flag_deps cases below: every form of B' once, the latent tail adds nothing to them)
        flagged = moe_decode.fused_moe_triton(**kw, block_n=block_n, block_k=block_k, designs=(up, "split"),
                                              split=split, flag_deps=True)
        failures += _flag_failures(name, flagged, runs[0])
    for name, kw, split, up_launch in flag_cases():
        n += 1
        off = moe_decode.fused_moe_triton(**kw, split=split, up_launch=up_launch)
        failures += _flag_failures(name, moe_decode.fused_moe_triton(**kw, split=split, up_launch=up_launch,
                                                                     flag_deps=True), off)
        ref = moe_decode.fused_moe_reference(**{key: v for key, v in kw.items() if key != "designs"})
        if not rel_err(off, ref) <= TOL[torch.float32]:
            failures.append(f"{name}: rel err {rel_err(off, ref):.3g} > {TOL[torch.float32]:g}")
    return report(failures, n)


def _flag_failures(name, flagged, off) -> list[str]:
    counters = arrivals.current("cpu", moe_decode.FLAGS_OWNER)
    out = [] if torch.equal(flagged, off) else [f"{name}: flag_deps changes the output"]
    if counters is None or counters.any():
        out.append(f"{name}: flag_deps counters not zero after a launch ({int((counters != 0).sum())} set)")
    return out


def flag_cases():
    """(name, op kwargs, B' launch, A launch) with kernel A's shared slot (shared_w13, Is = 24 != I = 96), SiLU, fp32:
    B''s K in 1 or 3 chunks of 32 (the shared Is: 1 chunk, or 1 of 32 and two empty ones), A's column blocks of 8
    (several per chunk), 64 (one spanning two chunks) and 16 (the rule); the MXFP4 tiles design of A with 2 chunks."""
    gen = torch.Generator().manual_seed(9)
    n, e, k, d, i, do, s = 2, 6, 3, 64, 96, 40, 24
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    kw = dict(x=torch.randn(n, d, generator=gen), topk_ids=ids, topk_weights=torch.rand(n, k, generator=gen),
              w13=torch.randn(e, 2 * i, d, generator=gen) * d ** -0.5,
              w2=torch.randn(e, do, i, generator=gen) * i ** -0.5,
              shared_w2=torch.randn(do, s, generator=gen) * s ** -0.5,
              shared_w13=torch.randn(2 * s, d, generator=gen) * d ** -0.5, act="silu", designs=("rows", "split"))
    for split, up in ((SplitConfig(16, 32, 4, 1, False), (8, 32, 4)), (SplitConfig(16, 32, 4, 3, True), (64, 32, 2)),
                      (SplitConfig(8, 32, 4, 3, False), None)):
        yield f"flag_deps shared slot in A, B' {tuple(split)}, A {up}", kw, split, up
    (w13p, w13s), (w2p, w2s) = mxfp4.quantize(kw["w13"]), mxfp4.quantize(kw["w2"])
    q = dict(kw, w13=w13p, w2=w2p, w13_scale=w13s, w2_scale=w2s, designs=("tiles", "split"))
    yield "flag_deps MXFP4, tiles A (8, 32, 4), B' (16, 32, 4, 2)", q, SplitConfig(16, 32, 4, 2, False), (8, 32, 4)


if __name__ == "__main__":
    sys.exit(main())
