"""Microbenchmark (issue 9, kda9): P5's KDA decode kernel under each launch layout (model_def/ops/kda_launch.py;
only "s8" since "wide" was dropped after session 9's H200 run, see there), PDL off / wait first / prefetch,
behind a cuBLAS or a Triton-GEMV (P8, PDL) input projection; then a small launch sweep of the kernel alone
(explicit V split / block_v / warps, "wide"'s split 2 / 64 columns / 8 warps among them).

Every arm is a CUDA graph of `--layers` layers (distinct pool layers, a state pool of `--slots` slots, L2 flushed
before each replay: tools/bench_pdl_chain.time_chain), median µs per layer over `--replays` replays. The layout
arms call the op the engine runs (torch.ops.k3.fused_kda_decode with P5's use_pdl / prefetch / launch options),
so a row names exactly the P5 config that gives it: `--pass-opt p05_fused_kda_decode.launch=NAME` (and
`p16_kda_verify_inputs.launch=NAME`, which must match), `p05_fused_kda_decode.prefetch=false` for wait first.
"KDA adds" = chain minus the predecessor alone. Prints markdown; writes the rows as JSON to --out.

    python3 tools/bench_kda9.py --batch 1 8 --out kda9.json      (from the repository root or tools/)
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kda8 import ChainShape, chain_arguments, predecessor, sweep  # noqa: E402
from bench_kda_decode import check_split  # noqa: E402
from bench_pdl_chain import time_chain  # noqa: E402

from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, LAYOUTS, kda_launch  # noqa: E402
from k3compile.passes.kernels import gemv as gemv_kernels  # noqa: E402

PDL_ARMS = (("PDL off", False, True), ("PDL on, wait first", True, False), ("PDL on, prefetch", True, True))
# (v_split, block_v, num_warps) of the kernel alone, around s8's and the dropped "wide"'s choices
SWEEP = {"split": [(4, 32, 4), (4, 32, 8), (2, 64, 8), (2, 64, 4), (2, 32, 4), (2, 32, 8), (8, 16, 4)],
         "whole": [(1, 32, 4), (1, 64, 8), (1, 64, 4), (1, 128, 8), (1, 128, 16), (2, 64, 8), (2, 32, 4)]}


def op_chain(preds, layer_args, use_pdl, prefetch, layout, with_kda=True):
    """Per layer: the predecessor, then the op as P5's graphs call it."""
    def run():
        for pred, args in zip(preds, layer_args):
            pred()
            if with_kda:
                torch.ops.k3.fused_kda_decode(*args, use_pdl=use_pdl, prefetch=prefetch, launch=layout)
    return run


def layout_error(args, layout, prefetch) -> float:
    """Normwise relative error of the op under `layout` vs the reference (private pool copies)."""
    return check_split(args, None, prefetch=prefetch, layout=layout)


def main() -> None:
    a = chain_arguments(__doc__, [1, 8], 20).parse_args()
    shape = ChainShape(a)
    h, kd, pdl = shape.h, shape.kd, shape.pdl
    rows = []
    for b in a.batch:
        layer_args, x, weights = shape.inputs(b)
        launches = {name: kda_launch(name, b, h, kd, kd) for name in LAYOUTS}
        # a layout that picks the default's launch at this batch is the same kernel: timed once
        layouts = [DEFAULT_LAYOUT] + [n for n in LAYOUTS if launches[n] != launches[DEFAULT_LAYOUT]]
        print(f"\n### batch {b}\n")
        print("launches: " + "; ".join(f"{n} = V split {v.v_split}, block_v {v.block_v}, {v.num_warps} warps"
                                       for n, v in launches.items()) + "\n")
        print("| predecessor | layout | arm | µs/layer chain | µs/layer predecessor alone | KDA adds | rel err |")
        print("|---|---|---|---|---|---|---|")
        best = {}
        for kind in ("cublas", "gemv"):
            if kind == "gemv" and b > gemv_kernels.MAX_M:
                continue
            alone = {}
            for name, use_pdl, prefetch in PDL_ARMS:
                if use_pdl and not pdl:
                    continue
                preds = [predecessor(kind, x, w, use_pdl) for w in weights]
                if use_pdl not in alone:
                    alone[use_pdl] = time_chain(op_chain(preds, layer_args, use_pdl, prefetch, DEFAULT_LAYOUT, False),
                                                a.replays, a.layers)
                for layout in layouts:
                    t = time_chain(op_chain(preds, layer_args, use_pdl, prefetch, layout), a.replays, a.layers)
                    err = layout_error(layer_args[0], layout, prefetch)
                    row = dict(batch=b, predecessor=kind, layout=layout, arm=name, use_pdl=use_pdl, prefetch=prefetch,
                               launch=dataclasses.asdict(launches[layout]), us_chain=t, us_predecessor=alone[use_pdl],
                               us_kda_adds=t - alone[use_pdl], rel_err=err)
                    rows.append(row)
                    if kind not in best or t < best[kind]["us_chain"]:
                        best[kind] = row
                    print(f"| {kind} | {layout} | {name} | {t:.2f} | {alone[use_pdl]:.2f} | {t - alone[use_pdl]:.2f} "
                          f"| {err:.2e} |", flush=True)
        for kind, r in best.items():
            print(f"\nfastest chain behind {kind} at batch {b}: layout {r['layout']}, {r['arm']} "
                  f"({r['us_chain']:.2f} µs/layer)")
        if not a.no_sweep:
            configs = SWEEP["split" if launches[DEFAULT_LAYOUT].v_split > 1 else "whole"]
            rows += sweep(b, layer_args, configs, pdl, a.replays)
        del layer_args, weights
        torch.cuda.empty_cache()
        if a.out:  # after each batch: a timeout keeps what was measured
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
