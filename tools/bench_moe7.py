"""Fused MoE decode, per kernel design (issue 9, helper moe7): the down-projection's "rows", "tiles" and
"split" designs side by side at small batches, against a same-run copy bandwidth. Run by tools/gpu_moe7.sh.

Shapes: one MoE layer of Kimi-Linear-48B and of k3-mini-6b (bench_moe_kernels.layer); experts bf16 and
MXFP4 ("rows" is dense only); batch 1, 2, 4, 8; PDL off and on. The up-projection runs the design
kernel_designs() gives it (so only the down-projection differs between rows of a batch).
Each timed call cycles over ROUTINGS uniformly random routings (different experts each call), so a
replay does not find the previous call's experts in the 50 MB L2 (as in the engine, where 26 other
layers run in between).

Per (shape, experts, batch, design, PDL):
  * op µs: the whole op replayed from a CUDA graph (graph_timing.replay_us), launch gaps included;
  * per kernel: mean device µs from torch.profiler over eager calls, bytes it must move
    (bench_moe_kernels.kernel_bytes: the distinct experts' rows, shared / latent weights, activations),
    GB/s and % of the copy bandwidth;
  * rel err against the fp32 reference (fused_moe_reference on upcast inputs).
Then a BLOCK_N sweep of the split design (TUNED entries, one at a time, PDL off) at the 48B shape,
bf16 and MXFP4, batch 1 and 8. Prints markdown tables; writes moe7.md and moe7.json to OUT (argv[1]),
rewritten after each shape (a run cut short keeps what it finished).
"""
from __future__ import annotations

import json
import os
import sys

import torch

from k3compile.passes.kernels import moe_decode, moe_launch
from k3compile.passes.kernels.graph_timing import replay_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_kernels import (bench_setup, kernel_bytes, kernel_rows, kernel_times, layer, op_args,  # noqa: E402
                               rel_err)

BATCHES = (1, 2, 4, 8)
ROUTINGS = 4
SPLIT_SWEEP = [(8, 1024, 4), (16, 512, 4), (32, 256, 4), (64, 128, 4), (16, 256, 4), (32, 256, 8)]


class Cycle:
    """fn() runs the op on the next of several argument sets (different routings)."""

    def __init__(self, sets, **kw):
        self.sets, self.kw, self.i = sets, kw, 0

    def __call__(self):
        args, kw = self.sets[self.i % len(self.sets)]
        self.i += 1
        return moe_decode.fused_moe_triton(*args, **kw, **self.kw)


def problem(spec, n, quant, gen):
    """ROUTINGS argument sets, their fp32 references and the mean bytes per kernel."""
    sets, refs, nbytes = [], [], {}
    for r in range(ROUTINGS):
        args, kw = op_args(spec, n, quant, gen)
        ids, wts = moe_decode.random_routing(n, spec["e"], spec["k"], "cuda", seed=1000 * n + r)
        args = (args[0], ids, wts, *args[3:])
        sets.append((args, kw))
        up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t  # noqa: E731
        refs.append(moe_decode.fused_moe_reference(*map(up, args), **{key: up(v) for key, v in kw.items()}).float())
        for name, b in kernel_bytes(spec, n, int(ids.unique().numel()), quant).items():
            nbytes[name] = nbytes.get(name, 0.0) + b / ROUTINGS
    return sets, refs, nbytes


def bench_designs(spec, quant, bandwidth, gen, rows):
    for n in BATCHES:
        sets, refs, nbytes = problem(spec, n, quant, gen)
        up = moe_launch.kernel_designs(n, quant)[0]
        for down in moe_launch.DOWN_DESIGNS:
            if quant and down == "rows":
                continue
            for pdl in (False, True):
                fn = Cycle(sets, designs=(up, down), use_pdl=pdl)
                op_us = replay_us([fn] * (4 * ROUTINGS))  # each set 4 times per replay, median of 5 replays
                times = kernel_times(fn, iters=5 * ROUTINGS)
                err = max(rel_err(moe_decode.fused_moe_triton(*a, **kw, designs=(up, down)), ref)
                          for (a, kw), ref in zip(sets, refs))
                total = sum(nbytes.values())
                row = dict(shape=spec["name"], experts="mxfp4" if quant else "bf16", batch=n, up=up, down=down,
                           default=moe_launch.kernel_designs(n, quant) == (up, down), pdl=pdl,
                           op_us=round(op_us, 2), op_pct=round(100 * total / op_us / 1e3 / bandwidth, 1),
                           rel_err=err, kernels=kernel_rows(nbytes, times, bandwidth))
                rows.append(row)
                print(json.dumps(row), flush=True)


def split_sweep(spec, quant, bandwidth, gen, out):
    for n in (1, 8):
        sets, _, nbytes = problem(spec, n, quant, gen)
        up = moe_launch.kernel_designs(n, quant)[0]
        key = ("split", n * (spec["k"] + 1), spec["d_out"], spec["i"], quant)
        rule = moe_launch.gemv_config(*key)
        saved = moe_launch.TUNED.get(key)
        for cfg in SPLIT_SWEEP:
            moe_launch.TUNED[key] = cfg
            try:
                us = kernel_times(Cycle(sets, designs=(up, "split")), iters=3 * ROUTINGS)["_expert_down_kernel"]
            finally:
                moe_launch.TUNED.pop(key)
                if saved is not None:
                    moe_launch.TUNED[key] = saved
            pct = 100 * nbytes["_expert_down_kernel"] / us / 1e3 / bandwidth
            out.append(dict(experts="mxfp4" if quant else "bf16", batch=n, config=list(cfg), rule=list(rule),
                            us=round(us, 2), pct=round(pct, 1)))
            print(json.dumps(out[-1]), flush=True)


def tables(bandwidth, rows, sweep) -> str:
    lines = [f"copy bandwidth (same run): {bandwidth:.1f} GB/s; {torch.cuda.get_device_name()}; "
             f"{ROUTINGS} routings cycled per timed call; * = kernel_designs()' current choice", "",
             "| shape | experts | batch | up | down | PDL | op µs (graph) | op % bw | up µs | up % bw | down µs | "
             "down MB | down GB/s | down % bw | latent µs | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k = r["kernels"]
        upk, dk = k["_expert_up_kernel"], k["_expert_down_kernel"]
        lat = k.get("_latent_out_kernel", {}).get("us", "")
        mark = "*" if r["default"] else ""
        lines.append(f"| {r['shape']} | {r['experts']} | {r['batch']} | {r['up']} | {r['down']}{mark}"
                     f" | {'on' if r['pdl'] else 'off'} | {r['op_us']} | {r['op_pct']} | {upk['us']} | {upk['pct']} | "
                     f"{dk['us']} | {dk['mbytes']} | {dk['gbps']} | {dk['pct']} | {lat} | {r['rel_err']} |")
    if sweep:
        lines += ["", "split design, BLOCK_N sweep (kimi-linear-48b, down kernel only, PDL off)", "",
                  "| experts | batch | [BLOCK_N, BLOCK_K, warps] | rule | down µs | % bw |", "|---|---|---|---|---|---|"]
        lines += [f"| {s['experts']} | {s['batch']} | {s['config']} | {s['rule']} | {s['us']} | {s['pct']} |"
                  for s in sweep]
    return "\n".join(lines)


def main(out_dir: str) -> None:
    bw, bandwidth, gen = bench_setup()
    os.makedirs(out_dir, exist_ok=True)
    rows, sweep = [], []

    def save():
        with open(os.path.join(out_dir, "moe7.md"), "w") as f:
            f.write(tables(bandwidth, rows, sweep) + "\n")
        with open(os.path.join(out_dir, "moe7.json"), "w") as f:
            json.dump({"copy_bandwidth": bw, "rows": rows, "split_sweep": sweep}, f, indent=1)

    # most wanted first (the 48B bf16 layer), saved after each block: a run cut short keeps what it finished
    for name in ("kimi-linear-48b", "k3-mini-6b"):
        spec = layer(name, gen)
        with torch.no_grad():
            for quant in (False, True):
                bench_designs(spec, quant, bandwidth, gen, rows)
                save()
                if name == "kimi-linear-48b":
                    split_sweep(spec, quant, bandwidth, gen, sweep)
                    save()
        del spec
        torch.cuda.empty_cache()
    print(tables(bandwidth, rows, sweep))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
