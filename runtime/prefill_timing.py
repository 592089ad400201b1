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

from .forward_clock import ForwardClock


class PrefillTimer(ForwardClock):
    """Prefill forwards: start(num_tokens) ... stop(mark); host time of every one, device time of the finished."""

    def _launched(self, tokens: int, host_seconds: float) -> None:
        self._forwards += 1
        self._tokens += tokens
        self._host += host_seconds

    def _finished(self, tokens: int, device_seconds: float) -> None:
        self._device_forwards += 1
        self._device += device_seconds

    def _clear(self) -> None:
        self._forwards = self._tokens = self._device_forwards = 0
        self._host = self._device = 0.0

    def totals(self) -> dict:
        """Prefill forwards since the start or the last reset: their count, tokens, host seconds, and the
        device seconds of the `device_forwards` of them that finished."""
        self._drain()
        return {"forwards": self._forwards, "tokens": self._tokens, "host_seconds": self._host,
                "device_forwards": self._device_forwards, "device_seconds": self._device}
