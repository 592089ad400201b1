"""Microbenchmark: one KDA layer's decode step after its input GEMM, fused (k3::fused_kda_decode as P5
emits it: the Triton kernel, with f_b_proj and Kimi Linear's g_b_proj absorbed) vs unfused (the ops
the P1-P4 engine runs: the f_b_proj / g_b_proj GEMMs, k3::short_conv_decode x3, the gate and beta ops,
k3::kda_decode (fla's fused_recurrent on CUDA when fla is installed), the gated RMSNorm ops).

Both run as CUDA graphs of `--layers` consecutive layers (distinct pool layers, as in a step), so
Python and launch overhead are excluded the way the engine's graph replay excludes them; before each
replay a 512 MiB write evicts L2, so states come from HBM as they do inside a real step. Prints
µs per layer (median over replays) and kernels per layer (torch.profiler, one eager layer), and
writes the rows as JSON to --out.

    python3 tools/bench_kda_decode.py --preset kimi-linear-48b --batch 1 8 64 --out results.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from k3compile.model_def.config import get_preset
from k3compile.model_def.ops.cuda_backend import BACKENDS
from k3compile.passes.kernels import kda_decode


def make_layer_inputs(batch, heads, head_dim, lower_bound, full_rank_gate, layers, dtype, gen, dev="cuda"):
    """Post-GEMM activations as column blocks of one merged output (as in the captured graph), per-layer
    weights, pools of `layers` KDA layers with random contents and the batch in a shuffled slot order.
    f (and the gate, unless full rank) come as low-rank inputs of rank head_dim plus their weights."""
    c = heads * head_dim
    rank = head_dim  # f_a_proj / g_a_proj: hidden -> head_dim
    slots = torch.randperm(batch + 16, generator=gen)[:batch].to(dev)
    num_slots = batch + 16
    ssm = 0.3 * torch.randn(num_slots, layers, heads, head_dim, head_dim, device=dev)
    conv = torch.randn(num_slots, layers, 3 * c, 3, device=dev, dtype=dtype)
    per_layer = []
    for layer in range(layers):
        g_cols = c if full_rank_gate else rank
        merged = torch.randn(batch, 3 * c + rank + heads + g_cols, device=dev, dtype=dtype)
        xq, xk, xv = (merged[:, i * c:(i + 1) * c] for i in range(3))
        f = merged[:, 3 * c:3 * c + rank]
        beta = merged[:, 3 * c + rank:3 * c + rank + heads]
        gate = merged[:, 3 * c + rank + heads:]
        f_b = torch.randn(c, rank, device=dev, dtype=dtype) / rank ** 0.5
        g_b = None if full_rank_gate else torch.randn(c, rank, device=dev, dtype=dtype) / rank ** 0.5
        if full_rank_gate:
            gate = gate.unflatten(-1, (heads, head_dim))
        w = [0.5 * torch.randn(c, 4, device=dev, dtype=dtype) for _ in range(3)]
        a_log = (torch.rand(heads, device=dev) * 2.7).to(dtype)
        dt_bias = (0.1 * torch.randn(c, device=dev)).float()
        norm_w = torch.ones(head_dim, device=dev, dtype=torch.float32)
        per_layer.append((xq, xk, xv, *w, f, dt_bias, a_log, beta, gate, norm_w, conv, ssm, layer, slots,
                          lower_bound, 1e-5, f_b, g_b))
    return per_layer


def unfused(args, use_pdl=False):
    return kda_decode.fused_kda_decode_reference(*args)  # the unfused ops, dispatched to their CUDA kernels


def fused(args, use_pdl=False):
    return torch.ops.k3.fused_kda_decode(*args, use_pdl=use_pdl)  # the CUDA registration P5's graphs call


def time_graph(fn, layer_args, use_pdl, replays):
    for args in layer_args:  # warm up: Triton compile, fla autotune
        fn(args, use_pdl)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn(layer_args[0], use_pdl)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for args in layer_args:
                fn(args, use_pdl)
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(replays):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(layer_args))
    return statistics.median(times)


def kernels_per_layer(fn, args) -> int:
    fn(args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-linear-48b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--layers", type=int, default=20, help="KDA layers per graph (48B has 20)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = get_preset(a.preset)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    pdl = kda_decode.pdl_available()
    print(f"{a.preset}: H={cfg.kda_num_heads} K=V={cfg.kda_head_dim} gate="
          f"{'softplus' if cfg.gate_lower_bound is None else f'lower bound {cfg.gate_lower_bound}'} {a.dtype}; "
          f"unfused KDA backend: {BACKENDS.get('kda')}; PDL available: {pdl}; {torch.cuda.get_device_name()}")
    print("| batch | unfused µs/layer | fused µs/layer | fused+PDL µs/layer | speedup "
          "| kernels/layer unfused → fused |")
    print("|---|---|---|---|---|---|")
    rows = []
    for b in a.batch:
        layer_args = make_layer_inputs(b, cfg.kda_num_heads, cfg.kda_head_dim, cfg.gate_lower_bound,
                                       cfg.kda_full_rank_gate, a.layers, dtype, gen)
        t_unfused = time_graph(unfused, layer_args, False, a.replays)
        t_fused = time_graph(fused, layer_args, False, a.replays)
        t_pdl = time_graph(fused, layer_args, True, a.replays) if pdl else None
        k_unfused, k_fused = kernels_per_layer(unfused, layer_args[0]), kernels_per_layer(fused, layer_args[0])
        row = dict(preset=a.preset, dtype=a.dtype, batch=b, unfused_us=t_unfused, fused_us=t_fused,
                   fused_pdl_us=t_pdl, kernels_unfused=k_unfused, kernels_fused=k_fused)
        rows.append(row)
        pdl_s = f"{t_pdl:.2f}" if t_pdl is not None else "n/a"
        print(f"| {b} | {t_unfused:.2f} | {t_fused:.2f} | {pdl_s} | {t_unfused / t_fused:.1f}x | "
              f"{k_unfused} → {k_fused} |", flush=True)
        del layer_args
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
