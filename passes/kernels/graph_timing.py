"""Build-time kernel timing the way the engine runs kernels: replayed from a CUDA graph, weights from HBM.

Timing a decode-sized kernel with eager launches (triton.testing.do_bench) measures the host launch path
(~8 us per cuBLAS call, 20-40 us per Triton launch from Python) instead of the kernel: on the H200 it made
every Triton GEMV look slower than cuBLAS at the 48B shapes. Inside a CUDA graph there is no host launch,
which is what a captured step replays. Repeating one call in the graph would keep its weights in L2 (50 MB
on an H200) and flatter a small GEMV, while a decode step streams ~6 GB and reads every weight from HBM;
so callers rotate over enough weight copies to overflow L2 (`copies_to_overflow_l2`)."""
from __future__ import annotations

import statistics

import torch


def copies_to_overflow_l2(nbytes: int, device=None, most: int = 32) -> int:
    """How many distinct copies of an `nbytes` operand, read in turn, make each read come from HBM."""
    l2 = getattr(torch.cuda.get_device_properties(device or torch.cuda.current_device()), "L2_cache_size", 64 << 20)
    return max(1, min(most, -(-2 * l2 // max(nbytes, 1))))


def replay_us(calls, reps: int = 5) -> float:
    """Median over `reps` replays of the mean µs per call of `calls` (zero-argument callables, run in order
    inside one CUDA graph); eager launches if the calls cannot be captured."""
    for fn in calls:  # compile / autotune / allocate outside the capture
        fn()
    torch.cuda.synchronize()
    graph = None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
    except RuntimeError:
        graph = None
    times = []
    for _ in range(reps + 1):  # the first replay warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for fn in calls:
                fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times[1:])
