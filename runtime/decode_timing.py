"""Device time of the decode forwards a serving engine runs, per batch bucket (`EngineArgs.step_timing`,
`serve --step-timing`): the server's own figure to set next to `bench decode`'s step time of the same engine.

    timer = DecodeTimer(cuda=True)
    mark = timer.start(bucket); executor.run(batch); timer.stop(mark)
    timer.totals()   # {bucket: (forwards, seconds)}, finished forwards only

Device time per forward as runtime/forward_clock.py takes it (on CUDA from the input copies and the graph replay,
from when the device reaches them: host delays before the first copy is queued do not count, a stall between the
copies and the replay does).
"""
from __future__ import annotations

from .forward_clock import ForwardClock


class DecodeTimer(ForwardClock):
    """Decode forwards per batch bucket: start(bucket) ... stop(mark)."""

    def _finished(self, bucket: int, seconds: float) -> None:
        total = self._totals.setdefault(bucket, [0, 0.0])
        total[0] += 1
        total[1] += seconds

    def _clear(self) -> None:
        self._totals: dict[int, list] = {}   # bucket -> [forwards, seconds]

    def totals(self) -> dict[int, tuple[int, float]]:
        """{bucket: (finished forwards, their seconds)} since the start or the last reset."""
        self._drain()
        return {b: (n, s) for b, (n, s) in sorted(self._totals.items())}
