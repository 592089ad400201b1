"""Decode GEMV shapes of the 48B and k3-mini-6b steps: cuBLAS vs each Triton GEMV candidate P8 measures.

    python3 tools/bench_gemv.py [--json OUT]      (CUDA; ~1 min)

Prints, per (N, K) and M, the microseconds of cuBLAS and of each candidate (block_n x block_k x split_k x
design; design 0 = dot, 1 = rows), with the bandwidth of the best, as % of a same-run copy's. P8 makes
the same measurement at build (passes/p08_small_m_gemm.py `_measure`), so this is what it will choose from."""
import argparse
import json

import torch

from k3compile.passes.p08_small_m_gemm import _measure

SHAPES = {  # (N, K): what the GEMM is
    (2304, 4096): "48B KDA o_proj",
    (12672, 2304): "48B KDA merged in-proj (approx.)",
    (2048, 2304): "48B shared expert gate/up",
    (2304, 1024): "48B shared expert down",
    (2304, 9216): "48B dense MLP down",
    (163840, 2304): "48B lm_head",
}


def copy_bandwidth() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        b.copy_(a)
    e.record()
    e.synchronize()
    return 2 * a.numel() * 20 / (s.elapsed_time(e) * 1e-3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--buckets", default="1,2,4,8")
    a = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    buckets = [int(b) for b in a.buckets.split(",")]
    out = {}
    for (n, k), what in SHAPES.items():
        w = (0.02 * torch.randn(n, k, device="cuda")).bfloat16()
        t = _measure(w, buckets, 20.0)
        out[f"{n}x{k}"] = {"what": what, "us": {m: {"cublas": r["cublas_us"],
                                                    **{"x".join(map(str, c)): v for c, v in r["gemv_us"].items()}}
                                               for m, r in t.items()}}
        for m, r in t.items():
            best_cfg, best = min(r["gemv_us"].items(), key=lambda kv: kv[1])
            byts = 2 * n * k
            print(f"{what:34s} N={n:6d} K={k:5d} M={m:2d}  cublas {r['cublas_us']:7.2f} us "
                  f"({byts / r['cublas_us'] / 1e3 / (bw / 1e9) * 100:5.1f}%)  best triton {best:7.2f} us "
                  f"({byts / best / 1e3 / (bw / 1e9) * 100:5.1f}%) {best_cfg}  | "
                  + " ".join(f"{'x'.join(map(str, c))}={v:.1f}" for c, v in sorted(r["gemv_us"].items())))
        del w
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"copy_gbs": bw / 1e9, "shapes": out}, f, indent=1)


if __name__ == "__main__":
    main()
