"""One-launch-at-a-time sweep of the fused MoE decode op at one layer shape (issue 9): the harness of
tools/bench_moe10mini.py (k3-mini-6b latent MoE) and tools/bench_moe11.py (Kimi-Linear-48B full width).

A shape (a `Shape` subclass) gives per batch: ROUTINGS argument sets with their fp32 references and the bytes each
kernel must move (bench_moe_kernels.kernel_bytes), today's launches (a dict: one value per launch key, e.g. "A" kernel
A's tile, "B" kernel B''s SplitConfig), the arms (name, launches: today's with one key's value changed, or a few keys
for an arm that needs them together) and how to run the op with a launch dict. Each timed call cycles over the
argument sets (different routings, inputs and per-set weight copies), so a replay does not find the previous call's
weights in L2.

Per (batch, arm): op µs (calls replayed from one CUDA graph, PDL on: graph_timing.replay_us); each kernel's device µs
from torch.profiler (eager, PDL on) and its bytes as % of the same-run copy bandwidth; rel err vs the fp32 reference.
Then "combo": per launch key, the value of the fastest arm (rel err < TOL) that changed it, all together (if not
measured yet). Per batch the fastest arm, and the shape's lines that make it the default. Results are saved after
every arm; a batch starts only while the time budget lasts and stops its arms GRACE_S after it (the fastest of what
it measured still reported): a timeout keeps what is saved.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from k3compile.passes.kernels import moe_decode, moe_launch
from k3compile.passes.kernels.graph_timing import replay_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_kernels import bench_setup, kernel_bytes, kernel_times, rel_err, save_report  # noqa: E402

ROUTINGS = 4
TOL = 1e-2  # the GPU tests' bound
GRACE_S = 18  # a batch started within the budget may run this much past it, then its remaining arms are dropped


class Shape:
    """What the sweep needs of one MoE layer shape; see the module doc. Launch values are lists/tuples of ints."""
    stem = ""  # the report's file name (OUT/<stem>.md, .json)
    batches: tuple[int, ...] = ()
    kernels: dict[str, str] = {}  # column letter -> kernel name in bench_moe_kernels.kernel_times
    header = ""  # the report's first paragraph

    spec: dict = {}  # the layer (bench_moe_kernels.kernel_bytes' keys, plus the weights the shape's `args` use)

    def args(self, n: int, r: int, ids, wts, gen) -> dict:
        """fused_moe_triton's kwargs for argument set r at batch n (routing ids, wts given)."""
        raise NotImplementedError

    def extra_bytes(self, n: int) -> dict[str, float]:
        """Bytes a kernel moves beyond bench_moe_kernels.kernel_bytes' count (per call)."""
        return {}

    def problem(self, n: int, gen) -> tuple[list[dict], list[torch.Tensor], dict[str, float]]:
        """ROUTINGS argument sets (`args`), their fp32 references, mean bytes per kernel a call."""
        spec = self.spec
        sets, refs, nbytes = [], [], {name: 0.0 for name in self.kernels.values()}
        for r in range(ROUTINGS):
            ids, wts = moe_decode.random_routing(n, spec["e"], spec["k"], "cuda", seed=1000 * n + r)
            kw = self.args(n, r, ids, wts, gen)
            sets.append(kw)
            refs.append(moe_decode.fused_moe_reference(**{key: v.float() if isinstance(v, torch.Tensor)
                                                          and v.dtype == torch.bfloat16 else v
                                                          for key, v in kw.items()}).float())
            for name, b in kernel_bytes(spec, n, int(ids.unique().numel()), False).items():
                nbytes[name] += b / ROUTINGS
        for name, b in self.extra_bytes(n).items():
            nbytes[name] += b
        return sets, refs, nbytes

    def today(self, n: int) -> dict:
        raise NotImplementedError

    def arms(self, n: int, best: list[dict]) -> list[tuple[str, dict]]:
        """(name, launches) after "today"; `best`: the earlier batches' results (what they picked may go first)."""
        raise NotImplementedError

    def run(self, n: int, kw: dict, launches: dict) -> torch.Tensor:
        raise NotImplementedError

    def keys(self, n: int) -> dict:
        """The launch tables' keys at batch n: "A" ROWS_TUNED's, "B" SPLIT_TUNED's (and the shape's own)."""
        raise NotImplementedError

    def entries(self, n: int, launches: dict) -> list[str]:
        """The lines (table entries, P6 options) that make `launches` what the engine runs at batch n: here kernel
        A's and B''s table entries; a shape adds its other keys'."""
        kk, base, lines = self.keys(n), self.today(n), []
        if tuple(launches["A"]) != tuple(base["A"]):
            lines.append(f"ROWS_TUNED: {kk['A']!r}: {tuple(launches['A'])!r},")
        if tuple(launches["B"]) != tuple(base["B"]):
            lines.append(f"SPLIT_TUNED: {kk['B']!r}: {moe_launch.SplitConfig(*launches['B'])!r},")
        return lines


class Arm:
    """fn() runs the op with the arm's launches on the next argument set (cycling)."""

    def __init__(self, shape, n, sets, launches: dict):
        self.shape, self.n, self.sets, self.launches, self.i = shape, n, sets, launches, 0

    def run(self, kw):
        return self.shape.run(self.n, kw, self.launches)

    def __call__(self):
        kw = self.sets[self.i % len(self.sets)]
        self.i += 1
        return self.run(kw)


def _plain(launches: dict) -> dict:
    return {key: list(v) if isinstance(v, (tuple, list)) else v for key, v in launches.items()}


def measure(shape, n, case, bandwidth, name, launches) -> dict | None:
    sets, refs, nbytes = case
    try:
        timed = Arm(shape, n, sets, launches)
        op_us = replay_us([timed] * (4 * len(sets)))
        raw = kernel_times(timed, iters=5 * len(sets))
        err = max(rel_err(timed.run(kw), ref) for kw, ref in zip(sets, refs))
    except Exception as exc:  # one bad candidate must not cost the rest of the sweep
        print(f"batch {n} {name} {launches}: {type(exc).__name__}: {exc}", flush=True)
        return None
    row = dict(batch=n, arm=name, launches=_plain(launches), op_us=round(op_us, 2),
               op_pct=round(100 * sum(nbytes.values()) / op_us / 1e3 / bandwidth, 1), rel_err=err)
    for col, kname in shape.kernels.items():
        us = raw.get(kname, float("nan"))
        row[col] = dict(us=round(us, 2), mbytes=round(nbytes[kname] / 1e6, 2),
                        pct=round(100 * nbytes[kname] / us / 1e3 / bandwidth, 1))
    print(json.dumps(row), flush=True)
    return row


def combo(today: dict, rows: list[dict]) -> dict:
    """Per launch key, the value of the fastest valid arm that changed it from today (today's if none beat today)."""
    ok = sorted((r for r in rows if r["rel_err"] < TOL), key=lambda r: r["op_us"])
    base = next(r for r in rows if r["arm"] == "today")
    out = dict(today)
    for key in today:
        win = next((r for r in ok if r["launches"][key] != today[key]), None)
        if win is not None and win["op_us"] < base["op_us"]:
            out[key] = win["launches"][key]
    return out


def sweep(shape: Shape, out_dir: str, budget_s: float, batches=None) -> None:
    start = time.monotonic()
    bw, bandwidth, gen = bench_setup()
    os.makedirs(out_dir, exist_ok=True)
    rows, best = [], []

    def save():
        save_report(out_dir, shape.stem, table(shape, bandwidth, rows, best),
                    {"copy_bandwidth": bw, "rows": rows, "best": best})
    with torch.no_grad():
        for n in batches or shape.batches:
            if time.monotonic() - start > budget_s:
                print(f"time budget {budget_s:.0f} s spent: batch {n} and later not run", flush=True)
                break
            case = shape.problem(n, gen)
            today = _plain(shape.today(n))
            batch_rows = []
            for name, launches in [("today", today)] + shape.arms(n, best):
                if time.monotonic() - start > budget_s + GRACE_S:
                    print(f"batch {n}: time budget spent, remaining arms not run", flush=True)
                    break
                row = measure(shape, n, case, bandwidth, name, launches)
                if row is not None:
                    batch_rows.append(row)
                    rows.append(row)
                    save()
            if not any(r["arm"] == "today" for r in batch_rows):
                continue
            both = combo(today, batch_rows)
            if time.monotonic() - start < budget_s + GRACE_S and both != today and all(
                    both != r["launches"] for r in batch_rows):
                row = measure(shape, n, case, bandwidth, "combo", both)
                if row is not None:
                    batch_rows.append(row)
                    rows.append(row)
            base = next(r for r in batch_rows if r["arm"] == "today")
            win = min((r for r in batch_rows if r["rel_err"] < TOL), key=lambda r: r["op_us"], default=base)
            best.append(dict(batch=n, today=base, best=win, entries=shape.entries(n, win["launches"])))
            save()
    print(table(shape, bandwidth, rows, best))


def _launch(r) -> str:
    return " / ".join(f"{key} {tuple(v) if isinstance(v, list) else v}" for key, v in r["launches"].items())


def table(shape: Shape, bandwidth: float, rows: list[dict], best: list[dict]) -> str:
    cols = list(shape.kernels)
    lines = [f"{shape.header}; copy bandwidth (same run) {bandwidth:.1f} GB/s; {torch.cuda.get_device_name()}; "
             f"{ROUTINGS} routings (and weight copies) cycled per timed call; op µs from CUDA-graph replays with PDL "
             "on, kernel µs from the profiler (eager, PDL on); arm = the launch key varied", "",
             "| batch | arm | launches | op µs | op % bw | " + " | ".join(f"{c} µs (% bw)" for c in cols)
             + f" | MB {'/'.join(cols)} | rel err |", "|---" * (7 + len(cols)) + "|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['arm']} | {_launch(r)} | {r['op_us']} | {r['op_pct']} | "
                     + " | ".join(f"{r[c]['us']} ({r[c]['pct']})" for c in cols)
                     + f" | {'/'.join(str(r[c]['mbytes']) for c in cols)} | {r['rel_err']} |")
    lines += ["", f"Fastest arm per batch (op µs, rel err < {TOL:g}) vs today:", "",
              "| batch | today op µs | best arm | best launches | best op µs | speed-up |",
              "|---|---|---|---|---|---|"]
    for b in best:
        t, w = b["today"], b["best"]
        lines.append(f"| {b['batch']} | {t['op_us']} | {w['arm']} | {_launch(w)} | {w['op_us']} | "
                     f"{t['op_us'] / w['op_us']:.3f}x |")
    lines += ["", "What makes each batch's winner the default (passes/kernels/moe_decode.py tables: key: value,; "
              "P6 options):", ""]
    for b in best:
        lines.append(f"- batch {b['batch']}: " + ("; ".join(f"`{e}`" for e in b["entries"]) or "none (today wins)"))
    return "\n".join(lines)
