"""The engine's side of AsyncEngine: the only code that calls the LLMEngine once serving started.

`EngineLoop.run()` takes commands (add, abort, stop), steps the engine while it has work, and hands
what happens to a sink: each step's outputs, acceptances and rejections of adds, requests failed by
an engine error, the metrics snapshot, the end of the warm-up, a broken engine. It runs either on a
thread of the server's process (the sink posts to the event loop) or as the main loop of an engine
process (the sink writes to a pipe; runtime/server/engine_process.py), so the HTTP side and the
engine's host work do not share one GIL.

Failures (the policy AsyncEngine documents): a rejected add fails that request only; a failed
`step()` fails every request the engine holds, aborts them, and steps until the engine is empty; if
even that fails, or an iteration raises outside any step, the engine is reported broken. A fatal
error (FatalEngineError: a rank of a parallel engine died or hung), from `step()` or from the
engine's `check_health()` (asked every iteration, so an idle engine notices too), is not recovered
from: every request held fails with it, the engine is reported broken, then `sink.fatal(err)`.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from k3compile.runtime.fatal import FatalEngineError

log = logging.getLogger("k3compile.server")

_RECOVERY_STEPS = 8      # steps allowed for aborted requests to drain after a failed step
_RATE_WINDOW_S = 10.0    # tokens/s is averaged over this window


class EngineError(RuntimeError):
    """The engine failed while it held this request (or is broken); the request is lost."""


@dataclass
class Add:
    rid: str
    prompt_ids: list[int]
    params: object
    accepted: object   # handed back to sink.resolve (an asyncio.Future on a thread, a key in a process)
    fork_rids: tuple[str, ...] = ()   # n > 1: more requests forked from this one's prefill


@dataclass
class Abort:
    rid: str


@dataclass
class Stop:
    pass


class EngineLoop:
    def __init__(self, engine, take_commands, sink, warmup: bool):
        """`take_commands(block)` -> list of commands (waiting up to a second for one when `block`);
        `sink`: resolve(accepted, err), deliver(outputs), fail(rid, err), publish(snapshot),
        warmed(report), broken(reason), fatal(err)."""
        self.engine, self.take_commands, self.sink, self.warmup = engine, take_commands, sink, warmup
        self.broken: str | None = None

    def run(self) -> None:
        self._publish(0, 0.0)
        if self.warmup:
            self._warm()
        in_flight: set[str] = set()
        rate: deque[tuple[float, int]] = deque()   # (time, tokens) per step, for tokens/s
        while True:
            try:
                if not self._iterate(in_flight, rate):
                    return
            except Exception as e:   # our own bug or a broken engine: keep answering, never hang a caller
                log.exception("engine iteration failed; marking the engine broken")
                self._break(self.broken or f"engine thread error: {e!r}")
                for rid in sorted(in_flight):
                    self.sink.fail(rid, EngineError(self.broken))
                in_flight.clear()

    def _break(self, reason: str) -> None:
        self.broken = reason
        self.sink.broken(reason)

    def _warm(self) -> None:
        t0 = time.monotonic()
        try:
            report = self.engine.warmup()
            log.info("warm-up took %.2f s (%s)", time.monotonic() - t0, report)
        except Exception as e:   # serving cold is still serving: the first requests pay instead
            log.exception("warm-up failed after %.2f s; serving without it", time.monotonic() - t0)
            report = {"seconds": time.monotonic() - t0, "error": repr(e)}
        self.sink.warmed(report)

    def _iterate(self, in_flight: set[str], rate: deque) -> bool:
        """One round: take commands (waiting for one when idle), step once. False on shutdown."""
        busy = bool(in_flight) or (self.broken is None and self.engine.has_unfinished())
        for cmd in self.take_commands(block=not busy):
            if isinstance(cmd, Stop):
                return False
            self._apply(cmd, in_flight)
        if self.broken is None:
            try:
                check = getattr(self.engine, "check_health", None)
                if check is not None:
                    check()
                if self.engine.has_unfinished():
                    self._step(in_flight, rate)
            except FatalEngineError as e:
                self._die(in_flight, e)
        now = time.monotonic()
        while rate and rate[0][0] < now - _RATE_WINDOW_S:
            rate.popleft()
        self._publish(len(in_flight), sum(n for _, n in rate) / _RATE_WINDOW_S)
        return True

    def _apply(self, cmd, in_flight: set[str]) -> None:
        if isinstance(cmd, Add):
            err = None
            if self.broken is not None:
                err = EngineError(f"engine is broken: {self.broken}")
            else:
                try:
                    if cmd.fork_rids:
                        self.engine.add_request(cmd.rid, cmd.prompt_ids, cmd.params, fork_rids=cmd.fork_rids)
                    else:
                        self.engine.add_request(cmd.rid, cmd.prompt_ids, cmd.params)
                    in_flight.update((cmd.rid, *cmd.fork_rids))
                except ValueError as e:
                    err = e
                except Exception as e:   # a bug, not bad input: the request fails, the server goes on
                    log.exception("add_request(%s) failed", cmd.rid)
                    err = EngineError(f"engine failed to add the request: {e!r}")
            self.sink.resolve(cmd.accepted, err)
        elif isinstance(cmd, Abort):
            if cmd.rid in in_flight and self.broken is None:
                try:
                    self.engine.abort(cmd.rid)
                except Exception:
                    log.exception("abort(%s) failed", cmd.rid)

    def _die(self, in_flight: set[str], err: FatalEngineError) -> None:
        log.error("the engine cannot go on: %s", err)
        for rid in sorted(in_flight):
            self.sink.fail(rid, EngineError(f"the engine failed: {err}"))
        in_flight.clear()
        self._break(str(err))
        self.sink.fatal(err)

    def _step(self, in_flight: set[str], rate: deque) -> None:
        try:
            outputs = self.engine.step()
        except FatalEngineError:
            raise
        except Exception as e:
            log.exception("engine step failed; failing the %d requests it held", len(in_flight))
            self._recover(in_flight, EngineError(f"engine step failed: {e!r}"))
            return
        tokens = 0
        for out in outputs:
            tokens += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.rid)
        rate.append((time.monotonic(), tokens))
        if outputs:
            self.sink.deliver(outputs)

    def _recover(self, in_flight: set[str], err: EngineError) -> None:
        failed = sorted(in_flight)
        in_flight.clear()
        for rid in failed:
            self.sink.fail(rid, err)
        try:
            for rid in failed:
                self.engine.abort(rid)
            for _ in range(_RECOVERY_STEPS):
                if not self.engine.has_unfinished():
                    return
                self.engine.step()   # reports the aborts; nobody listens for them any more
            if self.engine.has_unfinished():
                raise RuntimeError(f"requests still unfinished after {_RECOVERY_STEPS} recovery steps")
        except Exception as e:
            log.exception("engine did not recover; marking it broken")
            self._break(f"{err}; recovery failed: {e!r}")

    def _publish(self, in_flight: int, rate: float) -> None:
        snap = {}
        if self.broken is None:
            try:
                snap = dict(self.engine.metrics())
            except Exception as e:
                log.exception("engine metrics failed")
                snap = {"metrics_error": repr(e)}
        snap["in_flight"] = in_flight
        snap["tokens_per_s"] = rate
        self.sink.publish(snap)
