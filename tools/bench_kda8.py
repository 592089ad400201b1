"""Microbenchmark (issue 9, kda8): P5's fused KDA decode kernel behind a preceding kernel, PDL off / on, the
wait-first schedule vs the prefetch (everything the previous kernel does not write loads before gdc_wait),
and a sweep of the launch choices (V split x state block width x warps).

Per layer of a `--layers`-layer CUDA graph (distinct pool layers; a state pool of `--slots` slots, so states
come from HBM as in the 48B engine; L2 flushed before each replay): the input projection (the merged
q/k/v/f_a/beta/g_a GEMM of the 48B shape, [B, 2304] x [2304, N_in]) and then the KDA kernel. The
predecessor is cuBLAS (torch.mm: what the engine runs today) or P8's Triton GEMV with PDL (its first K
step's weights load before its own gdc_wait, it calls gdc_launch_dependents once x is read: the chain PDL
can overlap), at batch <= 16. µs per layer of the chain, of the predecessor alone, and the difference
(what the KDA kernel adds to the chain). The sweep times the KDA kernel alone (PDL on, prefetch on) with
its relative error vs the reference. Prints markdown tables and writes the rows as JSON to --out.

    python3 tools/bench_kda8.py --batch 1 8 64 --out kda8.json      (from the repository root or tools/)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kda_decode import check_split, fused, make_layer_inputs  # noqa: E402
from bench_pdl_chain import time_chain  # noqa: E402

from k3compile.model_def.config import get_preset  # noqa: E402
from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, v_split_for  # noqa: E402
from k3compile.passes.kernels import gemv as gemv_kernels  # noqa: E402
from k3compile.passes.kernels.pdl import pdl_available  # noqa: E402


def in_proj_width(cfg) -> int:
    """Columns of the merged input GEMM of a Kimi-Linear KDA layer: q, k, v, f_a, beta, g_a."""
    c, r = cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_head_dim
    return 3 * c + r + cfg.kda_num_heads + (c if cfg.kda_full_rank_gate else r)


def predecessor(kind: str, x, w, use_pdl: bool):
    """The kernel before the KDA kernel: 'cublas' (torch.mm) or 'gemv' (P8's kernel, its default config for the
    shape, with PDL when the arm has it)."""
    if kind == "cublas":
        return lambda: torch.mm(x, w.t())
    n, k = w.shape
    block_n, block_k, split_k = gemv_kernels.default_config(n, k, torch.cuda.get_device_properties(0)
                                                            .multi_processor_count)
    return lambda: gemv_kernels.gemv_triton(x, w, None, block_n, block_k, split_k, design=0, use_pdl=use_pdl)


def chain(preds, layer_args, use_pdl, launch, with_kda=True):
    def run():
        for pred, args in zip(preds, layer_args):
            pred()
            if with_kda:
                fused(args, use_pdl, None, **launch)
    return run


def sweep_configs(batch: int, heads: int, v: int, quick: bool):
    """(v_split, block_v, num_warps) around the default for this batch."""
    rows = batch * heads
    splits = [2, 4, 8] if rows <= 128 else [1, 2] if rows <= 512 else [1]
    out = []
    for split in splits:
        per = v // split
        for bv in (16, 32, 64, 128):
            if bv > per or (quick and bv not in (32, per)):
                continue
            for warps in ((2, 4, 8) if bv * 128 <= 64 * 64 else (4, 8, 16)):
                out.append((split, bv, warps))
    return out


def chain_arguments(doc: str, batches: list[int], replays: int) -> argparse.ArgumentParser:
    """The options this bench and bench_kda9.py share."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--preset", default="kimi-linear-48b")
    ap.add_argument("--batch", type=int, nargs="+", default=batches)
    ap.add_argument("--layers", type=int, default=20, help="KDA layers per graph (48B has 20)")
    ap.add_argument("--slots", type=int, default=128, help="state pool slots (x layers x 2 MiB at the 48B shape)")
    ap.add_argument("--replays", type=int, default=replays)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out", default=None)
    return ap


class ChainShape:
    """The preset's KDA and in_proj shapes, printed once; `inputs(b)`: a batch's per-layer KDA inputs, the in_proj's
    input x and its per-layer weights (bf16, on CUDA)."""

    def __init__(self, a):
        self.a, self.cfg = a, get_preset(a.preset)
        self.dt, self.gen, self.pdl = torch.bfloat16, torch.Generator().manual_seed(0), pdl_available()
        self.h, self.kd = self.cfg.kda_num_heads, self.cfg.kda_head_dim
        self.n_in, self.d = in_proj_width(self.cfg), self.cfg.hidden_size
        print(f"{a.preset}: H={self.h} K=V={self.kd} in_proj N={self.n_in} K={self.d}, {a.layers} layers, "
              f"{a.slots} slots, {a.replays} replays; PDL available: {self.pdl}; {torch.cuda.get_device_name()}")

    def inputs(self, b: int):
        a, cfg, dt = self.a, self.cfg, self.dt
        layer_args = make_layer_inputs(b, self.h, self.kd, cfg.gate_lower_bound, cfg.kda_full_rank_gate, a.layers,
                                       dt, self.gen, num_slots=a.slots)
        x = torch.randn(b, self.d, device="cuda", dtype=dt)
        weights = [torch.randn(self.n_in, self.d, device="cuda", dtype=dt) / self.d ** 0.5 for _ in range(a.layers)]
        return layer_args, x, weights


def sweep(b, layer_args, configs, pdl: bool, replays: int) -> list[dict]:
    """The kernel alone (PDL on where available, prefetch) per (v_split, block_v, num_warps): a markdown table, and
    its rows."""
    rows = []
    print("\n| V split | block_v | warps | µs/layer KDA alone (PDL on, prefetch) | rel err |")
    print("|---|---|---|---|---|")
    for v_split, bv, warps in configs:
        launch = dict(v_split=v_split, block_v=bv, num_warps=warps, prefetch=True)
        try:
            t = time_chain(lambda: [fused(args, pdl, **launch) for args in layer_args], replays, len(layer_args))
            err = check_split(layer_args[0], **launch)
        except Exception as e:  # a configuration the device cannot compile or run is reported, not fatal
            rows.append(dict(batch=b, sweep=True, **launch, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(f"| {v_split} | {bv} | {warps} | failed: {type(e).__name__} | - |", flush=True)
            continue
        rows.append(dict(batch=b, sweep=True, **launch, us_kda=t, rel_err=err))
        print(f"| {v_split} | {bv} | {warps} | {t:.2f} | {err:.2e} |", flush=True)
    return rows


def main() -> None:
    ap = chain_arguments(__doc__, [1, 8, 64], 30)
    ap.add_argument("--quick-sweep", action="store_true", help="block widths 32 and V/split only")
    a = ap.parse_args()
    shape = ChainShape(a)
    h, kd, pdl = shape.h, shape.kd, shape.pdl
    rows = []
    for b in a.batch:
        layer_args, x, weights = shape.inputs(b)
        split = v_split_for(DEFAULT_LAYOUT, b, h, kd)
        print(f"\n### batch {b} (default V split {split})\n")
        print("| predecessor | arm | µs/layer chain | µs/layer predecessor alone | KDA adds | rel err |")
        print("|---|---|---|---|---|---|")
        arms = [("PDL off", False, True), ("PDL on, wait first", True, False), ("PDL on, prefetch", True, True)]
        for kind in ("cublas", "gemv"):
            if kind == "gemv" and b > gemv_kernels.MAX_M:
                continue
            for name, use_pdl, prefetch in arms:
                if use_pdl and not pdl:
                    continue
                preds = [predecessor(kind, x, w, use_pdl) for w in weights]
                launch = {"prefetch": prefetch}
                t = time_chain(chain(preds, layer_args, use_pdl, launch), a.replays, a.layers)
                t_pred = time_chain(chain(preds, layer_args, use_pdl, launch, with_kda=False), a.replays, a.layers)
                err = check_split(layer_args[0], None, **launch)
                rows.append(dict(batch=b, predecessor=kind, arm=name, use_pdl=use_pdl, prefetch=prefetch,
                                 us_chain=t, us_predecessor=t_pred, us_kda_adds=t - t_pred, rel_err=err))
                print(f"| {kind} | {name} | {t:.2f} | {t_pred:.2f} | {t - t_pred:.2f} | {err:.2e} |", flush=True)
        if not a.no_sweep:
            rows += sweep(b, layer_args, sweep_configs(b, h, kd, a.quick_sweep), pdl, a.replays)
        del layer_args, weights
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
