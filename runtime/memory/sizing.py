"""How many bytes the KV pages + KDA state slots get, read from the device when the user gives no budget.

CUDA (SGLang's `--mem-fraction-static`): the engine's static memory -- weights plus pools -- may
take `fraction` of the device's total memory; the rest, (1 - fraction) of the total, stays free for
CUDA graphs, activations and the allocator's workspace. Measured after the weights are loaded, so

    pool bytes = free now - (1 - fraction) * total

CPU: `fraction` of the RAM the OS reports available (MemAvailable) after the weights are loaded,
capped at CPU_MAX_POOL_BYTES: on a CPU the pools are zero-filled up front (about 3 s per GiB on a
shared core), and CPU serving is for the small presets, whose requests need far less.

vLLM's `--gpu-memory-utilization` names the same fraction (vLLM counts activations into it, so the
same number leaves a little more headroom here).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DEFAULT_MEM_FRACTION_STATIC = 0.85
CPU_MAX_POOL_BYTES = 256 << 20
MIN_POOL_BYTES = 1 << 20


@dataclass(frozen=True)
class PoolBudget:
    bytes: int
    source: str  # how it was sized, for the start-up log


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fraction(fraction: float) -> float:
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 < fraction < 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {fraction!r}")
    return float(fraction)


def pool_budget(device, fraction: float | None = None, memory_bytes: int | None = None) -> PoolBudget:
    """The pools' byte budget on `device`: `memory_bytes` when given, else sized as the module says."""
    if memory_bytes is not None:
        return PoolBudget(int(memory_bytes), "--memory-bytes")
    fraction = check_fraction(DEFAULT_MEM_FRACTION_STATIC if fraction is None else fraction)
    device = torch.device(device)
    gib = 1 << 30
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1.0 - fraction) * total)
        source = (f"mem_fraction_static {fraction:g} of {total / gib:.1f} GiB on {device}, "
                  f"{free / gib:.1f} GiB free after the weights")
        if budget < MIN_POOL_BYTES:
            raise ValueError(f"{source}: no room left for the KV and state pools; raise mem_fraction_static "
                             f"or give memory_bytes")
        return PoolBudget(budget, source)
    avail = available_ram_bytes()
    budget = min(int(fraction * avail), CPU_MAX_POOL_BYTES)
    if budget < MIN_POOL_BYTES:
        raise ValueError(f"only {avail >> 20} MiB of RAM available: no room for the KV and state pools")
    capped = " (capped for CPU)" if budget == CPU_MAX_POOL_BYTES else ""
    return PoolBudget(budget, f"{fraction:g} of {avail / gib:.1f} GiB available RAM{capped}")
