"""Microbenchmark of the attn_res_norm kernels (P7) on one GPU: the streaming kernel (the old one:
each bank row read, reduced, then read again, one after another) vs the one-pass bank tile (the
default where the bank fits), µs per call, CUDA-graph replays; the tile also at several warp counts.

Shapes: k3-mini-6b (D 2048, bank 1 / 4 / 8 rows, with a delta and without: the block-boundary
form), Kimi-Linear-48B (D 2304, empty bank: both arms are the same kernel, a control), K3 (D 7168,
bank 3) at batch 1/8/64. Each figure: 20 calls captured in one CUDA graph, replayed 10 times,
median of 5 timings (bench_p07_p15.timed); each arm's relative error vs the CPU reference. Prints a markdown table and
writes JSON rows to --out.
"""
import argparse
import json

import torch

from bench_p07_p15 import CALLS, timed  # tools/ is sys.path[0] when run as a script
from k3compile.passes.kernels import attn_res_norm as arn


def rel_err(a, b) -> float:
    return ((a.float().cpu() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shapes = [("k3-mini-6b", 2048, 1, True), ("k3-mini-6b", 2048, 4, True), ("k3-mini-6b", 2048, 8, True),
              ("k3-mini-6b", 2048, 4, False), ("kimi-linear-48b", 2304, 0, True), ("k3", 7168, 3, True)]
    rows = []
    print("| shape | D | bank | delta | batch | streaming (old) us | one-pass us (warps) | best warps sweep | err old / new |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, d, nb, with_delta in shapes:
        for batch in args.batch:
            gen = torch.Generator().manual_seed(d + nb + batch)
            bank = [(torch.randn(batch, d, generator=gen) * (j + 1)).bfloat16() for j in range(nb)]
            x, delta = (torch.randn(batch, d, generator=gen).bfloat16() for _ in range(2))
            delta = delta if with_delta else None
            query = 0.05 * torch.randn(d, generator=gen) if nb else None
            w = torch.randn(d, generator=gen).bfloat16()
            h0, _ = arn.attn_res_norm_reference(bank, x, delta, query, w, 1e-5, 1e-5)
            cu = ([b.cuda() for b in bank], x.cuda(), None if delta is None else delta.cuda(),
                  None if query is None else query.cuda(), w.cuda())
            row = dict(shape=label, dim=d, bank=nb, delta=with_delta, batch=batch)
            row["streaming_us"] = timed(lambda: arn.attn_res_norm_triton(*cu, 1e-5, 1e-5, one_pass=False))
            row["streaming_err"] = rel_err(arn.attn_res_norm_triton(*cu, 1e-5, 1e-5, one_pass=False)[0], h0)
            if arn.one_pass_applies(cu[0], cu[1]):
                row["one_pass_us"] = timed(lambda: arn.attn_res_norm_triton(*cu, 1e-5, 1e-5))
                row["one_pass_err"] = rel_err(arn.attn_res_norm_triton(*cu, 1e-5, 1e-5)[0], h0)
                row["warps_sweep_us"] = {
                    nw: timed(lambda nw=nw: arn.attn_res_norm_triton(*cu, 1e-5, 1e-5, num_warps=nw))
                    for nw in (4, 8, 16)}
                row["one_pass_pdl_us"] = timed(lambda: arn.attn_res_norm_triton(*cu, 1e-5, 1e-5, pdl=True))
            rows.append(row)
            with open(args.out, "w") as f:  # after every row: a timeout still leaves the rows done
                json.dump(dict(calls_per_graph=CALLS, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
            sweep = row.get("warps_sweep_us", {})
            best = min(sweep, key=sweep.get) if sweep else None
            print(f"| {label} | {d} | {nb} | {with_delta} | {batch} | {row['streaming_us']:.2f} | "
                  f"{row.get('one_pass_us', float('nan')):.2f} | "
                  f"{'-' if best is None else f'{best} warps: {sweep[best]:.2f}'} | "
                  f"{row['streaming_err']:.1e} / {row.get('one_pass_err', float('nan')):.1e} |", flush=True)


if __name__ == "__main__":
    main()
