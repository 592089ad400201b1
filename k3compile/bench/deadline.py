"""A hard time limit for one bench set-up (torch.compile's first call): `--compile-budget` and `--time-budget` only
skip compiles that would *start* after them, and torch.compile of a whole model from a cold cache can take longer
than the budget by itself (k3-mini-6b on an H200: more than 190 s, traces/h200_s13/call4), so every arm set up
after it — the whole ladder — lost its time. `within(seconds)` raises `OverBudget` in the main thread when the
time is up (SIGALRM), and again every few seconds until the block has left; elsewhere, or without a limit, it does
nothing. OverBudget is a BaseException, as KeyboardInterrupt is, so that code inside the compile that catches
Exception (as an autotuner scoring a raising candidate as slow does) cannot swallow it: session 14's k3-mini-6b
compile finished after 148 s under a 100 s stop, the likely reason (not traced)."""
from __future__ import annotations

import contextlib
import signal
import threading


class OverBudget(BaseException):
    pass


REPEAT_S = 2.0  # a raise that something swallowed anyway is raised again this much later


@contextlib.contextmanager
def within(seconds: float | None, what: str):
    usable = (seconds is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return
    if seconds <= 0:
        raise OverBudget(f"{what}: no time left")

    def expire(signum, frame):
        raise OverBudget(f"{what}: still running after {seconds:.0f} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, REPEAT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
