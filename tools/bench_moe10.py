"""The MoE op's L2 prefetch options behind the router kernel (issue 9, helper moepf10).

Shape: one MoE layer of Kimi-Linear-48B (E=256, top-8, D=2304, I=1024, one shared expert Is=1024, SiLU), bf16
experts, batch 1, 2, 4, 8. Each timed call is what a step runs per MoE layer: `_norm_route_kernel` (RMSNorm + router
GEMV + top-k, latency-bound; kernels.norm_route) and then the op on its outputs (kernel A with the shared slot, B'),
everything launched with PDL and replayed from one CUDA graph (graph_timing.replay_us). Without the router kernel in
front, kernel A's programs would have nothing to overlap their prefetch with. Each call cycles over ROUTINGS argument
sets (bench_moe8's harness: different x, router-weight copies, routings, and shared-expert weight copies), so a replay
does not find the previous call's weights in L2.

Arms (fused_moe_triton options):
  * off: today's launch;
  * A order: kernel A's grid transposed (shared slot first in launch order) without the prefetch (the option with
    its prefetch forced off here: what the order alone costs or gains);
  * A prefetch: shared_l2_prefetch (order + the shared slot's gate/up rows asked of L2 before gdc_wait);
  * B' prefetch: down_l2_prefetch (B''s shared slot's W2 rows before its wait);
  * both.
Per batch and arm: chain µs (router + op), op µs = chain - the router kernel alone (same harness), their change vs
off, ROUNDS interleaved rounds (median reported, all kept in the json); every arm's outputs compared bit for bit with
off's on each argument set, and off's rel err vs the fp32 reference (first set). Writes moe10.md and moe10.json to OUT (argv[1]).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys

import torch

from k3compile.passes.kernels import moe_decode, moe_launch, norm_route
from k3compile.passes.kernels.graph_timing import replay_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe8 import ROUTINGS, SHAPE, layer  # noqa: E402
from bench_moe_kernels import bench_setup, rel_err, save_report  # noqa: E402

BATCHES = (1, 8, 2, 4)  # batch 1 (the target) and 8 first: a timeout keeps what is saved
ROUNDS = 3
# name -> (shared_l2_prefetch, down_l2_prefetch, A's prefetch allowed)
ARMS = {"off": (False, False, True), "A order": (True, False, False), "A prefetch": (True, False, True),
        "B' prefetch": (False, True, True), "both": (True, True, True)}


@contextlib.contextmanager
def a_prefetch_allowed(allowed: bool):
    """For the "A order" arm: kernel A's shared slot first, its prefetch off (moe_launch.shared_l2_launch)."""
    saved = moe_launch.shared_l2_launch
    if not allowed:
        moe_launch.shared_l2_launch = lambda asked, pdl, w, width: (asked, False)
    try:
        yield
    finally:
        moe_launch.shared_l2_launch = saved


def route_sets(spec, n: int, gen) -> list[dict]:
    """ROUTINGS router inputs (x, delta, norm and router weights, bias) and the layer's shared-weight copy of each."""
    d, e, dev = spec["d_in"], spec["e"], spec["w13"].device
    sets = []
    for r in range(ROUTINGS):
        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=dev) * scale).bfloat16()
        sw13, sw2 = spec["shared"][r]
        sets.append(dict(x=randn(n, d), delta=randn(n, d), norm_w=1 + 0.1 * randn(d), router=randn(e, d, scale=d ** -0.5),
                         bias=torch.zeros(e, device=dev), sw13=sw13, sw2=sw2))
    return sets


class Chain:
    """fn() runs the router kernel and (op=True) the MoE op on its outputs, on the next argument set."""

    def __init__(self, spec, sets, op: bool, shared_l2: bool = False, down_l2: bool = False):
        self.spec, self.sets, self.op, self.i = spec, sets, op, 0
        self.options = dict(shared_l2_prefetch=shared_l2, down_l2_prefetch=down_l2)

    def route(self, s):
        h, _, wts, ids = norm_route.norm_route_triton([], s["x"], s["delta"], None, s["norm_w"], 1e-6, 1e-6, s["bias"],
                                                      s["router"], self.spec["k"], True, 2.446, pdl=True)
        return h, ids, wts

    def run(self, s):
        h, ids, wts = self.route(s)
        if not self.op:
            return h
        spec = self.spec
        return moe_decode.fused_moe_triton(h, ids, wts, spec["w13"], spec["w2"], shared_w2=s["sw2"], act=spec["act"],
                                           shared_w13=s["sw13"], use_pdl=True, **self.options)

    def __call__(self):
        s = self.sets[self.i % len(self.sets)]
        self.i += 1
        return self.run(s)


def main(out_dir: str) -> None:
    bw, bandwidth, gen = bench_setup()
    os.makedirs(out_dir, exist_ok=True)
    spec = layer(gen)
    rows = []
    with torch.no_grad():
        for n in BATCHES:
            sets = route_sets(spec, n, gen)
            router = Chain(spec, sets, op=False)
            outs = {}
            for name, (a, b, allowed) in ARMS.items():
                with a_prefetch_allowed(allowed):
                    outs[name] = [Chain(spec, sets, True, a, b).run(s) for s in sets]
            torch.cuda.synchronize()
            s = sets[0]  # the fp32 reference of the first set (the GPU tests check the op at this shape)
            h, ids, wts = router.route(s)
            ref = moe_decode.fused_moe_reference(h.float(), ids, wts, spec["w13"].float(), spec["w2"].float(),
                                                 shared_w2=s["sw2"].float(), act=spec["act"],
                                                 shared_w13=s["sw13"].float()).float()
            err = rel_err(outs["off"][0], ref)
            times = {name: [] for name in ARMS}
            route_us = []
            for _ in range(ROUNDS):  # interleaved: a drift in clocks hits every arm alike
                route_us.append(replay_us([router] * (4 * ROUTINGS)))
                for name, (a, b, allowed) in ARMS.items():
                    with a_prefetch_allowed(allowed):
                        times[name].append(replay_us([Chain(spec, sets, True, a, b)] * (4 * ROUTINGS)))
            r_us = statistics.median(route_us)
            off = statistics.median(times["off"])
            for name in ARMS:
                chain = statistics.median(times[name])
                row = dict(batch=n, arm=name, chain_us=round(chain, 2), route_us=round(r_us, 2),
                           op_us=round(chain - r_us, 2), vs_off_us=round(chain - off, 2),
                           rounds_us=[round(t, 2) for t in times[name]],
                           same_bits=all(torch.equal(o, p) for o, p in zip(outs[name], outs["off"])), rel_err=err)
                rows.append(row)
                print(json.dumps(row), flush=True)
            save(out_dir, bw, bandwidth, rows)
    print(table(bandwidth, rows))


def table(bandwidth: float, rows: list[dict]) -> str:
    lines = [f"{SHAPE} MoE layer, bf16 experts, router kernel (_norm_route_kernel) + the op (A with the shared slot, "
             f"B'), PDL on, CUDA-graph replays, {ROUTINGS} argument sets (routings, router and shared-weight copies) "
             f"cycled; median of {ROUNDS} interleaved rounds; copy bandwidth (same run) {bandwidth:.1f} GB/s; "
             f"{torch.cuda.get_device_name()}", "",
             "| batch | arm | chain µs (router + op) | router alone µs | op µs (chain - router) | vs off µs | "
             "rounds µs | same bits as off | rel err (off vs fp32 ref) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['arm']} | {r['chain_us']} | {r['route_us']} | {r['op_us']} | "
                     f"{r['vs_off_us']:+} | {', '.join(map(str, r['rounds_us']))} | {r['same_bits']} | {r['rel_err']} |")
    return "\n".join(lines)


def save(out_dir, bw, bandwidth, rows) -> None:
    save_report(out_dir, "moe10", table(bandwidth, rows), {"copy_bandwidth": bw, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
