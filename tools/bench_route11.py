"""P7's norm_route launch options, timed (issue 9, route11; run by tools/gpu_route11.sh).

The op sits between o_proj and the MoE's kernel A at batch 1: kernel A's programs wait (gdc_wait) until the whole
norm_route grid, its last-arriving program's routing tail included, has finished. So each arm is timed as a chain
of norm_route calls captured in one CUDA graph with PDL on: call i+1's static loads (router weight W) overlap call
i, and its wait ends when call i has completed, which is what the time per call then measures. The calls rotate
over enough copies of W (and its bias) to overflow L2 (graph_timing.copies_to_overflow_l2), as a decode step reads
W from HBM. Arms (norm_route_triton's tail / target_programs, P7's options of the same names):

  rounds      today: k argmax rounds, the picks' logits read again from the workspace row, acq_rel counter reset
  lean        the same rounds; weights gathered from registers; relaxed (fire-and-forget) counter reset
  bitonic     lean with a tl.topk bitonic network instead of the rounds
  *_t32       target_programs=32: fewer, wider programs (48B batch 1: 64 programs of 4 experts instead of 128 of
              2; k3-mini-6b batch 1: 48 of 2 instead of 96 of 1; batch 8: k3-mini 96 of 8 instead of 192 of 4)

Shapes: Kimi-Linear-48B (D=2304, no AttnRes bank, E=256 top-8) and k3-mini-6b (D=2048, a 4-row bank, E=96 top-8),
batch 1 and 8. The arms run interleaved, 3 rounds, median per arm. Agreement with rounds: ids equal (%), h equal,
weights' max relative difference. Writes route11.json and route11.md to OUT (argv[1]); prints the table.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from k3compile.passes.kernels import norm_route

ARMS = {"rounds": dict(tail="rounds"), "lean": dict(tail="lean"), "bitonic": dict(tail="bitonic"),
        "rounds_t32": dict(tail="rounds", target_programs=32), "lean_t32": dict(tail="lean", target_programs=32),
        "bitonic_t32": dict(tail="bitonic", target_programs=32)}
SHAPES = {"kimi-linear-48b": (2304, 0, 256, 8, 2.446), "k3-mini-6b": (2048, 4, 96, 8, 1.0)}
BATCHES = (1, 8)
ROUNDS = 3


def _inputs(shape: str, batch: int, gen: torch.Generator):
    """(norm args, route args, [(W, bias)] copies): the op's inputs at a shape, W copies enough to overflow L2."""
    from k3compile.passes.kernels.graph_timing import copies_to_overflow_l2
    dim, bank_rows, experts, top_k, scaling = SHAPES[shape]
    dev = "cuda"
    bank = [torch.randn(batch, dim, generator=gen, device=dev).bfloat16() for _ in range(bank_rows)]
    x, delta = (torch.randn(batch, dim, generator=gen, device=dev).bfloat16() for _ in range(2))
    query = 0.05 * torch.randn(dim, generator=gen, device=dev) if bank_rows else None
    norm_w = (1 + 0.1 * torch.randn(dim, generator=gen, device=dev)).bfloat16()
    copies = copies_to_overflow_l2(experts * dim * 2, most=256)
    weights = [((torch.randn(experts, dim, generator=gen, device=dev) / dim ** 0.5).bfloat16(),
                0.01 * torch.randn(experts, generator=gen, device=dev)) for _ in range(copies)]
    return (bank, x, delta, query, norm_w, 1e-5, 1e-6), (top_k, True, scaling, 1, 1), weights


def _time_arms(norm, route, weights) -> dict[str, float]:
    from k3compile.passes.kernels.graph_timing import replay_us
    runs: dict[str, list[float]] = {name: [] for name in ARMS}
    for _ in range(ROUNDS):  # interleaved: drift (clocks, other tenants) hits every arm alike
        for name, arm in ARMS.items():
            calls = [lambda w=w, b=b, arm=arm: norm_route.norm_route_triton(*norm, b, w, *route, pdl=True, **arm)
                     for w, b in weights]
            runs[name].append(replay_us(calls))
    return {name: round(statistics.median(us), 2) for name, us in runs.items()}


def _agreement(norm, route, weights) -> dict[str, dict]:
    w, b = weights[0]
    h0, _, w0, ids0 = norm_route.norm_route_triton(*norm, b, w, *route, pdl=True)
    out = {}
    for name, arm in ARMS.items():
        h, _, wt, ids = norm_route.norm_route_triton(*norm, b, w, *route, pdl=True, **arm)
        out[name] = dict(ids_equal_pct=round((ids == ids0).all(-1).float().mean().item() * 100, 1),
                         h_equal=bool(torch.equal(h, h0)),
                         weights_max_rel=float(f"{((wt - w0).abs() / w0.abs()).max().item():.3g}"))
    return out


def main(out: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape, (dim, bank_rows, experts, _, _) in SHAPES.items():
        for batch in BATCHES:
            norm, route, weights = _inputs(shape, batch, gen)
            us = _time_arms(norm, route, weights)
            blocks = {name: norm_route.default_blocks(batch, experts, dim, bank_rows,
                                                      arm.get("target_programs", norm_route.TARGET_PROGRAMS))[0]
                      for name, arm in ARMS.items()}
            row = dict(shape=shape, batch=batch, w_copies=len(weights), us=us, block_e=blocks,
                       agreement=_agreement(norm, route, weights))
            print(json.dumps(row), flush=True)
            rows.append(row)
            del weights
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rounds=ROUNDS)
    with open(os.path.join(out, "route11.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    names = list(ARMS)
    lines = [f"# norm_route launch options (P7 tail / target_programs), {meta['device']}", "",
             "µs per call: a chain of norm_route calls (PDL on) replayed from one CUDA graph, W copies overflowing "
             f"L2; median of {ROUNDS} interleaved rounds (each the median of 5 replays). ratio = rounds / arm "
             "(> 1: faster).",
             "", "| shape | batch | " + " | ".join(f"{n} µs (ratio, BLOCK_E)" for n in names)
             + " | ids equal % (min) |",
             "|---|---:|" + "---:|" * (len(names) + 1)]
    for r in rows:
        base = r["us"]["rounds"]
        cells = [f"{r['us'][n]} ({base / r['us'][n]:.3f}x, {r['block_e'][n]})" for n in names]
        agree = min(a["ids_equal_pct"] for a in r["agreement"].values())
        lines.append(f"| {r['shape']} | {r['batch']} | " + " | ".join(cells) + f" | {agree} |")
    with open(os.path.join(out, "route11.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
