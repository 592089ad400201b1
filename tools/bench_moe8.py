"""The shared expert's gate/up GEMM in kernel A (issue 9, helper moe8): today's path vs the new one, per batch.

Shape: one MoE layer of Kimi-Linear-48B (E=256, top-8, D=2304, I=1024, one shared expert Is=1024, SiLU), bf16
experts, batch 1, 2, 4, 8; the designs kernel_designs() picks (rows up, split down). Arms:
  * "today": what the engine's graph runs without P6's fuse_shared_up: P1's merged shared gate/up GEMM
    (cuBLAS, mm(x, t(W13s)) then a split into two column views), then the op with shared_in / shared_up;
  * "new": the op with shared_w13 (kernel A runs the shared gate/up as one more slot; no GEMM);
each with PDL off and on. Each timed call cycles over ROUTINGS argument sets (different random routings,
x, and their own copy of the shared weights), so a replay does not find the previous call's weights in L2.

Per (batch, arm, PDL): op µs (the calls replayed from one CUDA graph: graph_timing.replay_us, launch gaps
included), per kernel mean device µs from torch.profiler (eager calls), kernels per call (distinct kernels),
bytes the arm must move (distinct experts' rows, the shared expert's weights, activations) as GB/s and % of the
same-run copy bandwidth, rel err vs the fp32 reference. Writes moe8.md and moe8.json to OUT (argv[1]).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

from k3compile.passes.kernels import moe_decode, moe_launch
from k3compile.passes.kernels.graph_timing import replay_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_kernels import bench_setup, kernel_bytes, kernel_times, rel_err, save_report  # noqa: E402

SHAPE = "kimi-linear-48b"
BATCHES = (1, 2, 4, 8)
ROUTINGS = 4


def layer(gen) -> dict:
    from k3compile.model_def.config import get_preset
    cfg = get_preset(SHAPE)
    e, k, i, d = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.hidden_size
    s = i * cfg.num_shared_experts

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()
    shared = [(randn(2 * s, d, scale=d ** -0.5), randn(d, s, scale=s ** -0.5)) for _ in range(ROUTINGS)]
    return dict(name=SHAPE, e=e, k=k, i=i, s=s, d_in=d, d_out=d, w13=randn(e, 2 * i, d, scale=d ** -0.5),
                w2=randn(e, d, i, scale=i ** -0.5), shared=shared, act="silu")


def problem(spec, n, gen):
    """ROUTINGS (x, ids, wts, shared_w13, shared_w2) sets, their fp32 references, mean bytes per call."""
    sets, refs, nbytes = [], [], 0.0
    for r in range(ROUTINGS):
        ids, wts = moe_decode.random_routing(n, spec["e"], spec["k"], "cuda", seed=1000 * n + r)
        x = torch.randn(n, spec["d_in"], generator=gen, device="cuda").bfloat16()
        sw13, sw2 = spec["shared"][r]
        sets.append((x, ids, wts, sw13, sw2))
        refs.append(moe_decode.fused_moe_reference(x.float(), ids, wts, spec["w13"].float(), spec["w2"].float(),
                                                   shared_w2=sw2.float(), act=spec["act"],
                                                   shared_w13=sw13.float()).float())
        # kernel_bytes: routed up + down (+ shared down, its activated input); the shared gate/up weights on top
        moved = sum(kernel_bytes(spec, n, int(ids.unique().numel()), False).values()) + sw13.numel() * 2
        nbytes += moved / ROUTINGS
    return sets, refs, nbytes


class Arm:
    """fn() runs one arm on the next argument set (cycling)."""

    def __init__(self, spec, sets, fused: bool, pdl: bool):
        self.spec, self.sets, self.fused, self.pdl, self.i = spec, sets, fused, pdl, 0

    def run(self, x, ids, wts, sw13, sw2):
        spec = self.spec
        if self.fused:
            return moe_decode.fused_moe_triton(x, ids, wts, spec["w13"], spec["w2"], shared_w2=sw2, act=spec["act"],
                                               shared_w13=sw13, use_pdl=self.pdl)
        gate, up = F.linear(x, sw13).split(sw13.shape[0] // 2, dim=1)  # P1's merged GEMM + split, as the graph
        return moe_decode.fused_moe_triton(x, ids, wts, spec["w13"], spec["w2"], shared_in=gate, shared_up=up,
                                           shared_w2=sw2, act=spec["act"], use_pdl=self.pdl)

    def __call__(self):
        args = self.sets[self.i % len(self.sets)]
        self.i += 1
        return self.run(*args)


def kernel_table(times: dict[str, float]) -> dict[str, float]:
    """Kernel names shortened: the routed kernels by role, anything else (cuBLAS) as 'shared GEMM'."""
    out = {}
    for name, us in times.items():
        role = name if name.startswith("_expert_") else "shared GEMM (cuBLAS)"
        out[role] = round(out.get(role, 0.0) + us, 2)
    return out


def main(out_dir: str) -> None:
    bw, bandwidth, gen = bench_setup()
    os.makedirs(out_dir, exist_ok=True)
    spec = layer(gen)
    rows = []
    with torch.no_grad():
        for n in BATCHES:
            sets, refs, nbytes = problem(spec, n, gen)
            for fused in (False, True):
                for pdl in (False, True):
                    arm = Arm(spec, sets, fused, pdl)
                    op_us = replay_us([arm] * (4 * ROUTINGS))
                    raw = kernel_times(arm, iters=5 * ROUTINGS)  # one entry per kernel the call launches
                    err = max(rel_err(arm.run(*a), ref) for a, ref in zip(sets, refs))
                    row = dict(batch=n, arm="new" if fused else "today", pdl=pdl, op_us=round(op_us, 2),
                               op_pct=round(100 * nbytes / op_us / 1e3 / bandwidth, 1), mbytes=round(nbytes / 1e6, 1),
                               kernels_per_call=len(raw), kernel_us=kernel_table(raw), rel_err=err,
                               designs=list(moe_launch.kernel_designs(n, False)))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            save(out_dir, bw, bandwidth, rows)
    print(table(bandwidth, rows))


def table(bandwidth: float, rows: list[dict]) -> str:
    lines = [f"{SHAPE} MoE layer, bf16 experts; copy bandwidth (same run) {bandwidth:.1f} GB/s; "
             f"{torch.cuda.get_device_name()}; {ROUTINGS} routings (and shared-weight copies) cycled per timed call; "
             "op µs from CUDA-graph replays, kernel µs from the profiler (eager)", "",
             "| batch | arm | PDL | op µs (graph) | MB moved | op % bw | kernels/call | shared GEMM µs | "
             "up (A) µs | down (B') µs | rel err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k = r["kernel_us"]
        up, down = k.get("_expert_up_kernel", ""), k.get("_expert_down_kernel", "")  # kernel_times' role names
        lines.append(f"| {r['batch']} | {r['arm']} | {'on' if r['pdl'] else 'off'} | {r['op_us']} | {r['mbytes']} | "
                     f"{r['op_pct']} | {r['kernels_per_call']:g} | {k.get('shared GEMM (cuBLAS)', '-')} | {up} | "
                     f"{down} | {r['rel_err']} |")
    return "\n".join(lines)


def save(out_dir, bw, bandwidth, rows) -> None:
    save_report(out_dir, "moe8", table(bandwidth, rows), {"copy_bandwidth": bw, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
