"""Microbenchmark of one MoE layer's decode at the Kimi-Linear-48B shape (run by tools/gpu_p06.sh on CUDA).

Arms, each replayed from a CUDA graph (kernels.moe_decode._time_us), random bf16 weights, uniformly
random distinct experts per token:

  unfused   what the P1-P4 engine runs: k3::moe_experts (grouped GEMM on sm90) + the shared expert's
            SiLU-GLU + down GEMM + the add
  fused     k3::fused_moe_decode below the crossover: the two Triton GEMV kernels (shared expert in B)
  grouped   k3::fused_moe_decode above the crossover (crossover = 1): grouped GEMM inside the op
  fused_mxfp4  the Triton kernels reading MXFP4 experts
  k3mini_*  a k3-mini-6b (latent) layer: grouped experts + RMSNorm + up GEMM + SiTU shared expert, vs the op
            with its latent tail (kernel C)

GB/s = bytes of the routed experts the batch actually touches (distinct experts x their w1/w3/w2, in the
arm's storage format) + the shared expert's down projection, divided by the time. Then a sweep of the
GEMV kernels' tiles (block_k x block_n) at batch 1 and 8. Prints a markdown table and writes it with
the raw numbers to OUT (argv[1]).
"""
from __future__ import annotations

import json
import os
import sys

import torch

from k3compile.model_def.config import get_preset
from k3compile.model_def.ops import mxfp4
from k3compile.model_def.ops.moe_math import glu_act, moe_experts_grouped
from k3compile.passes.kernels import moe_decode


def _measure(arm: str, fn, ref: torch.Tensor, batch: int, touched: int, nbytes: float) -> dict:
    us = moe_decode._time_us(fn, iters=50)
    err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
    row = dict(batch=batch, arm=arm, us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), experts_touched=touched,
               mbytes=round(nbytes / 1e6, 2), rel_err_vs_unfused=float(f"{err:.3g}"))
    print(row, flush=True)
    return row


def main(out: str) -> None:
    cfg = get_preset("kimi-linear-48b")
    e, k, d, i = cfg.num_experts, cfg.num_experts_per_token, cfg.hidden_size, cfg.moe_intermediate_size
    s = i * cfg.num_shared_experts
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    w13, w2, sw2 = randn(e, 2 * i, d, scale=d ** -0.5), randn(e, d, i, scale=i ** -0.5), randn(d, s, scale=s ** -0.5)
    w13p, w13s = mxfp4.quantize(w13)
    w2p, w2s = mxfp4.quantize(w2)
    crossover, timings = moe_decode.measure_crossover(w13, w2, shared_w2=sw2, top_k=k)
    print(f"build-time crossover at this shape: {crossover} ({json.dumps(timings)})", flush=True)
    rows = []
    for n in (1, 8, 64):
        x = randn(n, d)
        ids, wts = moe_decode.random_routing(n, e, k, "cuda", seed=n)
        g, u = randn(n, s), randn(n, s)
        touched = int(ids.unique().numel())
        shared_bytes = d * s * 2
        bf16_bytes = touched * 3 * i * d * 2 + shared_bytes
        mxfp4_bytes = touched * 3 * i * d * (0.5 + 1 / 32) + shared_bytes

        def unfused():
            y = moe_experts_grouped(x, ids, wts, w13, w2, "silu", 4.0, 25.0)
            return y + torch.mm(glu_act(g, u, "silu", 4.0, 25.0), sw2.t())

        def fused():
            return moe_decode.fused_moe_decode(x, ids, wts, w13, w2, None, None, g, u, sw2, "silu", 4.0, 25.0, 1 << 30)

        def grouped():
            return moe_decode.fused_moe_decode(x, ids, wts, w13, w2, None, None, g, u, sw2, "silu", 4.0, 25.0, 1)

        def fused_mxfp4():
            return moe_decode.fused_moe_decode(x, ids, wts, w13p, w2p, w13s, w2s, g, u, sw2, "silu", 4.0, 25.0,
                                               1 << 30)

        ref = unfused().float()
        for name, fn, nbytes in (("unfused", unfused, bf16_bytes), ("fused", fused, bf16_bytes),
                                 ("grouped", grouped, bf16_bytes), ("fused_mxfp4", fused_mxfp4, mxfp4_bytes)):
            rows.append(_measure(name, fn, ref, n, touched, nbytes))
    # tile sweep of the GEMV kernels (the op uses block_k=128 and the heuristic block_n): what to tune next
    sweep = []
    for n in (1, 8):
        x = randn(n, d)
        ids, wts = moe_decode.random_routing(n, e, k, "cuda", seed=n)
        g, u = randn(n, s), randn(n, s)
        for block_k in (64, 128, 256):
            for block_n in (8, 16, 32, None):
                us = moe_decode._time_us(lambda: moe_decode.fused_moe_triton(
                    x, ids, wts, w13, w2, None, None, g, u, sw2, "silu", 4.0, 25.0, block_k=block_k,
                    block_n=block_n), iters=50)
                sweep.append(dict(batch=n, block_k=block_k, block_n=block_n or "auto", us=round(us, 2)))
        best = min((r for r in sweep if r["batch"] == n), key=lambda r: r["us"])
        print(f"tile sweep batch {n}: best {best}", flush=True)
    # a K3-style latent layer (k3-mini-6b): experts on the latent, RMSNorm + up-projection + SiTU shared expert
    kcfg = get_preset("k3-mini-6b")
    kd, lat, ki = kcfg.hidden_size, kcfg.latent_size, kcfg.moe_intermediate_size
    ks = ki * kcfg.num_shared_experts
    kw13, kw2 = randn(kcfg.num_experts, 2 * ki, lat, scale=lat ** -0.5), randn(kcfg.num_experts, lat, ki, scale=ki ** -0.5)
    ksw2, up_w, norm_w = randn(kd, ks, scale=ks ** -0.5), randn(kd, lat, scale=lat ** -0.5), randn(lat) + 1
    for n in (1, 8, 64):
        z = randn(n, lat)
        ids, wts = moe_decode.random_routing(n, kcfg.num_experts, kcfg.num_experts_per_token, "cuda", seed=n)
        g, u = randn(n, ks), randn(n, ks)
        touched = int(ids.unique().numel())
        nbytes = touched * 3 * ki * lat * 2 + (kd * ks + kd * lat) * 2

        def k3_unfused():
            r = moe_experts_grouped(z, ids, wts, kw13, kw2, "situ", 4.0, 25.0)
            rf = r.float()
            r = norm_w * (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(r.dtype)
            return torch.mm(r, up_w.t()) + torch.mm(glu_act(g, u, "situ", 4.0, 25.0), ksw2.t())

        def k3_fused():
            return moe_decode.fused_moe_decode(z, ids, wts, kw13, kw2, None, None, g, u, ksw2, "situ", 4.0, 25.0,
                                               1 << 30, up_w, norm_w, 1e-5)

        ref = k3_unfused().float()
        for name, fn in (("k3mini_unfused", k3_unfused), ("k3mini_fused", k3_fused)):
            rows.append(_measure(name, fn, ref, n, touched, nbytes))
    lines = ["| batch | arm | µs / layer | GB/s | experts touched | MB | rel err vs unfused |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['arm']} | {r['us']} | {r['gbps']} | {r['experts_touched']} | {r['mbytes']} | "
              f"{r['rel_err_vs_unfused']} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "p06_moe_bench.md"), "w") as f:
        f.write(f"Kimi-Linear-48B MoE layer (E={e}, k={k}, D={d}, I={i}, shared {s}), "
                f"{torch.cuda.get_device_name()}\n\ncrossover {crossover}: {json.dumps(timings)}\n\n{table}\n")
    with open(os.path.join(out, "p06_moe_bench.json"), "w") as f:
        json.dump({"crossover": crossover, "crossover_timings": timings, "rows": rows, "tile_sweep": sweep}, f,
                  indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
