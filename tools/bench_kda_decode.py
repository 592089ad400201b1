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
from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, v_split_for
from k3compile.passes.kernels import kda_decode
from k3compile.passes.kernels.pdl import pdl_available


def make_layer_inputs(batch, heads, head_dim, lower_bound, full_rank_gate, layers, dtype, gen, dev="cuda",
                      num_slots=None):
    """Post-GEMM activations as column blocks of one merged output (as in the captured graph), per-layer
    weights, pools of `layers` KDA layers and `num_slots` slots (default batch + 16) with random contents and
    the batch in a shuffled slot order. f (and the gate, unless full rank) come as low-rank inputs of rank
    head_dim plus their weights."""
    c = heads * head_dim
    rank = head_dim  # f_a_proj / g_a_proj: hidden -> head_dim
    num_slots = max(num_slots or 0, batch + 16)
    slots = torch.randperm(num_slots, generator=gen)[:batch].to(dev)
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


def unfused(args, use_pdl=False, v_split=None):
    return kda_decode.fused_kda_decode_reference(*args)  # the unfused ops, dispatched to their CUDA kernels


def fused(args, use_pdl=False, v_split=None, **launch):
    """What P5's graphs run: the CUDA registration (cuBLAS up-projections above the absorb batch), with the
    kernel's V split forced to `v_split` (None: the default heuristic; 1: one program per (request, head),
    the schedule before the split) and `launch` (prefetch, block_v, num_warps of fused_kda_decode_triton)."""
    if v_split is None and not launch:
        return torch.ops.k3.fused_kda_decode(*args, use_pdl=use_pdl)
    args = list(args)
    if args[0].shape[0] > kda_decode.LOW_RANK_IN_KERNEL_MAX_BATCH:
        h = args[8].shape[0]
        args[6], args[10] = kda_decode.expand_low_rank(args[6], args[10], args[18], args[19], h)
        args[18] = args[19] = None
    return kda_decode.fused_kda_decode_triton(*args, use_pdl=use_pdl, v_split=v_split, **launch)


def time_graph(fn, layer_args, use_pdl, replays, v_split=None):
    for args in layer_args:  # warm up: Triton compile, fla autotune
        fn(args, use_pdl, v_split)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn(layer_args[0], use_pdl, v_split)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for args in layer_args:
                fn(args, use_pdl, v_split)
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


def check_split(args, v_split, **launch) -> float:
    """Normwise relative error of the forced-split kernel's output vs the reference (private pool copies)."""
    def private(a):
        a = list(a)
        a[12], a[13] = a[12].clone(), a[13].clone()
        return a
    got = fused(private(args), False, v_split, **launch).float()
    want = kda_decode.fused_kda_decode_reference(*private(args)).float()
    return ((got - want).abs().max() / want.abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-linear-48b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--layers", type=int, default=20, help="KDA layers per graph (48B has 20)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8],
                    help="forced V splits to time besides the default (1 = the kernel before the split)")
    ap.add_argument("--no-unfused", action="store_true", help="skip the unfused-ops arm")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = get_preset(a.preset)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    pdl = pdl_available()
    print(f"{a.preset}: H={cfg.kda_num_heads} K=V={cfg.kda_head_dim} gate="
          f"{'softplus' if cfg.gate_lower_bound is None else f'lower bound {cfg.gate_lower_bound}'} {a.dtype}; "
          f"unfused KDA backend: {BACKENDS.get('kda')}; PDL available: {pdl}; {torch.cuda.get_device_name()}")
    print("| batch | arm | V split | µs/layer | µs/layer with PDL | rel err vs reference |")
    print("|---|---|---|---|---|---|")
    rows = []
    for b in a.batch:
        layer_args = make_layer_inputs(b, cfg.kda_num_heads, cfg.kda_head_dim, cfg.gate_lower_bound,
                                       cfg.kda_full_rank_gate, a.layers, dtype, gen)
        default_split = v_split_for(DEFAULT_LAYOUT, b, cfg.kda_num_heads, cfg.kda_head_dim)
        arms = [] if a.no_unfused else [("unfused", unfused, None)]
        arms += [("fused default", fused, None)]
        arms += [(f"fused split {s}" + (" (old kernel schedule)" if s == 1 else ""), fused, s)
                 for s in a.splits if cfg.kda_head_dim % s == 0]
        for name, fn, split in arms:
            t = time_graph(fn, layer_args, False, a.replays, split)
            t_pdl = time_graph(fn, layer_args, True, a.replays, split) if pdl and fn is fused else None
            err = check_split(layer_args[0], split) if fn is fused else None
            row = dict(preset=a.preset, dtype=a.dtype, batch=b, arm=name,
                       v_split=default_split if fn is fused and split is None else split,
                       us_per_layer=t, us_per_layer_pdl=t_pdl, rel_err=err)
            rows.append(row)
            pdl_s = f"{t_pdl:.2f}" if t_pdl is not None else "n/a"
            err_s = f"{err:.2e}" if err is not None else "-"
            print(f"| {b} | {name} | {row['v_split'] or '-'} | {t:.2f} | {pdl_s} | {err_s} |", flush=True)
        if not a.no_unfused:
            rows.append(dict(preset=a.preset, batch=b, kernels_unfused=kernels_per_layer(unfused, layer_args[0]),
                             kernels_fused=kernels_per_layer(fused, layer_args[0])))
        del layer_args
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
