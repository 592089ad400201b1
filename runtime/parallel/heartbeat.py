"""Liveness of the ranks of a parallel engine, through the process group's key-value store.

Each worker runs a `Heartbeat` thread that bumps its counter every BEAT_S seconds (a thread, so a
worker busy in a long step still beats: torch releases the GIL in its kernels). Rank 0's
`HeartbeatWatch` reads the counters: a rank whose counter has not moved for `hang_s` seconds is hung
(SIGSTOP, a deadlock, a wedged device), one whose process is gone is dead. The thread also ends
its own process when rank 0 is gone (the store unreachable, or the parent process replaced), so a
killed server leaves no worker behind.
"""
from __future__ import annotations

import os
import threading
import time

BEAT_S = 0.25


def _key(rank: int) -> str:
    return f"k3/heartbeat/{rank}"


class Heartbeat:
    def __init__(self, store, rank: int, parent_pid: int | None = None):
        self.store, self.rank, self.parent_pid = store, rank, parent_pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"k3-heartbeat-{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                os._exit(70)  # the process that started this rank is gone: do not outlive it
            try:
                self.store.add(_key(self.rank), 1)
            except Exception:
                if self._stop.is_set():
                    return
                os._exit(70)  # rank 0 (which hosts the store) is gone
            self._stop.wait(BEAT_S)


class HeartbeatWatch:
    """Rank 0's view of the other ranks' heartbeats."""

    def __init__(self, store, ranks, hang_s: float):
        self.store, self.hang_s = store, hang_s
        now = time.monotonic()
        self._last = {r: (-1, now) for r in ranks}  # rank -> (counter, when it last changed)

    def stale(self) -> dict[int, float]:
        """{rank: seconds since its last beat} for the ranks silent longer than hang_s."""
        now, out = time.monotonic(), {}
        for r, (count, since) in self._last.items():
            c = int(self.store.add(_key(r), 0))
            if c != count:
                self._last[r] = (c, now)
            elif now - since > self.hang_s:
                out[r] = now - since
        return out
