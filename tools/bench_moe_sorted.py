"""One MoE layer above P6's crossover: the sorted M-tiled experts (passes/kernels/moe_sorted.py) against the grouped
path they replace (torch._grouped_mm + ATen) and the GEMV kernels (issue 9, session 16).

Shapes: one MoE layer of k3-mini-6b (E=96, top-8, latent 1024, I=512, SiTU, latent RMSNorm + up-projection to 2048,
shared expert) and of kimi-linear-48b (E=256, top-8, D=2304, I=1024, SiLU, shared expert), random bf16 weights,
uniformly random routing (moe_decode.random_routing). Every arm is timed from a CUDA graph (graph_timing.replay_us).
Per batch: the whole op (fused = GEMV kernels, grouped = torch path, sorted = grouped_sorted, + finish =
sorted_finish) in µs, and the routed experts alone (experts_grouped / experts_sorted, plus SortedLaunch variants),
with the bytes of the experts the routing hit and the bandwidth that implies; at batch 64 the op with the experts in
MXFP4 (grouped = dequantize all, then the grouped GEMM; sorted = decoded in the kernels). Writes sorted16.md /
sorted16.json to OUT (argv[1]); argv[2]: batches.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from k3compile.model_def.config import get_preset
from k3compile.model_def.ops.moe_math import moe_experts_grouped
from k3compile.passes.kernels import moe_decode, moe_sorted
from k3compile.passes.kernels.graph_timing import replay_us

VARIANTS = {  # SortedLaunch fields: block_m, up_n, up_k, down_n, down_k, num_warps, num_stages
    "m16 n64 k128 w4 s3": moe_sorted.SortedLaunch(),
    "m16 n128 k64 w4 s4": moe_sorted.SortedLaunch(16, 128, 64, 128, 64, 4, 4),
    "m16 n32 k256 w4 s3": moe_sorted.SortedLaunch(16, 32, 256, 32, 256, 4, 3),
    "m16 n64 k128 w8 s4": moe_sorted.SortedLaunch(16, 64, 128, 64, 128, 8, 4),
    "m32 n64 k128 w4 s3": moe_sorted.SortedLaunch(32, 64, 128, 64, 128, 4, 3),
    "m16 n64 k64 w4 s5": moe_sorted.SortedLaunch(16, 64, 64, 64, 64, 4, 5),
}


def layer(name: str):
    cfg = get_preset(name)
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    d = cfg.latent_size or cfg.hidden_size
    act = "situ" if cfg.hidden_act != "silu" else "silu"
    gen = torch.Generator().manual_seed(0)
    dev = "cuda"
    w13 = (torch.randn(e, 2 * inter, d, generator=gen) / d ** 0.5).bfloat16().to(dev)
    w2 = (torch.randn(e, d, inter, generator=gen) / inter ** 0.5).bfloat16().to(dev)
    shared_is = cfg.num_shared_experts * inter
    shared_w2 = (torch.randn(cfg.hidden_size, shared_is, generator=gen) / shared_is ** 0.5).bfloat16().to(dev)
    latent = (None, None)
    if cfg.latent_size:
        latent = ((torch.randn(cfg.hidden_size, d, generator=gen) / d ** 0.5).bfloat16().to(dev),
                  torch.ones(d, dtype=torch.bfloat16, device=dev))
    return cfg, w13, w2, shared_w2, latent, act


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "8,16,32,64,128,256").split(",")]
    os.makedirs(out, exist_ok=True)
    rows, lines = [], ["| model | batch | experts hit | MB | fused us | grouped us | sorted us | sorted + finish us | "
                       "experts grouped | "
                       + " | ".join(f"sorted {v}" for v in VARIANTS) + " |",
                       "|---" * (9 + len(VARIANTS)) + "|"]
    for name in ("k3-mini-6b", "kimi-linear-48b"):
        cfg, w13, w2, shared_w2, latent, act = layer(name)
        k = cfg.num_experts_per_token
        per_expert = (w13[0].numel() + w2[0].numel()) * 2
        for n in batches:
            args = moe_decode.crossover_case(n, w13, w2, None, None, shared_w2, True, k, act, 4.0, 25.0,
                                             torch.bfloat16, *latent, 1e-5)
            x, ids, wts = args[:3]
            hit = int(torch.unique(ids).numel())
            row = {"model": name, "batch": n, "experts_hit": hit, "mb": round(hit * per_expert / 1e6, 1)}
            with torch.no_grad():
                row["fused_us"] = replay_us([lambda: moe_decode.fused_moe_triton(*args)])
                row["grouped_us"] = replay_us([lambda: moe_decode.fused_moe_grouped(*args)])
                row["sorted_us"] = replay_us([lambda: moe_decode.fused_moe_grouped(*args, grouped_sorted=True)])
                row["sorted_finish_us"] = replay_us(
                    [lambda: moe_decode.fused_moe_grouped(*args, grouped_sorted=True, sorted_finish=True)])
                row["experts_grouped_us"] = replay_us(
                    [lambda: moe_experts_grouped(x, ids, wts, w13, w2, act, 4.0, 25.0)])
                for v, launch in VARIANTS.items():
                    try:
                        row[f"sorted {v}"] = replay_us(
                            [lambda: moe_sorted.moe_experts_sorted(x, ids, wts, w13, w2, act, 4.0, 25.0, launch)])
                    except Exception as exc:  # a tile that does not fit shared memory: say so, go on
                        row[f"sorted {v}"] = f"failed: {type(exc).__name__}"
            if n == 64:  # the same layer in MXFP4 (K3's expert format): the grouped path dequantizes every expert
                from k3compile.model_def.ops import mxfp4
                (q13, s13), (q2, s2) = mxfp4.quantize(w13.float()), mxfp4.quantize(w2.float())
                q_args = (x, ids, wts, q13, q2, s13, s2, *args[7:])
                with torch.no_grad():
                    row["mxfp4_grouped_us"] = replay_us([lambda: moe_decode.fused_moe_grouped(*q_args)])
                    row["mxfp4_sorted_us"] = replay_us(
                        [lambda: moe_decode.fused_moe_grouped(*q_args, grouped_sorted=True)])
                del q13, q2, s13, s2
                print(f"{name} batch 64 MXFP4: grouped (dequantize all) {row['mxfp4_grouped_us']:.1f} us, "
                      f"sorted {row['mxfp4_sorted_us']:.1f} us", flush=True)
            rows.append(row)
            cells = [name, n, hit, row["mb"]] + [row[c] for c in ("fused_us", "grouped_us", "sorted_us",
                                                                  "sorted_finish_us", "experts_grouped_us")]
            cells += [row[f"sorted {v}"] for v in VARIANTS]
            lines.append("| " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells) + " |")
            print(lines[-1], flush=True)
    best = [min((r[f"sorted {v}"], v) for v in VARIANTS if isinstance(r[f"sorted {v}"], float)) for r in rows]
    lines.append("")
    lines += [f"- {r['model']} batch {r['batch']}: fastest sorted launch {v} {t:.1f} us = "
              f"{r['mb'] / t:.2f} TB/s over the hit experts' bytes" for r, (t, v) in zip(rows, best)]
    open(os.path.join(out, "sorted16.md"), "w").write("\n".join(lines) + "\n")
    json.dump(rows, open(os.path.join(out, "sorted16.json"), "w"), indent=1)
    print("\n".join(lines[-len(rows):]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
