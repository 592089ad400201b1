"""The MLA decode layer's kernel chain at the Kimi-Linear-48B shape, µs per layer: prologue -> W_UK absorption ->
split -> merge + W_UV, as the P15 ops run it, with W_UK through cuBLAS (today), k3.mla_absorb_q (absorb_q="triton") or in the prologue's launch
(absorb_q="fold", k3.mla_decode_prologue_absorb),
and the merge kernel's W_UV L2 prefetch (prefetch_w_uv) off / on.

Shape: 32 heads, q heads nope 128 + rope 64 (q_nope a strided view of the query GEMM's output, as in the graph),
latent 512 + 64, dv 128 (kv_b_proj 32 x 256 x 512 bf16 = 8 MB a layer: W_UK and W_UV), page 16, the page table
--capacity tokens wide, every request at `context` tokens, the prologue writing each request's last row. Each
figure: one chain per layer for enough layers (distinct pool layers and kv_b weights) to overflow L2, captured in
one CUDA graph with PDL on, replayed: median µs per layer (kernels.graph_timing.replay_us). Also the absorption alone
(cuBLAS vs Triton). Rel err: layer 0's chain output [B, H * dv] vs the fp32 composition of the references.

    python tools/bench_mla10.py --out mla10.json [--budget-s 60]     # markdown to stdout
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from k3compile.passes.kernels import mla_absorb, mla_decode as mla
from k3compile.passes.kernels.graph_timing import copies_to_overflow_l2, replay_us
from k3compile.passes.kernels.pdl import pdl_available

HEADS, R, ROPE, NOPE, DV, PAGE = 32, 512, 64, 128, 128, 16
SCALE = (NOPE + ROPE) ** -0.5
Q_COLS = HEADS * (NOPE + ROPE)
PROLOGUE = torch.ops.k3.mla_decode_prologue
ABSORB_Q = torch.ops.k3.mla_absorb_q
PROLOGUE_ABSORB = torch.ops.k3.mla_decode_prologue_absorb
FUSED_OUT = torch.ops.k3.mla_decode_fused_out
# (name, W_UK through the Triton kernel, W_UV prefetch)
ARMS = (("today (cuBLAS W_UK)", False, False), ("absorb_q=triton", True, False),
        ("absorb_q=triton + prefetch_w_uv", True, True), ("cuBLAS W_UK + prefetch_w_uv", False, True),
        ("absorb_q=fold (prologue + W_UK, one kernel)", "fold", False),
        ("absorb_q=fold + prefetch_w_uv", "fold", True))
ABSORB_SWEEP = ((32, 4), (128, 4), (128, 8))  # (block_r, num_warps) besides the default (BLOCK_R, 4)


def make_inputs(batch, context, capacity, layers, gen):
    max_pages = capacity // PAGE
    used = -(-context // PAGE)
    pages = batch * used + 1
    kv = torch.randn(pages, layers, PAGE, R + ROPE, generator=gen).bfloat16().cuda()
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    table[:, :used] = (torch.randperm(pages - 1, generator=gen)[: batch * used] + 1).view(batch, used)
    last = context - 1  # the prologue writes the step's own row: the last of each request's context
    loc = (table[:, last // PAGE].long() * PAGE + last % PAGE).cuda()
    seq = torch.full((batch,), context, dtype=torch.int32).cuda()
    merged = torch.randn(batch, Q_COLS + R + ROPE, generator=gen).bfloat16().cuda()  # [q heads | ckv] columns
    kv_norm_w = (1 + 0.1 * torch.randn(R, generator=gen)).bfloat16().cuda()
    w_kv_b = [(torch.randn(HEADS * (NOPE + DV), R, generator=gen) * R ** -0.5).bfloat16().cuda()
              for _ in range(layers)]
    return dict(kv=kv, table=table.cuda(), loc=loc, seq=seq, merged=merged, kv_norm_w=kv_norm_w, w_kv_b=w_kv_b)


def views(x):
    q = x["merged"][:, :Q_COLS].unflatten(-1, (HEADS, NOPE + ROPE))
    return q[..., :NOPE], q[..., NOPE:], x["merged"][:, Q_COLS:]


def chain(x, layer, pdl, triton_absorb, prefetch):
    """One MLA layer's decode kernels, as the graph after P15 calls them: [B, H * dv]. triton_absorb "fold": the
    prologue and the absorption in one launch (P15 absorb_q=fold)."""
    q_nope, q_rope, ckv = views(x)
    w = x["w_kv_b"][layer]
    if triton_absorb == "fold":
        q_lat = PROLOGUE_ABSORB(ckv, x["kv_norm_w"], 1e-6, x["kv"], layer, x["loc"], q_nope, w, NOPE, pdl)
        return FUSED_OUT(q_lat, q_rope, x["kv"], layer, x["table"], x["seq"], SCALE, w, NOPE, pdl, None, prefetch)
    PROLOGUE(ckv, x["kv_norm_w"], 1e-6, x["kv"], layer, x["loc"], None, None, 0.0, pdl)
    if triton_absorb:
        q_lat = ABSORB_Q(q_nope, w, NOPE, pdl)
    else:
        q_lat = torch.einsum("bhd,hdr->bhr", q_nope, mla_absorb.w_uk_of(w, HEADS, NOPE))
    return FUSED_OUT(q_lat, q_rope, x["kv"], layer, x["table"], x["seq"], SCALE, w, NOPE, pdl, None, prefetch)


def reference(x):
    """Layer 0's chain in fp32 on copies (the prologue's row included)."""
    q_nope, q_rope, ckv = views(x)
    kv0 = x["kv"][:, :1].float()
    mla.prologue_reference(ckv.float(), x["kv_norm_w"].float(), 1e-6, kv0, 0, x["loc"])
    w = x["w_kv_b"][0].float()
    q_lat = mla_absorb.absorb_reference(q_nope.float(), w, NOPE)
    return mla.decode_out_reference(q_lat, q_rope.float(), kv0, 0, x["table"], x["seq"], SCALE,
                                    mla.w_uv_of(w, HEADS, NOPE))


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--capacity", type=int, default=8192, help="page table width in tokens (engine: max context)")
    ap.add_argument("--budget-s", type=float, default=60.0, help="skip the shapes left after this long")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    pdl = pdl_available(torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    rows, notes = [], []
    print(f"# MLA decode layer chain (prologue -> W_UK -> split -> merge + W_UV), Kimi-Linear-48B shape, "
          f"{torch.cuda.get_device_name()}, PDL {'on' if pdl else 'off'}, capacity {args.capacity} tokens\n")
    print("| batch | context | arm | µs / layer | vs today | rel err vs fp32 |")
    print("|---|---|---|---|---|---|")
    for context in args.context:
        for batch in args.batch:
            if time.time() - t0 > args.budget_s:
                notes.append(f"budget {args.budget_s:.0f} s reached: batch {batch} context {context} not measured")
                continue
            layers = min(12, copies_to_overflow_l2(HEADS * (NOPE + DV) * R * 2 + batch * context * (R + ROPE) * 2))
            x = make_inputs(batch, context, max(args.capacity, context), layers, gen)
            want = reference(x)
            base = None
            for name, triton_absorb, prefetch in ARMS:
                try:
                    err = rel(chain(x, 0, pdl, triton_absorb, prefetch), want)
                    us = replay_us([lambda layer=layer: chain(x, layer, pdl, triton_absorb, prefetch)
                                    for layer in range(layers)])
                except Exception as e:  # an arm that fails: say so, keep going
                    notes.append(f"batch {batch} context {context} {name}: {type(e).__name__}: {e}"[:300])
                    continue
                base = base or us
                rows.append(dict(batch=batch, context=context, arm=name, us=round(us, 2), rel_err=err, layers=layers))
                print(f"| {batch} | {context} | {name} | {us:.2f} | {base / us:.3f}x | {err:.2e} |", flush=True)
            if context == args.context[0]:  # the absorption alone, once per batch
                q_nope = views(x)[0]
                alone = [("W_UK alone: cuBLAS", lambda w: torch.einsum(
                             "bhd,hdr->bhr", q_nope, mla_absorb.w_uk_of(w, HEADS, NOPE))),
                         ("W_UK alone: k3.mla_absorb_q", lambda w: ABSORB_Q(q_nope, w, NOPE, pdl))]
                alone += [(f"W_UK alone: Triton block_r {br}, {nw} warps",
                           lambda w, br=br, nw=nw: mla_absorb.absorb_triton(q_nope, w, NOPE, pdl, br, nw))
                          for br, nw in ABSORB_SWEEP]
                for name, fn in alone:
                    us = replay_us([lambda w=w: fn(w) for w in x["w_kv_b"]])
                    err = rel(fn(x["w_kv_b"][0]), mla_absorb.absorb_reference(q_nope.float(), x["w_kv_b"][0].float(),
                                                                              NOPE))
                    rows.append(dict(batch=batch, context=context, arm=name, us=round(us, 2), rel_err=err))
                    print(f"| {batch} | - | {name} | {us:.2f} | | {err:.2e} |", flush=True)
            del x
            torch.cuda.empty_cache()
    for n in notes:
        print(f"\nnote: {n}")
    print(f"\n({time.time() - t0:.0f} s; P15 options: p15_mla_decode.absorb_q=triton|fold, p15_mla_decode.prefetch_w_uv=true)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "pdl": pdl, "rows": rows, "notes": notes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
