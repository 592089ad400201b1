"""Router GEMM absorbed into fused_route (issue 9, P4's absorb_router_max_tokens; run by tools/gpu_route7.sh).

Per shape (one MoE layer's router: Kimi-Linear-48B E=256 D=2304 top-8; k3-mini-6b E=96 D=2048 top-8; fp32
router weight as P3 folds it; x32 = the fp32 copy of the bf16 hidden state, which P4 leaves in the graph and
P7's norm kernel writes) and batch 1, 2, 4, 8, 16, 64, each arm replayed from a CUDA
graph (kernels.moe_decode._time_us, 50 calls per replay):

  split     what P4 without absorbing leaves: cuBLAS mm(x32, W32^T) + the routing kernel
  absorbed  routing.linear_route_triton with its default blocks (default_linear_route_blocks): one launch
  be=N      the absorbed kernel with BLOCK_E = N experts per program (the sweep that sets the defaults)

plus the absorbed routing's agreement with the split one (same ids per token, %) and its weights' max relative
error. Prints rows as they come; writes route7.json and route7.md (the table) to OUT (argv[1]).
"""
from __future__ import annotations

import json
import os
import sys

import torch

from k3compile.passes.kernels import moe_decode, routing

SHAPES = {"kimi-linear-48b": (256, 2304, 8, 2.446), "k3-mini-6b": (96, 2048, 8, 1.0)}
BATCHES = (1, 2, 4, 8, 16, 64)
SWEEP_BLOCK_E = (1, 2, 4, 8, 16)


def main(out: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape, (experts, hidden, top_k, scaling) in SHAPES.items():
        w32 = torch.randn(experts, hidden, generator=gen, device="cuda") / hidden ** 0.5
        bias = 0.01 * torch.randn(experts, generator=gen, device="cuda")
        for batch in BATCHES:
            x = torch.randn(batch, hidden, generator=gen, device="cuda").bfloat16()
            x32 = x.float()
            args = (bias, top_k, True, scaling, 1, 1)

            def split():
                return routing.route_triton(torch.mm(x32, w32.t()), *args)

            def absorbed(block_e=None):
                return routing.linear_route_triton(x32, w32, *args, block_e=block_e)

            ref_w, ref_ids = split()
            got_w, got_ids = absorbed()
            agree = (got_ids == ref_ids).all(-1).float().mean().item() * 100
            same = (got_ids == ref_ids).all(-1)
            w_err = ((got_w - ref_w).abs() / ref_w.abs()).amax(-1)[same].max().item() if same.any() else float("nan")
            be, bd, nw = routing.default_linear_route_blocks(batch, experts, hidden)
            row = dict(shape=shape, batch=batch, split_us=round(moe_decode._time_us(split, iters=50), 2),
                       absorbed_us=round(moe_decode._time_us(absorbed, iters=50), 2),
                       default_blocks=dict(block_e=be, block_d=bd, num_warps=nw),
                       ids_agree_pct=round(agree, 1), weights_max_rel_err=float(f"{w_err:.3g}"))
            row["sweep_us"] = {n: round(moe_decode._time_us(lambda n=n: absorbed(n), iters=50), 2)
                               for n in SWEEP_BLOCK_E if n <= experts}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(out, "route7.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    lines = [f"# router GEMM absorbed into fused_route, {torch.cuda.get_device_name()}", "",
             "µs per call, CUDA-graph replay (50 calls per replay). split = cuBLAS mm(x32, W32^T) + routing kernel; "
             "absorbed = one kernel (default blocks); be=N: BLOCK_E sweep.", "",
             "| shape | batch | split µs | absorbed µs | split/absorbed | default BLOCK_E | best sweep | "
             "ids agree % | weights rel err |", "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        best = min(r["sweep_us"], key=r["sweep_us"].get)
        lines.append(f"| {r['shape']} | {r['batch']} | {r['split_us']} | {r['absorbed_us']} | "
                     f"{r['split_us'] / r['absorbed_us']:.2f}x | {r['default_blocks']['block_e']} | "
                     f"be={best}: {r['sweep_us'][best]} | {r['ids_agree_pct']} | {r['weights_max_rel_err']} |")
    lines += ["", "Sweep (µs): " + "; ".join(f"{r['shape']} b{r['batch']}: " +
                                             ", ".join(f"be={n} {us}" for n, us in r["sweep_us"].items())
                                             for r in rows)]
    with open(os.path.join(out, "route7.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
