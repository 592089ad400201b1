"""Microbenchmark: programmatic dependent launch (PDL) on vs off across a short chain of the step's kernels.

Per layer, as in a Kimi-Linear-48B KDA layer at decode: P7's attn_res_norm -> a cuBLAS GEMM (the input
projection) -> P5's fused KDA decode -> a cuBLAS GEMM (o_proj); and the same without the GEMMs (our
Triton kernels back to back: the most PDL can overlap). `--layers` layers captured in one CUDA graph,
L2 flushed before each replay; µs per layer, median over replays, written as JSON to --out.

    python3 tools/bench_pdl_chain.py --batch 1 8 --out pdl_chain.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from k3compile.model_def.config import get_preset
from k3compile.passes.kernels import attn_res_norm, kda_decode  # noqa: F401  (register the k3 ops)
from k3compile.passes.kernels.pdl import pdl_available

from bench_kda_decode import make_layer_inputs


def chain(layers, pdl: bool, gemms: bool):
    def run():
        for x, delta, norm_w, w_in, w_out, kda_args in layers:
            h, _ = torch.ops.k3.attn_res_norm([], x, delta, None, norm_w, 1e-6, 1e-6, pdl)
            if gemms:
                torch.mm(h, w_in.t())
            o = torch.ops.k3.fused_kda_decode(*kda_args, use_pdl=pdl)
            if gemms:
                torch.mm(o.flatten(1), w_out.t())
    return run


def time_chain(fn, replays: int, n_layers: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(replays):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / n_layers)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-linear-48b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = get_preset(a.preset)
    gen = torch.Generator().manual_seed(0)
    d, c = cfg.hidden_size, cfg.kda_num_heads * cfg.kda_head_dim
    dt = torch.bfloat16
    print(f"{a.preset}: PDL available: {pdl_available()}; {torch.cuda.get_device_name()}")
    print("| batch | chain | µs/layer PDL off | µs/layer PDL on | gain |")
    print("|---|---|---|---|---|")
    rows = []
    for b in a.batch:
        kda = make_layer_inputs(b, cfg.kda_num_heads, cfg.kda_head_dim, cfg.gate_lower_bound, cfg.kda_full_rank_gate,
                                a.layers, dt, gen)
        layers = [(torch.randn(b, d, device="cuda", dtype=dt), torch.randn(b, d, device="cuda", dtype=dt),
                   torch.ones(d, device="cuda", dtype=dt), torch.randn(4 * c, d, device="cuda", dtype=dt) / d ** 0.5,
                   torch.randn(d, c, device="cuda", dtype=dt) / c ** 0.5, args) for args in kda]
        for name, gemms in (("norm -> GEMM -> KDA -> GEMM", True), ("norm -> KDA (Triton only)", False)):
            off = time_chain(chain(layers, False, gemms), a.replays, a.layers)
            on = time_chain(chain(layers, True, gemms), a.replays, a.layers)
            rows.append(dict(preset=a.preset, batch=b, chain=name, us_per_layer_pdl_off=off, us_per_layer_pdl_on=on))
            print(f"| {b} | {name} | {off:.2f} | {on:.2f} | {100 * (off - on) / off:.1f}% |", flush=True)
        del layers, kda
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
