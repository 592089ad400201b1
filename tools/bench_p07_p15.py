"""Microbenchmarks of P7 and P15 on one GPU: fused vs unfused, µs per layer, CUDA-graph replays.

Shapes: Kimi-Linear-48B (D 2304, 32 MLA heads, latent 512 + 64, page 16, context 512) at batch
1/8/64; the AttnRes read at the k3-mini-6b shape (D 2048, bank of 4 and 8 rows). "unfused" is the
ATen composition the graph had before the pass (what eager / the engine without the pass launches);
"fused" the k3 op. Each figure: 20 calls captured in one CUDA graph, replayed, median of 5 timings.
Writes a markdown table to stdout and JSON to the path given as argv[1].
"""
import json
import sys

import torch

from k3compile.model_def.layers.attn_res import attn_res_read
from k3compile.model_def.ops import library  # noqa: F401
from k3compile.passes.kernels import attn_res_norm as arn  # noqa: F401
from k3compile.passes.kernels import mla_decode as mla  # noqa: F401

CALLS, REPS = 20, 5
dev, bf16 = "cuda", torch.bfloat16


def timed(fn) -> float:
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / (10 * CALLS))
    return sorted(times)[len(times) // 2]


def rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def p7_cases(batch):
    out = {}
    for d, bank_rows, label in ((2304, 0, "add+RMSNorm D2304 (48B)"), (2048, 4, "AttnRes bank 4 + norm D2048"),
                                (2048, 8, "AttnRes bank 8 + norm D2048")):
        bank = [torch.randn(batch, d, device=dev, dtype=bf16) for _ in range(bank_rows)]
        x, delta = torch.randn(batch, d, device=dev, dtype=bf16), torch.randn(batch, d, device=dev, dtype=bf16)
        proj, gamma = torch.randn(1, d, device=dev, dtype=bf16), torch.randn(d, device=dev, dtype=bf16)
        w = torch.randn(d, device=dev, dtype=bf16)
        query = proj.float().view(-1) * gamma.float()

        def unfused():
            p = x + delta
            return rms(attn_res_read(bank + [p], proj, gamma, 1e-5) if bank else p, w, 1e-5)

        def fused():
            return torch.ops.k3.attn_res_norm(bank, x, delta, query if bank else None, w, 1e-5, 1e-5)
        out[label] = (timed(unfused), timed(fused))
    return out


def p15_cases(batch, context=512, page=16, heads=32, r=512, rope=64, q_dim=32 * 192):
    max_pages = context // page
    kv = torch.randn(batch * max_pages + 1, 7, page, r + rope, device=dev, dtype=bf16)
    table = (torch.randperm(batch * max_pages) + 1).view(batch, max_pages).int().to(dev)
    seq = torch.full((batch,), context, dtype=torch.int32, device=dev)
    loc = (table[:, -1].long() * page + page - 1)
    merged = torch.randn(batch, q_dim + r + rope, device=dev, dtype=bf16)
    ckv, w = merged[:, q_dim:], torch.randn(r, device=dev, dtype=bf16)
    q_nope = torch.randn(batch, heads, r, device=dev, dtype=bf16)
    q = torch.randn(batch, heads, 128 + rope, device=dev, dtype=bf16)
    q_rope = q[..., 128:]
    scale = 192 ** -0.5

    def prologue_unfused():
        rows = torch.cat([rms(ckv[:, :r], w, 1e-6), ckv[:, r:]], -1)
        torch.ops.k3.kv_write(rows, kv, 3, loc)

    def prologue_fused():
        torch.ops.k3.mla_decode_prologue(ckv, w, 1e-6, kv, 3, loc, None, None, 0.0)

    def attn_unfused():
        return torch.ops.k3.mla_decode(torch.cat([q_nope, q_rope], -1), kv, 3, table, seq, scale, r)

    def attn_fused(pdl):
        return lambda: torch.ops.k3.mla_decode_fused(q_nope, q_rope, kv, 3, table, seq, scale, pdl)
    out = {"MLA prologue (kv norm + KV write)": (timed(prologue_unfused), timed(prologue_fused)),
           "MLA attention ctx 512": (timed(attn_unfused), timed(attn_fused(False)))}
    if torch.cuda.get_device_capability()[0] >= 9:
        out["MLA attention ctx 512, PDL"] = (out["MLA attention ctx 512"][0], timed(attn_fused(True)))
    # a small sweep of the split kernel's tiles (defaults: block_h 16, block_n 32, 4 warps, splits from shapes)
    for bh, bn, nw, splits in ((32, 32, 8, None), (16, 64, 4, None), (16, 32, 4, 1), (16, 32, 8, None)):
        def swept(bh=bh, bn=bn, nw=nw, splits=splits):
            return mla.decode_triton(q_nope, q_rope, kv, 3, table, seq, scale, False, splits, bh, bn, nw)
        try:
            out[f"MLA attention ctx 512, block_h {bh} block_n {bn} warps {nw} splits {splits or 'auto'}"] = (
                out["MLA attention ctx 512"][0], timed(swept))
        except Exception as e:  # a tile that does not fit (registers / shared memory): say so, keep going
            print(f"sweep block_h {bh} block_n {bn} warps {nw}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
    return out


def main():
    rows = []
    for batch in (1, 8, 64):
        for name, (a, b) in {**p7_cases(batch), **p15_cases(batch)}.items():
            rows.append({"case": name, "batch": batch, "unfused_us": round(a, 2), "fused_us": round(b, 2)})
    print("| case | batch | unfused µs | fused µs | speed-up |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['batch']} | {r['unfused_us']} | {r['fused_us']} | "
              f"{r['unfused_us'] / r['fused_us']:.2f}x |")
    if len(sys.argv) > 1:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
