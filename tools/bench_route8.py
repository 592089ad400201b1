"""Norm + router in one kernel (issue 9, pass p07_norm_route; run by tools/gpu_route8.sh).

Per shape (the norm before one MoE layer and its router: Kimi-Linear-48B D=2304, no AttnRes bank, E=256 top-8;
k3-mini-6b D=2048, a 4-row AttnRes bank, E=96 top-8) and batch 1, 2, 4, 8, 16, each arm replayed from a CUDA
graph (kernels.graph_timing.replay_us, 50 calls per replay, median of 5):

  pair      what the engine ran before the pass: P7's attn_res_norm_f32 kernel (PDL on, P7's default) then
            P4's absorbed router kernel on h's fp32 copy with P3's fp32 router weight
  fused     norm_route_triton, default blocks, PDL off / on (bf16 router weight)
  be=N      the fused kernel with BLOCK_E = N (PDL on, default warps); w=N: num_warps = N (default BLOCK_E)

plus the fused kernel's agreement with the pair: h bit-equal (%), ids equal per token (%), weights' max relative
error where the ids agree. Prints rows as they come; writes route8.json and route8.md to OUT (argv[1]).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton

from k3compile.passes.kernels import norm_route, routing
from k3compile.passes.kernels.graph_timing import replay_us
from k3compile.passes.kernels.pdl import pdl_available

SHAPES = {"kimi-linear-48b": (2304, 0, 256, 8, 2.446), "k3-mini-6b": (2048, 4, 96, 8, 1.0)}
BATCHES = (1, 2, 4, 8, 16)
SWEEP_BLOCK_E = (1, 2, 4, 8, 16)
SWEEP_WARPS = (4, 8, 16)
ITERS = 50


def _us(fn) -> float:
    return round(replay_us([fn] * ITERS), 2)


def main(out: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape, (dim, bank_rows, experts, top_k, scaling) in SHAPES.items():
        w_bf16 = (torch.randn(experts, dim, generator=gen, device="cuda") / dim ** 0.5).bfloat16()
        w32 = w_bf16.float()  # P3's folded copy
        bias = 0.01 * torch.randn(experts, generator=gen, device="cuda")
        norm_w = (1 + 0.1 * torch.randn(dim, generator=gen, device="cuda")).bfloat16()
        query = 0.05 * torch.randn(dim, generator=gen, device="cuda") if bank_rows else None
        route = (top_k, True, scaling, 1, 1)
        for batch in BATCHES:
            bank = [torch.randn(batch, dim, generator=gen, device="cuda").bfloat16() for _ in range(bank_rows)]
            x, delta = (torch.randn(batch, dim, generator=gen, device="cuda").bfloat16() for _ in range(2))
            norm = (bank, x, delta, query, norm_w, 1e-5, 1e-6)

            def pair():
                h, p, h32 = torch.ops.k3.attn_res_norm_f32(*norm, True)
                return (h, p, *routing.linear_route_triton(h32, w32, bias, *route))

            def fused(pdl=True, block_e=None, num_warps=None):
                return norm_route.norm_route_triton(*norm, bias, w_bf16, *route, pdl=pdl, block_e=block_e,
                                                    num_warps=num_warps)

            h0, _, w0, ids0 = pair()
            h1, _, w1, ids1 = fused()
            same = (ids1 == ids0).all(-1)
            w_err = ((w1 - w0).abs() / w0.abs()).amax(-1)[same].max().item() if same.any() else float("nan")
            be, nw = norm_route.default_blocks(batch, experts, dim, bank_rows)
            row = dict(shape=shape, batch=batch, bank_rows=bank_rows, pair_us=_us(pair),
                       fused_us=_us(lambda: fused(pdl=False)), fused_pdl_us=_us(fused),
                       default_blocks=dict(block_e=be, num_warps=nw),
                       h_equal_pct=round((h1 == h0).all(-1).float().mean().item() * 100, 1),
                       ids_agree_pct=round(same.float().mean().item() * 100, 1),
                       weights_max_rel_err=float(f"{w_err:.3g}"))
            row["sweep_block_e_us"] = {n: _us(lambda n=n: fused(block_e=n)) for n in SWEEP_BLOCK_E
                                       if n <= experts and n * triton.next_power_of_2(dim) <= norm_route.MAX_TILE}
            row["sweep_warps_us"] = {n: _us(lambda n=n: fused(num_warps=n)) for n in SWEEP_WARPS}
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, pdl_available=pdl_available(0),
                iters_per_replay=ITERS)
    with open(os.path.join(out, "route8.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    lines = [f"# norm + router in one kernel (p07_norm_route), {meta['device']}", "",
             f"µs per call, CUDA-graph replay ({ITERS} calls per replay, median of 5). pair = P7's attn_res_norm_f32 "
             "(PDL) + P4's absorbed router (fp32 W); fused = k3::norm_route's kernel (bf16 W), default blocks. "
             f"PDL available: {meta['pdl_available']}.", "",
             "| shape | batch | pair µs | fused µs | fused+PDL µs | pair/fused+PDL | default BLOCK_E, warps | "
             "best BLOCK_E | best warps | h equal % | ids agree % | weights rel err |",
             "|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        be = min(r["sweep_block_e_us"], key=r["sweep_block_e_us"].get)
        nw = min(r["sweep_warps_us"], key=r["sweep_warps_us"].get)
        lines.append(f"| {r['shape']} | {r['batch']} | {r['pair_us']} | {r['fused_us']} | {r['fused_pdl_us']} | "
                     f"{r['pair_us'] / r['fused_pdl_us']:.2f}x | {r['default_blocks']['block_e']}, "
                     f"{r['default_blocks']['num_warps']} | {be}: {r['sweep_block_e_us'][be]} | "
                     f"{nw}: {r['sweep_warps_us'][nw]} | {r['h_equal_pct']} | {r['ids_agree_pct']} | "
                     f"{r['weights_max_rel_err']} |")
    lines += ["", "Sweeps (µs, PDL on): " + "; ".join(
        f"{r['shape']} b{r['batch']}: " + ", ".join(f"be={n} {us}" for n, us in r["sweep_block_e_us"].items())
        + ", " + ", ".join(f"w={n} {us}" for n, us in r["sweep_warps_us"].items()) for r in rows)]
    with open(os.path.join(out, "route8.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
