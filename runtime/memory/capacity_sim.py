"""Allocator-only capacity simulation: how many requests fit a memory budget, unified vs split.

Issue 5's benchmark also runs the allocator alone with K3's real byte sizes. Real K3-sized buffers
are not needed for that: the memory managers are built on the "meta" device, which keeps every
index, byte offset, compaction move and relocation callback real but stores nothing, so a 100+ GB
budget is simulated in a few MB of host memory.

The model of serving is deliberately small and the same for every allocator:

* time advances in decode steps; every running request produces one token per step;
* a running request holds 1 KDA state slot plus ceil(kv_tokens / page_size) KV pages; it needs a
  new page when its KV length crosses a page boundary; its last token needs no KV;
* FCFS admission: the head of the queue is admitted (prefill is instant) when its slot and pages
  fit together with the pages reserved for decode growth. Like SGLang's `new_token_ratio`, each
  admitted request reserves pages for `reserve_ratio` of its remaining output (at least its next
  token), decreasing as it actually grows; the ratio is a constant here, not SGLang's decaying
  estimate. A request that does not fit that way into empty memory is rejected;
* when a page cannot be allocated, the newest running request is retracted: its blocks are freed
  and it goes back to the front of the queue, keeping the tokens it generated (re-prefilled on
  readmission, as SGLang does).

Reported per run: max concurrent requests; peak KV tokens resident at once; tokens served
(prefill + decode) before the step of the first retraction; retractions; finished requests;
makespan in steps; and, for the unified arena, its compaction statistics. Note that the tokens
before the first retraction reward caution as much as capacity: an allocator that admits more
requests can reach the point where decode growth no longer fits sooner, so read it together with
the makespan.

Default split ratio: SGLang's `--mamba-full-memory-ratio` defaults to 0.9 and sizes the state pool
as budget * r / (1 + r), i.e. 0.9 / 1.9 = 47.4% of the budget for state. That is what users of the
ratio flag get without tuning, so it is the default split here.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import torch

from k3compile.model_def.cache import CacheSpec

from .base import KVStateMemory, OutOfMemoryError
from .pools import DEFAULT_STATE_FRACTION, SplitPools
from .unified import UnifiedArena

# the scheduler's admission reserve (SGLang's new_token_ratio held constant); the simulation models it
from k3compile.runtime.scheduler import DEFAULT_RESERVE_RATIO  # noqa: E402



@dataclass(frozen=True)
class Arrival:
    step: int
    prompt_len: int
    output_len: int


# --- workloads: lists of arrivals, sorted by step ---

def _arrivals(rng: random.Random, n: int, per_step: float, draw) -> list[Arrival]:
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(per_step)  # Poisson arrivals
        prompt, output = draw(i)
        out.append(Arrival(int(t), prompt, output))
    return out


def short_chats(seed: int = 0, n: int = 3000, per_step: float = 20.0, prompt=(64, 1024), output=(32, 512)
                ) -> list[Arrival]:
    """Many short conversations: state-heavy (a K3 slot is worth ~2000 tokens of KV)."""
    rng = random.Random(seed)
    return _arrivals(rng, n, per_step, lambda i: (rng.randint(*prompt), rng.randint(*output)))


def long_contexts(seed: int = 0, n: int = 48, per_step: float = 0.05, prompt=(32_768, 262_144),
                  output=(256, 2048)) -> list[Arrival]:
    """A few very long contexts: KV-heavy."""
    rng = random.Random(seed)
    return _arrivals(rng, n, per_step, lambda i: (rng.randint(*prompt), rng.randint(*output)))


def shifting_mix(seed: int = 0, n: int = 2000, per_step: float = 10.0, short=((64, 1024), (32, 512)),
                 long=((32_768, 262_144), (256, 2048)), long_share_end: float = 0.05) -> list[Arrival]:
    """Short chats that turn into long contexts over time: the share of long requests rises
    linearly from 0 to `long_share_end` across the arrivals (by count, long ones dominate bytes)."""
    rng = random.Random(seed)

    def draw(i):
        (p, o) = long if rng.random() < long_share_end * i / max(1, n - 1) else short
        return rng.randint(*p), rng.randint(*o)
    return _arrivals(rng, n, per_step, draw)


def phased_mix(seed: int = 0, n: int = 2000, per_step: float = 10.0, short=((64, 1024), (32, 512)),
               long=((32_768, 262_144), (256, 2048)), phases: int = 4, long_share: float = 0.08) -> list[Arrival]:
    """A mix that shifts back and forth: `phases` equal runs of arrivals, alternately short chats
    only and short chats with `long_share` long contexts. One fixed split has to serve both
    phases, so even the best split in hindsight is wrong for half the time."""
    rng = random.Random(seed)

    def draw(i):
        in_long_phase = (i * phases // max(1, n)) % 2 == 1
        (p, o) = long if in_long_phase and rng.random() < long_share else short
        return rng.randint(*p), rng.randint(*o)
    return _arrivals(rng, n, per_step, draw)


def default_workloads(seed: int = 0, scale: float = 1.0) -> dict[str, list[Arrival]]:
    """The three workloads of issue 5, sized for K3 at TP 8 (scale < 1 shrinks lengths and counts)."""
    def s(r):
        return (max(1, int(r[0] * scale)), max(1, int(r[1] * scale)))
    return {
        "short_chats": short_chats(seed, n=max(10, int(3000 * scale)), prompt=s((64, 1024)), output=s((32, 512))),
        "long_contexts": long_contexts(seed, n=max(4, int(48 * scale)), prompt=s((32_768, 262_144)),
                                       output=s((256, 2048))),
        "shifting_mix": shifting_mix(seed, n=max(10, int(2000 * scale)), short=(s((64, 1024)), s((32, 512))),
                                     long=(s((32_768, 262_144)), s((256, 2048)))),
        "phased_mix": phased_mix(seed, n=max(10, int(2000 * scale)), short=(s((64, 1024)), s((32, 512))),
                                 long=(s((32_768, 262_144)), s((256, 2048)))),
    }


# --- the simulation ---

@dataclass
class _Request:
    rid: int
    prompt_len: int
    output_len: int
    generated: int = 0  # tokens produced in earlier admissions (kept across retraction)
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    admit_step: int = 0
    admit_seq: int = 0  # admission order, breaks ties between events of one step (oldest first)
    kv_at_admit: int = 0
    reserve_target: int = 0  # pages it is expected to hold; the part not yet held is reserved
    epoch: int = 0  # bumped on retraction so stale events are ignored


def _fits(mem: KVStateMemory, n_slots: int, n_pages: int) -> bool:
    can_fit = getattr(mem, "can_fit", None)  # the unified arena: both kinds draw on the same bytes
    if can_fit is not None:
        return can_fit(n_slots, n_pages)
    return mem.num_free_slots() >= n_slots and mem.num_free_pages() >= n_pages


def simulate(mem: KVStateMemory, arrivals: list[Arrival], reserve_ratio: float = DEFAULT_RESERVE_RATIO,
             max_steps: int = 10_000_000) -> dict:
    """Run `arrivals` through `mem` (any KVStateMemory, fresh). Returns plain numbers."""
    if not 0.0 <= reserve_ratio <= 1.0:
        raise ValueError(f"reserve ratio must be in [0, 1], got {reserve_ratio}")
    ps = mem.page_size
    if mem.num_used_slots() or mem.num_used_pages():
        raise ValueError("simulate needs a fresh memory manager (blocks are already allocated)")
    slot_owner: dict[int, _Request] = {}
    page_owner: dict[int, tuple[_Request, int]] = {}

    def on_move(kind, old, new):
        if kind == "slot":
            r = slot_owner.pop(old)
            r.slot, slot_owner[new] = new, r
        else:
            r, i = page_owner.pop(old)
            r.pages[i], page_owner[new] = new, (r, i)
    mem.add_relocation_listener(on_move)

    queue: deque[_Request] = deque()
    running: dict[int, _Request] = {}  # admission order: the last one is the newest
    events: list[tuple] = []  # (step, kind 0=finish 1=page, admit seq, rid, epoch)
    admit_seq = 0
    for a in arrivals:
        if a.prompt_len < 1 or a.output_len < 1 or a.step < 0:
            raise ValueError(f"an arrival needs step >= 0 and prompt and output lengths >= 1, got {a}")
    arrivals = sorted(arrivals, key=lambda a: a.step)
    nxt = 0
    stats = dict(max_concurrent=0, peak_kv_tokens=0, retractions=0, finished=0, rejected=0, output_tokens=0,
                 prefill_tokens=0, first_retraction_step=None, tokens_before_first_retraction=None)
    decoded_closed = 0  # decode tokens of requests no longer running
    # KV tokens resident at step t = kv_base + len(running) * t (each running request adds one per step)
    kv_base = 0
    reserved = 0  # sum over running of max(0, reserve_target - pages held)

    def release(r: _Request):
        nonlocal kv_base, reserved
        kv_base -= r.kv_at_admit - r.admit_step
        reserved -= max(0, r.reserve_target - len(r.pages))
        for p in r.pages:
            del page_owner[p]
        del slot_owner[r.slot]
        pages, slot = r.pages, r.slot
        r.pages, r.slot = [], None
        mem.free_pages(pages)  # may move other requests' blocks (listener updates them)
        mem.free_slot(slot)
        del running[r.rid]

    def schedule_page_need(r: _Request):
        # the d-th decode step after admission leaves kv_at_admit + d tokens of KV (none for the
        # last token): the next page is needed when that passes the pages held
        d = len(r.pages) * ps - r.kv_at_admit + 1
        if d < r.output_len - r.generated:
            heapq.heappush(events, (r.admit_step + d, 1, r.admit_seq, r.rid, r.epoch))

    def retract_newest(t: int):
        nonlocal decoded_closed
        victim = running[next(reversed(running))]
        if stats["first_retraction_step"] is None:
            live = sum(t - 1 - r.admit_step for r in running.values())
            stats["first_retraction_step"] = t
            stats["tokens_before_first_retraction"] = stats["prefill_tokens"] + decoded_closed + live
        made = t - 1 - victim.admit_step
        victim.generated += made
        decoded_closed += made
        release(victim)
        victim.epoch += 1
        stats["retractions"] += 1
        queue.appendleft(victim)
        return victim

    t = 0
    while t <= max_steps:
        # the resident KV grew linearly since the last event; its peak is at the step before this one
        stats["peak_kv_tokens"] = max(stats["peak_kv_tokens"], kv_base + len(running) * (t - 1))
        # 1. finishes at t free memory first
        while events and events[0][0] == t and events[0][1] == 0:
            _, _, _, rid, epoch = heapq.heappop(events)
            r = running.get(rid)
            if r is None or r.epoch != epoch:
                continue
            made = r.output_len - r.generated
            decoded_closed += made
            stats["output_tokens"] += r.output_len
            stats["finished"] += 1
            release(r)
        # 2. arrivals join the queue
        while nxt < len(arrivals) and arrivals[nxt].step <= t:
            a = arrivals[nxt]
            queue.append(_Request(nxt, a.prompt_len, a.output_len))
            nxt += 1
        # 3. page boundary crossings, oldest admitted first; out of memory retracts the newest
        while events and events[0][0] == t:
            _, _, _, rid, epoch = heapq.heappop(events)
            r = running.get(rid)
            if r is None or r.epoch != epoch:
                continue
            while True:
                try:
                    (p,) = mem.alloc_pages(1)
                except OutOfMemoryError:
                    if retract_newest(t) is r:
                        break
                    continue
                page_owner[p] = (r, len(r.pages))
                if len(r.pages) < r.reserve_target:
                    reserved -= 1  # a reserved page became a held one
                r.pages.append(p)
                schedule_page_need(r)
                break
        # 4. FCFS admission
        while queue:
            r = queue[0]
            kv = r.prompt_len + r.generated
            need = math.ceil(kv / ps)
            remaining = r.output_len - r.generated
            target = math.ceil((kv + max(1, math.ceil(reserve_ratio * remaining))) / ps)
            if not _fits(mem, 1, target + reserved):
                if running:
                    break  # wait for memory to free up
                queue.popleft()  # cannot even grow by one page alone in empty memory
                stats["rejected"] += 1
                continue
            queue.popleft()
            r.slot = mem.alloc_slot()
            slot_owner[r.slot] = r
            r.pages = mem.alloc_pages(need)
            for i, p in enumerate(r.pages):
                page_owner[p] = (r, i)
            r.admit_step, r.kv_at_admit, r.admit_seq = t, kv, admit_seq
            admit_seq += 1
            running[r.rid] = r
            kv_base += kv - t
            r.reserve_target = target
            reserved += target - need
            stats["prefill_tokens"] += kv
            heapq.heappush(events, (t + r.output_len - r.generated, 0, r.admit_seq, r.rid, r.epoch))
            schedule_page_need(r)
        stats["max_concurrent"] = max(stats["max_concurrent"], len(running))
        stats["peak_kv_tokens"] = max(stats["peak_kv_tokens"], kv_base + len(running) * t)
        # 5. jump to the next step where anything happens
        upcoming = [events[0][0]] if events else []
        if nxt < len(arrivals):
            upcoming.append(max(arrivals[nxt].step, t + 1))
        if not upcoming:
            break
        t = min(upcoming)
    stats["unfinished"] = len(arrivals) - stats["finished"] - stats["rejected"]
    # steps to serve everything; undefined when some request was rejected or cut off by max_steps
    stats["makespan"] = t if stats["finished"] == len(arrivals) else None
    if stats["tokens_before_first_retraction"] is None:  # never retracted: everything served counts
        stats["tokens_before_first_retraction"] = stats["prefill_tokens"] + decoded_closed
    if isinstance(mem, UnifiedArena):
        stats["compaction"] = mem.compaction_stats()
    return stats


# --- unified vs split ---

def _split(spec: CacheSpec, budget: int, page_size: int, fraction: float, device) -> SplitPools | None:
    try:
        return SplitPools.from_budget(spec, budget, page_size, state_fraction=fraction, device=device)
    except ValueError:
        return None  # this ratio leaves fewer than 2 blocks of one kind: not a usable split


# metric -> True if higher is better; every comparison ratio is oriented so > 1 favours unified
METRICS = {"max_concurrent": True, "peak_kv_tokens": True, "tokens_before_first_retraction": True,
           "makespan": False}


def compare_allocators(spec: CacheSpec, budget_bytes: int, page_size: int, arrivals: list[Arrival],
                       default_fraction: float = DEFAULT_STATE_FRACTION, sweep: list[float] | None = None,
                       refine: bool = True, reserve_ratio: float = DEFAULT_RESERVE_RATIO, device="meta") -> dict:
    """Unified arena vs the split at `default_fraction` vs the best split in hindsight.

    The hindsight split is the best of a sweep over the state fraction (a 0.05 grid, then a 0.01
    grid around the best), chosen separately for each metric, which favours the baseline.
    `makespan` is lower-is-better, so its ratios are split / unified; splits that rejected a
    request (a prompt larger than their KV pool) have no makespan and are not candidates for it."""
    unified = simulate(UnifiedArena.from_budget(spec, budget_bytes, page_size, device=device), arrivals,
                       reserve_ratio)
    default_mem = _split(spec, budget_bytes, page_size, default_fraction, device)
    if default_mem is None:
        raise ValueError(f"the default state fraction {default_fraction} leaves no usable split of "
                         f"{budget_bytes} B (slot {spec.slot_bytes} B, page {spec.page_bytes(page_size)} B)")
    default = simulate(default_mem, arrivals, reserve_ratio) | {"state_fraction": default_fraction}
    runs: dict[float, dict] = {}

    def run(f):
        f = round(f, 4)
        if 0 < f < 1 and f not in runs and (mem := _split(spec, budget_bytes, page_size, f, device)):
            runs[f] = simulate(mem, arrivals, reserve_ratio) | {"state_fraction": f}
    for f in (sweep if sweep is not None else [i / 20 for i in range(1, 20)]):
        run(f)
    if not runs:
        raise ValueError(f"no split of {budget_bytes} B in the sweep holds 2 slots and 2 pages")

    def best(metric):
        sign = 1 if METRICS[metric] else -1
        candidates = [r for r in runs.values() if r[metric] is not None]
        return max(candidates, key=lambda r: (sign * r[metric], r["state_fraction"])) if candidates else None
    if refine:
        for metric in METRICS:
            if (b := best(metric)) is not None:
                for k in range(-4, 5):
                    run(b["state_fraction"] + k / 100)

    def favour(u, other, metric):  # > 1 means unified is better; None where either is undefined
        if u is None or other is None:
            return None
        a, b = (u, other) if METRICS[metric] else (other, u)
        return a / b if b else math.inf
    best_runs = {m: best(m) or {m: None, "state_fraction": None} for m in METRICS}
    return {
        "unified": unified,
        "split_default": default,
        "split_best": {m: {"value": r[m], "state_fraction": r["state_fraction"]} for m, r in best_runs.items()},
        "unified_vs_best": {m: favour(unified[m], r[m], m) for m, r in best_runs.items()},
        "unified_vs_default": {m: favour(unified[m], default[m], m) for m in METRICS},
        "sweep": [runs[f] for f in sorted(runs)],
    }


def k3_spec(tp_size: int = 8, preset: str = "k3") -> CacheSpec:
    """A preset's real per-GPU byte sizes at tensor parallelism `tp_size` (bf16 KV, fp32 KDA state):
    K3 at TP 8 by default; `preset="k3-mini-6b", tp_size=1` gives the mini model's byte ratio."""
    from k3compile.model_def.config import get_preset
    return CacheSpec.from_config(get_preset(preset), dtype=torch.bfloat16, tp_size=tp_size)


def run_capacity_benchmark(spec: CacheSpec | None = None, budget_bytes: int = 64 << 30, page_size: int = 64,
                           seed: int = 0, workloads: dict[str, list[Arrival]] | None = None,
                           default_fraction: float = DEFAULT_STATE_FRACTION,
                           reserve_ratio: float = DEFAULT_RESERVE_RATIO) -> dict:
    """All three workloads at one budget; defaults are K3 at TP 8 with 64 GiB for KV + state."""
    spec = spec or k3_spec()
    workloads = workloads if workloads is not None else default_workloads(seed)
    return {
        "budget_bytes": budget_bytes, "page_size": page_size, "slot_bytes": spec.slot_bytes,
        "page_bytes": spec.page_bytes(page_size), "default_state_fraction": default_fraction,
        "reserve_ratio": reserve_ratio,
        "workloads": {name: compare_allocators(spec, budget_bytes, page_size, arr, default_fraction=default_fraction,
                                               reserve_ratio=reserve_ratio)
                      for name, arr in workloads.items()},
    }
