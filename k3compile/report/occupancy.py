"""Launch shapes: how many waves each kernel's grid needs on its GPU.

A decode kernel at batch 1 is latency-bound: a grid that does not fit the GPU at once runs its last blocks after the
first ones finish, one more round of load latency. The profiler records each kernel's grid, block, registers per
thread and shared memory (event args), and the trace the device's limits (deviceProperties); this module computes
the resident blocks per SM as CUDA's occupancy rules do and the waves = blocks / (SMs x resident), per distinct
(kernel, launch shape).

Occupancy (CUDA occupancy calculator, compute capability 9.x): registers are allocated per warp in units of 256
(registers per thread rounded up to 8); shared memory per block adds 1 KiB the runtime reserves; at most 32 blocks and
`maxThreadsPerMultiprocessor` threads per SM. Kernels without those args (copies, memsets) are left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from k3compile.report.categories import classify
from k3compile.report.trace import Event

REG_UNIT = 256          # registers are allocated to a warp in units of 256
REG_PER_THREAD_STEP = 8
SMEM_RESERVED = 1024    # per block, reserved by the CUDA runtime (sm80+)
MAX_BLOCKS_PER_SM = 32  # sm90
DEFAULT_LIMITS = {"numSms": 132, "regsPerMultiprocessor": 65536, "maxThreadsPerMultiprocessor": 2048,
                  "sharedMemPerMultiprocessor": 233472, "warpSize": 32}  # an H100 / H200, for traces without them


@dataclass
class LaunchShape:
    name: str
    category: str
    blocks: int                # grid size
    threads: int               # per block
    registers: int             # per thread
    shared_bytes: int          # per block (static + dynamic, as the profiler reports it)
    resident_per_sm: int       # blocks an SM holds at once
    limited_by: str            # "registers", "shared memory", "threads" or "blocks"
    waves: float               # blocks / (SMs x resident_per_sm)
    launches: int              # events with this shape, all steps
    mean_us: float


def device_limits(metadata: dict, device: int) -> dict:
    """The device's occupancy limits from the trace's deviceProperties (defaults for what is missing)."""
    limits = dict(DEFAULT_LIMITS)
    for p in metadata.get("deviceProperties") or []:
        if isinstance(p, dict) and p.get("id") == device:
            limits.update({k: p[k] for k in DEFAULT_LIMITS if isinstance(p.get(k), int) and p[k] > 0})
    return limits


def resident_blocks(threads: int, registers: int, shared_bytes: int, limits: dict) -> tuple[int, str]:
    """(blocks an SM holds at once, the resource that binds)."""
    warp = limits["warpSize"]
    warps = math.ceil(threads / warp)
    bounds = {"blocks": MAX_BLOCKS_PER_SM, "threads": limits["maxThreadsPerMultiprocessor"] // max(threads, 1)}
    if registers > 0:
        per_warp = math.ceil(math.ceil(registers / REG_PER_THREAD_STEP) * REG_PER_THREAD_STEP * warp / REG_UNIT) \
            * REG_UNIT
        bounds["registers"] = (limits["regsPerMultiprocessor"] // per_warp) // warps
    if shared_bytes > 0:
        bounds["shared memory"] = limits["sharedMemPerMultiprocessor"] // (shared_bytes + SMEM_RESERVED)
    binding = min(bounds, key=lambda k: (bounds[k], k))
    return bounds[binding], binding


def _int3(value) -> int | None:
    if isinstance(value, list) and len(value) == 3 and all(isinstance(v, int) and v > 0 for v in value):
        return value[0] * value[1] * value[2]
    return None


def launch_shapes(events: list[Event], metadata: dict) -> list[LaunchShape]:
    """One row per distinct (kernel name, grid, block, registers, shared memory) among `events`' kernels, by total
    time (largest first)."""
    groups: dict[tuple, list[Event]] = {}
    for e in events:
        a = e.args or {}
        blocks, threads = _int3(a.get("grid")), _int3(a.get("block"))
        if blocks is None or threads is None:
            continue
        regs = a.get("registers per thread", 0)
        smem = a.get("shared memory", 0)
        key = (e.name, blocks, threads, regs if isinstance(regs, int) else 0, smem if isinstance(smem, int) else 0,
               e.device)
        groups.setdefault(key, []).append(e)
    rows = []
    for (name, blocks, threads, regs, smem, device), evs in groups.items():
        limits = device_limits(metadata, device)
        resident, binding = resident_blocks(threads, regs, smem, limits)
        waves = blocks / (limits["numSms"] * resident) if resident else math.inf
        total = sum(e.dur for e in evs)
        rows.append((total, LaunchShape(name, classify(name), blocks, threads, regs, smem, resident, binding,
                                        round(waves, 3), len(evs), round(total / len(evs) / 1000, 3))))
    rows.sort(key=lambda r: (-r[0], r[1].name))
    return [r[1] for r in rows]
