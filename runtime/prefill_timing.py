"""Host and device time of the prefill forwards a serving engine runs (`EngineArgs.step_timing`,
`serve --step-timing`): what a request's time to first token is made of, next to the decode figures of
runtime/decode_timing.py.

    timer = PrefillTimer(cuda=True)
    mark = timer.start(num_tokens); executor.run(batch); timer.stop(mark)
    timer.totals()   # {"forwards", "tokens", "host_seconds", "device_forwards", "device_seconds"}

A prefill step runs eagerly (no CUDA graph), so its cost has two parts that can differ by orders of
magnitude: `host_seconds` is the wall time of the call that launches it (Python, op dispatch, kernel
launches, and any host sync inside it waiting for the device), `device_seconds` the time between two
CUDA events recorded around it on the current stream. Host time far above device time means the forward
is host-bound: the GPU waits for the launches. On a CPU the forward is synchronous and both are the wall
clock. Device time is taken once the end event completed, so reading the totals never waits for the
device; `device_forwards` counts those.
"""
from __future__ import annotations

import time
from collections import deque


class PrefillTimer:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._marks: deque = deque()   # (start event, end event) of forwards not yet read (CUDA)
        self.reset()

    def start(self, tokens: int):
        ev = None
        if self.cuda:
            import torch
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        return tokens, time.perf_counter(), ev

    def stop(self, mark) -> None:
        tokens, t0, start = mark
        host = time.perf_counter() - t0
        self._forwards += 1
        self._tokens += tokens
        self._host += host
        if self.cuda:
            import torch
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._marks.append((start, end))
        else:
            self._device_forwards += 1
            self._device += host

    def _drain(self) -> None:
        while self._marks:
            start, end = self._marks[0]
            if not end.query():   # still running: later marks are later on the same stream
                return
            self._marks.popleft()
            self._device_forwards += 1
            self._device += start.elapsed_time(end) / 1e3

    def totals(self) -> dict:
        """Prefill forwards since the start or the last reset: their count, tokens, host seconds, and the
        device seconds of the `device_forwards` of them that finished."""
        self._drain()
        return {"forwards": self._forwards, "tokens": self._tokens, "host_seconds": self._host,
                "device_forwards": self._device_forwards, "device_seconds": self._device}

    def reset(self) -> None:
        """Forget what was timed so far (after the warm-up); forwards still running are dropped too."""
        self._marks.clear()
        self._forwards = self._tokens = self._device_forwards = 0
        self._host = self._device = 0.0
