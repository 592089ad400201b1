"""MLA decode attention + W_UV at the Kimi-Linear-48B shape: the whole-row merge (session 8's kernels) vs the
column-block merge (LAUNCH_TABLE) and a small sweep of (num_splits, merge_cols), µs per MLA layer.

Shape: 32 heads, latent 512 + 64 (k_r slot), dv 128 (W_UV = 32 x 128 x 512 bf16 = 4 MB a layer), page 16, the page
table as wide as --capacity tokens (the engine's: the split heuristic reads it), every request at `context`
tokens. Each figure: one call per layer for --layers layers (distinct pool layers and kv_b weights, enough to
overflow L2 as in a decode step), captured in one CUDA graph with PDL on, replayed: median µs per call
(kernels.graph_timing.replay_us). Rel err: layer 0's output vs the fp32 reference (`decode_out_reference`).
Also the W_UK batched GEMM (cuBLAS, the `..._NNT` nvjet kernel of the engine trace) for reference.

    python tools/bench_mla9.py --out mla9.json [--budget-s 75]     # markdown to stdout
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from k3compile.passes.kernels import mla_decode as mla
from k3compile.passes.kernels.graph_timing import copies_to_overflow_l2, replay_us
from k3compile.passes.kernels.pdl import pdl_available

HEADS, R, ROPE, NOPE, DV, PAGE = 32, 512, 64, 128, 128, 16
SCALE = (NOPE + ROPE) ** -0.5
SWEEP_SPLITS = (0, 8, 16, 32)  # 0: num_splits_for (the shapes' heuristic)
SWEEP_COLS = (32, 64, 128)


def make_inputs(batch, context, capacity, layers, gen):
    max_pages = capacity // PAGE
    used = -(-context // PAGE)
    pages = batch * used + 1
    kv = torch.randn(pages, layers, PAGE, R + ROPE, generator=gen).bfloat16().cuda()
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    table[:, :used] = (torch.randperm(pages - 1, generator=gen)[: batch * used] + 1).view(batch, used)
    seq = torch.full((batch,), context, dtype=torch.int32)
    q_nope = torch.randn(batch, HEADS, R, generator=gen).bfloat16().cuda()
    q_rope = torch.randn(batch, HEADS, NOPE + ROPE, generator=gen).bfloat16().cuda()[..., NOPE:]
    w_kv_b = [(torch.randn(HEADS * (NOPE + DV), R, generator=gen) * R ** -0.5).bfloat16().cuda() for _ in range(layers)]
    return q_nope, q_rope, kv, table.cuda(), seq.cuda(), w_kv_b


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def arm(inputs, layers, pdl, **launch):
    """One call per layer: the attention + W_UV as the op runs it (the merge kernel applies W_UV up to
    OUT_MAX_TOKENS tokens, cuBLAS after the merge above), with the given launch choice."""
    q_nope, q_rope, kv, table, seq, w_kv_b = inputs
    w_uvs = [mla.w_uv_of(w, HEADS, NOPE) for w in w_kv_b]

    def call(layer):
        if q_nope.shape[0] <= mla.OUT_MAX_TOKENS:
            return mla.decode_triton(q_nope, q_rope, kv, layer, table, seq, SCALE, pdl, w_uv=w_uvs[layer], **launch)
        o_lat = mla.decode_triton(q_nope, q_rope, kv, layer, table, seq, SCALE, pdl, **launch)
        return torch.einsum("bhr,hdr->bhd", o_lat, w_uvs[layer]).flatten(-2)
    return [lambda layer=layer: call(layer) for layer in range(layers)], call


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--capacity", type=int, default=8192, help="page table width in tokens (engine: max context)")
    ap.add_argument("--budget-s", type=float, default=75.0, help="stop sweeping after this long (rows so far kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    pdl = pdl_available(torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    rows, notes = [], []
    print(f"# MLA decode + W_UV, Kimi-Linear-48B shape, {torch.cuda.get_device_name()}, PDL {'on' if pdl else 'off'}, "
          f"capacity {args.capacity} tokens\n")
    print("| batch | context | arm | num_splits | merge_cols | µs / layer | vs whole-row | rel err vs fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    shapes = {}
    for context in args.context:
        for batch in args.batch:
            layer_bytes = HEADS * DV * R * 2 + batch * context * (R + ROPE) * 2
            layers = min(12, copies_to_overflow_l2(layer_bytes))
            inputs = make_inputs(batch, context, max(args.capacity, context), layers, gen)
            q_nope, q_rope, kv, table, seq, w_kv_b = inputs
            want = mla.decode_out_reference(q_nope.float(), q_rope.float(), kv.float(), 0, table, seq, SCALE,
                                            mla.w_uv_of(w_kv_b[0].float(), HEADS, NOPE))
            shapes[batch, context] = (inputs, layers, want, mla.launch_for(batch, R))
    base = {}

    def measure(batch, context, name, splits, cols):
        inputs, layers, want, _ = shapes[batch, context]
        try:
            calls, call = arm(inputs, layers, pdl, num_splits=splits, merge_cols=cols)
            err = rel(call(0), want)
            us = replay_us(calls)
        except Exception as e:  # a launch that does not fit: say so, keep going
            notes.append(f"batch {batch} context {context} splits {splits} cols {cols}: {type(e).__name__}: {e}"[:300])
            return
        b = base.setdefault((batch, context), us)
        rows.append(dict(batch=batch, context=context, arm=name, num_splits=splits, merge_cols=cols, us=round(us, 2),
                         speedup=round(b / us, 3), rel_err=err, layers=layers))
        print(f"| {batch} | {context} | {name} | {splits or 'auto'} | {cols or 'row'} | {us:.2f} | {b / us:.2f}x | "
              f"{err:.2e} |", flush=True)
    for (batch, context), (_, _, _, (splits, cols)) in shapes.items():  # first the two arms of every shape
        measure(batch, context, "whole-row (before)", 0, 0)
        measure(batch, context, "LAUNCH_TABLE", splits, cols)
    for (batch, context), (_, _, _, chosen) in shapes.items():  # then the sweep, as far as the budget goes
        for splits in SWEEP_SPLITS:
            for cols in SWEEP_COLS:
                if (splits, cols) == chosen:
                    continue
                if time.time() - t0 > args.budget_s:
                    notes.append(f"sweep cut at the {args.budget_s:.0f} s budget (from batch {batch} context "
                                 f"{context} splits {splits} cols {cols} on)")
                    break
                measure(batch, context, "sweep", splits, cols)
            else:
                continue
            break
        else:
            continue
        break
    # the W_UK product before the attention (the engine's cuBLAS `..._NNT` GEMM, 3.77 µs a layer at batch 1)
    print("\n| batch | W_UK bmm [H, B, 128] x [H, 128, 512] (cuBLAS) µs / layer |\n|---|---|")
    for batch in args.batch:
        w_uk = [(torch.randn(HEADS, NOPE, R, generator=gen)).bfloat16().cuda() for _ in range(8)]
        q = torch.randn(HEADS, batch, NOPE, generator=gen).bfloat16().cuda()
        us = replay_us([lambda w=w: torch.bmm(q, w) for w in w_uk])
        rows.append(dict(batch=batch, arm="w_uk_bmm", us=round(us, 2)))
        print(f"| {batch} | {us:.2f} |")
    for n in notes:
        print(f"\nnote: {n}")
    best = {}
    for r in rows:
        if r.get("context") is not None:
            key = (r["batch"], r["context"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    print("\nfastest per shape: " + "; ".join(f"batch {b} ctx {c}: splits {r['num_splits'] or 'auto'} cols "
                                             f"{r['merge_cols'] or 'row'} {r['us']} µs" for (b, c), r in best.items()))
    # per batch, the (splits, cols) with the least total µs over the contexts that measured it at all of them
    per_batch = {}
    for r in rows:
        if r.get("context") is not None:
            per_batch.setdefault(r["batch"], {}).setdefault((r["num_splits"], r["merge_cols"]), []).append(r["us"])
    suggestion = []
    for batch in sorted(per_batch):
        full = {k: sum(v) for k, v in per_batch[batch].items() if len(v) == len(args.context)}
        if full:
            splits, cols = min(full, key=full.get)
            suggestion.append((batch, splits, cols))
    if suggestion:
        table = [row for row in suggestion[:-1]] + [(mla.ANY_BATCH, *suggestion[-1][1:])]
        print(f"\nsuggested P15 option (fastest summed over contexts): "
              f"p15_mla_decode.launch_table={mla.format_launch_table(table)}"
              f" (today: {mla.format_launch_table(mla.LAUNCH_TABLE)})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "pdl": pdl, "rows": rows, "notes": notes,
                       "launch_table": mla.LAUNCH_TABLE}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
