"""Run the fused MoE decode op with launches taken from its per-shape tables under TRITON_INTERPRET=1 on CPU.

Started in a subprocess by test_moe_launch_tables.py. Per case: ROWS_TUNED (kernel A's "rows" launch, and kernel
B's "rows" design), SPLIT_TUNED (kernel B') and LATENT_TUNED (kernel C) entries set for the case's shape, then the op
with no launch argument against the reference (relative error). Latent MoE cases (kernel C: norm, up-projection,
shared expert with and without its GLU) and one full-width case with the "rows" down-projection. Tiny shapes: the
interpreter runs every program in Python. Prints one line per failing case and exits 1 if any failed.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_moe_launch_tables.py: run with TRITON_INTERPRET=1 in the environment")

import torch  # noqa: E402

from k3compile.passes.kernels import moe_decode, moe_launch  # noqa: E402
from interpreted import TOL, rel_err, report  # noqa: E402  (this script's folder is on sys.path)

SplitConfig, LatentConfig = moe_launch.SplitConfig, moe_launch.LatentConfig


def cases():
    """(name, op kwargs, designs, {table name: {key: launch}})"""
    gen = torch.Generator().manual_seed(11)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    # latent: N tokens, E experts, top-k, latent L = 64, I = 32, output D = 80 (not a multiple of C's block: masked
    # columns), shared width 48 (C's BLOCK_KS 32 < 48: two shared K steps, the second masked); A's BLOCK_K 32 < L
    for n, k, norm, glu, rows, split, latent in (
            (1, 3, True, True, (8, 32, 2), SplitConfig(16, 32, 4, 2, True), LatentConfig(16, 32, 32, 2)),
            (2, 2, False, False, (4, 64, 4), SplitConfig(8, 64, 2), LatentConfig(32, 64, 32, 4)),
            (2, 3, True, False, (16, 32, 4), SplitConfig(32, 32, 4, 1, True), LatentConfig(4, 32, 64, 1))):
        e, lat, i, d, s = 6, 64, 32, 80, 48
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
        kw = dict(x=randn(n, lat), topk_ids=ids, topk_weights=torch.rand(n, k, generator=gen),
                  w13=randn(e, 2 * i, lat, scale=lat ** -0.5), w2=randn(e, lat, i, scale=i ** -0.5), act="situ",
                  beta=4.0, linear_beta=25.0, latent_up_w=randn(d, lat, scale=lat ** -0.5), latent_eps=1e-5,
                  shared_w2=randn(d, s, scale=s ** -0.5), shared_in=randn(n, s))
        if norm:
            kw["latent_norm_w"] = 1 + 0.1 * randn(lat)
        if glu:
            kw["shared_up"] = randn(n, s)
        tables = {"ROWS_TUNED": {("up", n * k, i, lat): rows}, "SPLIT_TUNED": {(n * k, lat, i, False): split},
                  "LATENT_TUNED": {(n, d, lat, s): latent}}
        yield (f"latent N={n} k={k} norm={norm} glu={glu} A {rows} B' {tuple(split)} C {tuple(latent)}", kw,
               ("rows", "split"), tables)
    # full width, the "rows" down-projection from ROWS_TUNED ("down", tokens, Do, I), shared expert in kernel B
    n, k, e, dd, i, s = 2, 3, 6, 64, 32, 24
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    kw = dict(x=randn(n, dd), topk_ids=ids, topk_weights=torch.rand(n, k, generator=gen),
              w13=randn(e, 2 * i, dd, scale=dd ** -0.5), w2=randn(e, dd, i, scale=i ** -0.5), act="silu", beta=4.0,
              linear_beta=25.0, shared_w2=randn(dd, s, scale=s ** -0.5), shared_in=randn(n, s), shared_up=randn(n, s))
    tables = {"ROWS_TUNED": {("up", n * k, i, dd): (16, 32, 2), ("down", n, dd, i): (8, 32, 4)}}
    yield "full width, rows down A (16, 32, 2) B (8, 32, 4)", kw, ("rows", "rows"), tables


def main() -> int:
    assert type(moe_decode._latent_out_kernel).__name__ == "InterpretedFunction", "interpreter not active"
    failures, n = [], 0
    for name, kw, designs, tables in cases():
        n += 1
        ref = moe_decode.fused_moe_reference(**kw)
        for table, entries in tables.items():
            getattr(moe_launch, table).update(entries)
        try:
            got = moe_decode.fused_moe_triton(**kw, designs=designs)
        finally:
            for table, entries in tables.items():
                for key in entries:
                    getattr(moe_launch, table).pop(key)
        if got.shape != ref.shape:
            failures.append(f"{name}: got {list(got.shape)}, want {list(ref.shape)}")
            continue
        err = rel_err(got, ref)
        if not err <= TOL[torch.float32]:
            failures.append(f"{name}: rel err {err:.3g} > {TOL[torch.float32]:g}")
    return report(failures, n)


if __name__ == "__main__":
    sys.exit(main())
