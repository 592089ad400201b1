"""Timing, launch counting and copy bandwidth, per docs/BENCHMARKS.md.

* `time_steps(fn, steps, device)`: mean ms per step over `steps` back-to-back calls: CUDA events
  around the whole loop on a GPU (the launch queue stays full, as in serving), perf_counter on CPU.
* `profile_steps(fn, n, device, path)`: a torch.profiler chrome trace of n annotated steps (gzipped
  when path ends in .gz), read
  back with k3compile.report to count GPU kernels (graph replays included), copies and top-level
  CPU ops per step.
* `copy_bandwidth(nbytes, device)`: device-to-device copy bandwidth in the same process.
"""
from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(fn, steps: int, device: torch.device) -> float:
    """Mean milliseconds per call of fn() over `steps` consecutive calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps


def summarize(samples_ms: list[float]) -> dict:
    s = sorted(samples_ms)

    def pct(p):  # linear interpolation between closest ranks
        if len(s) == 1:
            return s[0]
        x = p / 100 * (len(s) - 1)
        lo = int(x)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (x - lo)

    return {"median_ms": statistics.median(s), "p10_ms": pct(10), "p90_ms": pct(90), "min_ms": s[0], "max_ms": s[-1]}


def profile_steps(fn, n: int, device: torch.device, trace_path: str) -> dict:
    """Profile n steps (each inside a `decode_step` range); per-step medians of what ran."""
    from k3compile.engine.profiling import profile_steps as record_steps
    from k3compile.report.steps import segment
    from k3compile.report.trace import KERNEL, MEMCPY, MEMSET, load_trace

    # the same session `k3compile report` attributes (engine/profiling.py), without peaks or node tables:
    # the bench measures its own copy bandwidth
    record_steps(fn, n, trace_path, device, peaks=False)  # gzipped when the path ends in .gz
    steps = segment(load_trace(trace_path)).steps

    def med(xs):
        return statistics.median(xs) if xs else None

    out = {"trace": trace_path, "profiled_steps": len(steps),
           "cpu_ops_per_step": med([len(s.cpu_ops) for s in steps]), **where_the_time_goes(steps, device)}
    if device.type == "cuda":
        out["kernels_per_step"] = med([sum(e.kind == KERNEL for e in s.gpu) for s in steps])
        out["copies_per_step"] = med([sum(e.kind in (MEMCPY, MEMSET) for e in s.gpu) for s in steps])
        out["graph_replayed_per_step"] = med([len(s.graph_replayed) for s in steps])
        out["launch_calls_per_step"] = med([s.launch_calls for s in steps])
    else:
        out["kernels_per_step"] = None  # no GPU: cpu_ops_per_step is the comparable count
    return out


def where_the_time_goes(steps, device: torch.device) -> dict:
    """Per-step medians by `k3compile report`'s categories (GEMM, KDA, attention, MoE, norm/elementwise, copy,
    ...): GPU time and kernel count on CUDA, plus GPU busy time, span and the idle gaps between kernels; on
    CPU the top-level op count per category (a CPU trace has no GPU time)."""
    from k3compile.report.analysis import step_report
    from k3compile.report.categories import CATEGORIES

    reports = [step_report(s) for s in steps]
    if not reports:
        return {}

    def med(xs):
        return statistics.median(xs)
    if device.type != "cuda":
        return {"cpu_ops_by_category": {c: med([r.cpu_ops_by_category[c].count for r in reports]) for c in CATEGORIES}}
    return {"gpu_us_by_category": {c: med([r.by_category[c].time_us for r in reports]) for c in CATEGORIES},
            "kernels_by_category": {c: med([r.by_category[c].count for r in reports]) for c in CATEGORIES},
            "gpu_busy_us": med([r.gpu_busy_us for r in reports]), "gpu_span_us": med([r.gpu_span_us for r in reports]),
            "launch_gap_us": med([r.gap_total_us for r in reports])}


def init_profiler_for_cuda_graphs() -> None:
    """CUPTI must be initialised before any graph is captured, or replays show no kernels (gpt-fast does this)."""
    try:
        from torch.profiler._utils import _init_for_cuda_graphs
        _init_for_cuda_graphs()
    except (ImportError, RuntimeError):
        pass


def copy_bandwidth(nbytes: int, device: torch.device, reps: int = 10) -> dict:
    """Bandwidth of dst.copy_(src) for an nbytes buffer: each copy reads and writes nbytes,
    so bandwidth = 2 * nbytes / time (median of `reps` copies after one warm-up)."""
    n = max(1, nbytes // 4)
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [time_steps(lambda: dst.copy_(src), 1, device) for _ in range(reps)]
    del src, dst
    ms = statistics.median(times)
    return {"bytes": 4 * n, "median_ms": ms, "bytes_per_s": 2 * 4 * n / (ms / 1e3),
            "formula": "bandwidth = 2 * bytes / t_copy (one copy reads and writes the buffer)"}
