"""What a GEMV -> GEMV launch boundary costs: S dependent decode GEMVs as S launches against one launch.

    python3 tools/bench_gemv_chain.py --out $OUT/gemv_chain.md [--rows 1 4]

For issue 9's next step (a persistent, megakernel-style decode for k3-mini-6b; passes/README.md, "k3-mini-6b batch-1
budget"). Per chain of weights (k3-mini-6b's o_proj-sized 2048 x 2048 stages, its 2048 <-> 4096 pairs, the 48B's
2304 <-> 4096 pairs), µs per chain replayed from CUDA graphs with the weights read from HBM (copies of the chain
rotated past L2, passes/kernels/graph_timing.py):
  sep       S `k3.gemv` launches (the rows design with one K split, as P8 may pick), no PDL
  sep-pdl   the same with PDL and early release (the engine's form: the next GEMV's first weight tile loads
            while this one streams)
  chain     one launch of passes/kernels/gemv_chain.py (tiles ordered by tickets; a tile waits for the previous
            stage's tiles after loading its first weight tile)
  chain-sleep  the same, the waiting tiles sleeping BACKOFF_NS between reads of the counter
  chain-pers   the persistent form: one program per SM walking its tiles in order (no ticket atomics, no program
               started per tile)
for a few tile widths (the last, K = 2048 a step, loads a 2048-wide stage's whole weight slice before its wait; 4
warps at M = 1, 8 at M = 4, every arm); the saving per boundary = (best sep-pdl - best chain of any kind) / (S - 1),
and each arm's share of the same-run copy bandwidth. The chain's outputs are checked against the separate launches'
(relative error).
"""
from __future__ import annotations

import argparse
import sys

import torch

from k3compile.bench.timing import copy_bandwidth
from k3compile.passes.kernels import gemv as gemv_kernels
from k3compile.passes.kernels.gemv_chain import GemvChain
from k3compile.passes.kernels.graph_timing import copies_to_overflow_l2, replay_us
from k3compile.passes.kernels.pdl import pdl_available

CHAINS = {
    "k3-mini o_proj 2048x2048 x8": (2048,) * 9,
    "k3-mini 2048<->4096 x4": (2048, 4096, 2048, 4096, 2048),
    "48B 2304<->4096 x4": (2304, 4096, 2304, 4096, 2304),
}
TILES = ((4, 1024), (8, 512), (16, 256), (2, 2048))  # (block_n, block_k): 4096 weights a K step, as gemv's ROWS_TILE
BACKOFF_NS = 128  # chain-sleep: a waiting tile sleeps between reads of the counter


def warps_for(m: int) -> int:
    return 4 if m == 1 else 8  # M = 4 spills at 4 warps (tools/aot_check.py --regs chain)


def separate(x, ws, bn, bk, pdl):
    def run():
        y = x
        for w in ws:
            y = gemv_kernels.gemv_triton(y, w, None, bn, bk, 1, num_warps=warps_for(x.shape[0]),
                                         design=gemv_kernels.DESIGNS["rows"], use_pdl=pdl, early_release=pdl)
        return y
    return run


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", required=True, help="markdown table path")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    pdl = pdl_available(dev.index)
    bw = copy_bandwidth(1 << 30, dev)["bytes_per_s"]
    lines = [f"# GEMV chains: S launches vs one ({torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.3f} TB/s, "
             f"PDL {'on' if pdl else 'unavailable'})", "",
             "µs per chain, CUDA-graph replays, weights from HBM (copies rotated past L2); % = bytes / time of the "
             "copy bandwidth; saving per boundary = (best sep-pdl - best chain) / (S - 1).", "",
             "| chain | M | MB | arm | block_n x block_k | µs | % of copy bw | chain vs sep-pdl rel err |",
             "|---|---|---|---|---|---|---|---|"]
    summary = []
    for name, widths in CHAINS.items():
        shapes = [(widths[i + 1], widths[i]) for i in range(len(widths) - 1)]
        nbytes = sum(n * k * 2 for n, k in shapes)
        copies = copies_to_overflow_l2(nbytes)
        gen = torch.Generator(device="cuda").manual_seed(0)
        sets = [[(torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16() for n, k in shapes]
                for _ in range(copies)]
        for m in a.rows:
            xs = [torch.randn(m, widths[0], generator=gen, device="cuda").bfloat16() for _ in range(copies)]
            best = {}
            for bn, bk in TILES:
                arms = {"sep": [separate(x, ws, bn, bk, False) for x, ws in zip(xs, sets)]}
                if pdl:
                    arms["sep-pdl"] = [separate(x, ws, bn, bk, True) for x, ws in zip(xs, sets)]
                chains = [GemvChain(ws, m, block_n=bn, block_k=bk, num_warps=warps_for(m)) for ws in sets]
                sleepy = [GemvChain(ws, m, block_n=bn, block_k=bk, num_warps=warps_for(m), backoff_ns=BACKOFF_NS)
                          for ws in sets]
                pers = [GemvChain(ws, m, block_n=bn, block_k=bk, num_warps=warps_for(m), persistent=True)
                        for ws in sets]
                for ch, x in zip(chains + sleepy + pers, xs * 3):
                    ch.input.copy_(x)
                arms["chain"] = [ch.launch for ch in chains]
                arms["chain-sleep"] = [ch.launch for ch in sleepy]
                arms["chain-pers"] = [ch.launch for ch in pers]
                ref = arms["sep-pdl" if pdl else "sep"][0]()
                errs = {"chain": rel(chains[0].launch(), ref), "chain-sleep": rel(sleepy[0].launch(), ref),
                        "chain-pers": rel(pers[0].launch(), ref)}
                for arm, calls in arms.items():
                    us = replay_us(calls, a.reps)
                    best[arm] = min(best.get(arm, float("inf")), us)
                    pct = 100 * nbytes / (us * 1e-6) / bw
                    lines.append(f"| {name} | {m} | {nbytes / 1e6:.1f} | {arm} | {bn} x {bk} | {us:.2f} | {pct:.1f} | "
                                 + (f"{errs[arm]:.2e}" if arm in errs else "") + " |")
                    print(lines[-1], flush=True)
                del chains, sleepy, pers, arms
            sep = best.get("sep-pdl", best["sep"])
            chain = min(best["chain"], best["chain-sleep"], best["chain-pers"])
            summary.append(f"- {name}, M = {m}: best sep {best['sep']:.2f} µs, best sep-pdl "
                           f"{best.get('sep-pdl', float('nan')):.2f}, best chain {best['chain']:.2f}, with sleeps "
                           f"{best['chain-sleep']:.2f}, persistent {best['chain-pers']:.2f}: saving per boundary "
                           f"{(sep - chain) / (len(shapes) - 1):.2f} µs ({len(shapes) - 1} boundaries)")
            print(summary[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        f.write("\n".join(lines + [""] + summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
