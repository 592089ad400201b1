"""k3compile bench compaction: what a unified-arena compaction move costs next to a decode step.

In one process, over one UnifiedArena holding a decode batch: time the decode step (CUDA graphs
through the executor on a GPU) and time `free` of a block in the middle of each band, which moves
the band's end block into the hole (one device copy + index bookkeeping). Arms are interleaved
(decode, slot move, page move, decode, ...) per docs/BENCHMARKS.md; the claim is the ratio.
"""
from __future__ import annotations

import os
import statistics

import torch

from k3compile.bench.results import environment, write_json
from k3compile.bench.timing import summarize, sync, time_steps
from k3compile.info import DTYPES
from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.loader import load_model
from k3compile.runtime.executor import Executor
from k3compile.runtime.memory.unified import UnifiedArena


def register(sub) -> None:
    p = sub.add_parser("compaction", help="unified-arena compaction move time vs a decode step")
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--spare-slots", type=int, default=8, help="extra slots allocated so frees land mid-band")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per repetition")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", default="traces/compaction")
    p.set_defaults(func=run)


def _time_one(fn, device) -> float:
    sync(device)
    return time_steps(fn, 1, device)


def measure(model, batch_size: int, context: int, page_size: int, spare_slots: int, steps: int, reps: int,
            warmup: int, device: torch.device) -> dict:
    spec = model.cache_spec()
    pages_per_req = (context + 1 + page_size - 1) // page_size
    n_slots, n_pages = batch_size + spare_slots + 2, batch_size * pages_per_req + spare_slots + 2
    budget = (n_slots + 2) * spec.slot_bytes + (n_pages + 2) * spec.page_bytes(page_size)
    arena = UnifiedArena.from_budget(spec, budget, page_size, device)
    slots = [arena.alloc_slot() for _ in range(batch_size)]
    tables = [arena.alloc_pages(pages_per_req) for _ in range(batch_size)]
    moved = {}  # index renames reported by compaction, so the decode batch follows its blocks

    def follow(kind, old, new):
        moved[(kind, old)] = new
    arena.add_relocation_listener(follow)

    def batch():
        s = [moved.get(("slot", x), x) for x in slots]
        t = [[moved.get(("page", p), p) for p in row] for row in tables]
        return ForwardBatch.build("decode", [[1]] * batch_size, [context] * batch_size, t, s, page_size,
                                  device=device, max_pages=pages_per_req)

    ex = Executor(model, arena.tensors, device=device, max_context=pages_per_req * page_size,
                  buckets=(batch_size,))
    b = batch()
    decode = lambda: ex.run(b)  # noqa: E731
    for _ in range(warmup):
        decode()

    samples = {"decode_ms": [], "slot_move_ms": [], "page_move_ms": []}
    for _ in range(reps):
        samples["decode_ms"].append(time_steps(decode, steps, device))
        mid, end = arena.alloc_slot(), arena.alloc_slot()  # freeing mid moves end (the band's top) into it
        samples["slot_move_ms"].append(_time_one(lambda: arena.free_slot(mid), device))
        arena.free_slot(moved.pop(("slot", end), end))
        pmid, pend = arena.alloc_pages(1)[0], arena.alloc_pages(1)[0]
        samples["page_move_ms"].append(_time_one(lambda: arena.free_pages([pmid]), device))
        arena.free_pages([moved.pop(("page", pend), pend)])
        b = batch()  # the executor's next run must see indices after any relocation
    dec = statistics.median(samples["decode_ms"])
    stats = arena.compaction_stats()
    return {
        "slot_bytes": spec.slot_bytes, "page_bytes": spec.page_bytes(page_size),
        "decode": summarize(samples["decode_ms"]), "slot_move": summarize(samples["slot_move_ms"]),
        "page_move": summarize(samples["page_move_ms"]),
        "slot_move_vs_decode_pct": 100 * statistics.median(samples["slot_move_ms"]) / dec,
        "page_move_vs_decode_pct": 100 * statistics.median(samples["page_move_ms"]) / dec,
        "compaction_stats": stats, "samples": samples,
    }


def run(args) -> int:
    device = torch.device(args.device)
    model = load_model(args.model, dtype=DTYPES[args.dtype], device=device, progress=False)
    res = measure(model, args.batch, args.context, args.page_size, args.spare_slots, args.steps, args.reps,
                  args.warmup, device)
    doc = {"bench": "compaction", "config": vars(args) | {"func": None}, "environment": environment(device),
           "result": res}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "compaction.json"), doc)
    md = render(doc)
    with open(os.path.join(args.out, "compaction.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def render(doc: dict) -> str:
    r, c = doc["result"], doc["config"]
    env = doc["environment"]
    mb = lambda x: f"{x / 1e6:.2f} MB"  # noqa: E731
    lines = [
        f"# compaction move vs decode step: {c['model']} {c['dtype']}, batch {c['batch']}, context {c['context']}",
        "",
        f"Device: {env.get('device', {}).get('name', '?')}; {c['reps']} reps interleaved (decode x {c['steps']} "
        f"steps, one slot move, one page move). Page size {c['page_size']}.",
        "",
        "| what | bytes moved | median ms | p10–p90 ms | vs decode step |",
        "|---|---:|---:|---:|---:|",
        f"| decode step (CUDA graph on the arena) | – | {r['decode']['median_ms']:.4f} | "
        f"{r['decode']['p10_ms']:.4f}–{r['decode']['p90_ms']:.4f} | 100% |",
        f"| free a mid-band state slot (moves one slot) | {mb(r['slot_bytes'])} | {r['slot_move']['median_ms']:.4f} | "
        f"{r['slot_move']['p10_ms']:.4f}–{r['slot_move']['p90_ms']:.4f} | {r['slot_move_vs_decode_pct']:.2f}% |",
        f"| free a mid-band KV page (moves one page) | {mb(r['page_bytes'])} | {r['page_move']['median_ms']:.4f} | "
        f"{r['page_move']['p10_ms']:.4f}–{r['page_move']['p90_ms']:.4f} | {r['page_move_vs_decode_pct']:.2f}% |",
        "",
        f"Compaction stats: {r['compaction_stats']}",
    ]
    return "\n".join(lines) + "\n"
