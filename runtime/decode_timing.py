"""Device time of the decode forwards a serving engine runs, per batch bucket (`EngineArgs.step_timing`,
`serve --step-timing`): the server's own figure to set next to `bench decode`'s step time of the same engine.

    timer = DecodeTimer(cuda=True)
    mark = timer.start(bucket); executor.run(batch); timer.stop(mark)
    timer.totals()   # {bucket: (forwards, seconds)}, finished forwards only

On CUDA a forward is timed by two events recorded around it on the current stream (the input copies and the
graph replay, from when the device reaches them: host delays before the first copy is queued do not count, a
stall between the copies and the replay does); the totals take a forward once its end event has completed, so
reading them never waits for the device. On a CPU the forward is synchronous and timed by the wall clock.
Marks are appended and drained through a deque (thread-safe for one producer and one consumer: the CPU
overlap worker times, the engine thread reads).
"""
from __future__ import annotations

import time
from collections import deque


class DecodeTimer:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._marks: deque = deque()   # (bucket, start event, end event) on CUDA, else (bucket, seconds)
        self._totals: dict[int, list] = {}   # bucket -> [forwards, seconds]

    def start(self, bucket: int):
        if self.cuda:
            import torch
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return bucket, start
        return bucket, time.perf_counter()

    def stop(self, mark) -> None:
        bucket, start = mark
        if self.cuda:
            import torch
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._marks.append((bucket, start, end))
        else:
            self._marks.append((bucket, time.perf_counter() - start))

    def _drain(self) -> None:
        while self._marks:
            mark = self._marks[0]
            if self.cuda:
                bucket, start, end = mark
                if not end.query():   # still running: later marks are later on the same stream
                    return
                seconds = start.elapsed_time(end) / 1e3
            else:
                bucket, seconds = mark
            self._marks.popleft()
            total = self._totals.setdefault(bucket, [0, 0.0])
            total[0] += 1
            total[1] += seconds

    def totals(self) -> dict[int, tuple[int, float]]:
        """{bucket: (finished forwards, their seconds)} since the start or the last reset."""
        self._drain()
        return {b: (n, s) for b, (n, s) in sorted(self._totals.items())}

    def reset(self) -> None:
        """Forget what was timed so far (after the warm-up); forwards still running are dropped too."""
        self._marks.clear()
        self._totals.clear()
