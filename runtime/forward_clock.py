"""The timing mechanism runtime/decode_timing.py and runtime/prefill_timing.py share: a forward's host time is the
wall clock around the call that launches it; its device time, on CUDA, the time between two events recorded around
it on the current stream, read only once its end event completed (reading never waits for the device; marks finish
in order on one stream). On a CPU the forward is synchronous: its device time is its host time. Marks are appended
and drained through a deque (thread-safe for one producer and one consumer: the CPU overlap worker times, the
engine thread reads). Subclasses say what a finished forward adds to their totals."""
from __future__ import annotations

import time
from collections import deque


class ForwardClock:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._marks: deque = deque()   # (key, start event, end event) of forwards not yet read (CUDA)
        self.reset()

    def start(self, key):
        event = None
        if self.cuda:
            import torch
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return key, time.perf_counter(), event

    def stop(self, mark) -> None:
        key, t0, start = mark
        host = time.perf_counter() - t0
        self._launched(key, host)
        if self.cuda:
            import torch
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._marks.append((key, start, end))
        else:
            self._finished(key, host)

    def _drain(self) -> None:
        while self._marks:
            key, start, end = self._marks[0]
            if not end.query():   # still running: later marks are later on the same stream
                return
            self._marks.popleft()
            self._finished(key, start.elapsed_time(end) / 1e3)

    def reset(self) -> None:
        """Forget what was timed so far (after the warm-up); forwards still running are dropped too."""
        self._marks.clear()
        self._clear()

    # what a subclass counts
    def _launched(self, key, host_seconds: float) -> None:
        pass

    def _finished(self, key, device_seconds: float) -> None:
        raise NotImplementedError

    def _clear(self) -> None:
        raise NotImplementedError
