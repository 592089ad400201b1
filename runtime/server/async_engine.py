"""The asyncio face of an LLMEngine: one thread runs the engine, the event loop only talks to it.

`LLMEngine` is not thread-safe, so exactly one thread (started here) calls its methods after
`start()`. The event loop sends it commands (add, abort) through a thread-safe queue; the engine
thread runs `step()` while there is work and hands each step's outputs back to the loop with
`loop.call_soon_threadsafe`, where they land in the request's own asyncio.Queue.

Failures: `add_request` rejecting a request (ValueError) fails that request only. A request the
engine itself failed (an output with `error`: its sampling or a forward it ran alone raised, see
LLMEngine) gets an EngineError; the others go on. If `step()` itself raises (a bug outside any
forward), every request the engine holds fails with an EngineError, is aborted, and the engine is
stepped until it has nothing left; requests arriving afterwards are served normally. If even that
recovery raises, or leaves requests behind, the engine is marked broken: new requests fail at once
and `health()` reports the cause.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

log = logging.getLogger("k3compile.server")

_RECOVERY_STEPS = 8      # steps allowed for aborted requests to drain after a failed step
_RATE_WINDOW_S = 10.0    # tokens/s is averaged over this window


class EngineError(RuntimeError):
    """The engine failed while it held this request (or is broken); the request is lost."""


@dataclass
class _Add:
    rid: str
    prompt_ids: list[int]
    params: object
    accepted: asyncio.Future
    fork_rids: tuple[str, ...] = ()   # n > 1: more requests forked from this one's prefill


@dataclass
class _Abort:
    rid: str


_STOP = object()


class RequestStream:
    """A request's outputs, in order, as the engine produces them. Iterate it; `abort()` when the
    consumer goes away before the final output (idempotent, a no-op once finished)."""

    def __init__(self, rid: str, front: "AsyncEngine"):
        self.rid, self._front = rid, front
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.arrival = time.monotonic()
        self.last_token: float | None = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._front.abort(self.rid)


class AsyncEngine:
    def __init__(self, engine, warmup: bool = True):
        """`warmup`: the engine thread first runs `engine.warmup()` (kernels compiled, graphs warm);
        until it finishes `health()` says "warming up" and requests wait in the queue."""
        self.engine = engine
        self._warmup = warmup and hasattr(engine, "warmup")
        self._warming = self._warmup
        self.warmup_report: dict | None = None
        # read once here: after start() only the engine thread touches the engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.max_context = engine.max_context
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}   # loop side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broken: str | None = None
        self._snapshot: dict = {}   # replaced (never mutated) by the engine thread; read anywhere
        self.on_latency = None   # fn(kind, seconds), kinds "ttft" | "itl" | "e2e" | "queue" (on the loop)

    # ---- event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        """Call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._publish_metrics(in_flight=0, rate=0.0)
        self._thread = threading.Thread(target=self._run, name="k3compile-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)

    async def add(self, rid: str, prompt_ids: list[int], params, fork_rids: tuple[str, ...] = ()):
        """Submit a request; returns its stream once the engine accepted it (with `fork_rids`: the
        list of streams, rid's first). Raises ValueError (the engine's message) if the request is
        invalid, EngineError if the engine is broken."""
        if self._thread is None:
            raise RuntimeError("AsyncEngine not started")
        if self._broken is not None:
            raise EngineError(f"engine is broken: {self._broken}")
        rids = (rid, *fork_rids)
        for r in rids:
            if r in self._streams:
                raise ValueError(f"request id '{r}' is already in use")
        streams = [RequestStream(r, self) for r in rids]
        for st in streams:
            self._streams[st.rid] = st   # before the add: outputs may follow acceptance closely
        accepted = self._loop.create_future()
        self._commands.put(_Add(rid, list(prompt_ids), params, accepted, tuple(fork_rids)))
        try:
            await accepted
        except asyncio.CancelledError:   # the client left while we waited: don't leak the request
            for r in rids:
                self.abort(r)
            raise
        except BaseException:
            for r in rids:
                self._streams.pop(r, None)
            raise
        return streams if fork_rids else streams[0]

    def abort(self, rid: str) -> None:
        """Stop a request; its outputs are dropped from now on. Safe to call more than once."""
        if self._streams.pop(rid, None) is not None:
            self._commands.put(_Abort(rid))

    def metrics(self) -> dict:
        """The engine's metrics as of its last iteration, plus `tokens_per_s` and `in_flight`."""
        return self._snapshot

    def health(self) -> str | None:
        """None when healthy, else why not."""
        if self._broken is not None:
            return f"engine is broken: {self._broken}"
        if self._thread is None or not self._thread.is_alive():
            return "engine thread is not running"
        if self._warming:
            return "warming up (compiling kernels, warming CUDA graphs)"
        return None

    def _observe(self, stream: RequestStream, out) -> None:   # on the loop
        if self.on_latency is None:
            return
        now = time.monotonic()
        n = len(out.new_token_ids)
        if n:
            if stream.last_token is None:
                self.on_latency("ttft", now - stream.arrival)
                rest, gap = n - 1, 0.0
            else:   # tokens that arrive together share the gap since the previous ones
                rest, gap = n, (now - stream.last_token) / n
            for _ in range(rest):
                self.on_latency("itl", gap)
            stream.last_token = now
        if out.finished and out.error is None:
            self.on_latency("e2e", now - stream.arrival)
            if out.queue_time is not None:
                self.on_latency("queue", out.queue_time)

    def _deliver(self, outputs) -> None:   # on the loop
        for out in outputs:
            stream = self._streams.get(out.rid)
            if stream is None:
                continue   # aborted by its consumer
            self._observe(stream, out)
            if out.error is None:
                stream._queue.put_nowait(out)
            else:   # tokens it got before the failure, then the failure
                if out.new_token_ids:
                    stream._queue.put_nowait(replace(out, finished=False, finish_reason=None, error=None))
                stream._queue.put_nowait(EngineError(f"the engine failed this request: {out.error}"))
            if out.finished:
                del self._streams[out.rid]

    def _fail(self, rid: str, err: BaseException) -> None:   # on the loop
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream._queue.put_nowait(err)

    @staticmethod
    def _resolve(fut: asyncio.Future, err: BaseException | None) -> None:   # on the loop
        if fut.done():
            return   # cancelled: add() already sent the abort
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)

    # ---- engine thread -----------------------------------------------------------------------

    def _warm(self) -> None:
        t0 = time.monotonic()
        try:
            self.warmup_report = self.engine.warmup()
            log.info("warm-up took %.2f s (%s)", time.monotonic() - t0, self.warmup_report)
        except Exception as e:   # serving cold is still serving: the first requests pay instead
            log.exception("warm-up failed after %.2f s; serving without it", time.monotonic() - t0)
            self.warmup_report = {"seconds": time.monotonic() - t0, "error": repr(e)}
        finally:
            self._warming = False

    def _run(self) -> None:
        if self._warmup:
            self._warm()
        in_flight: set[str] = set()
        rate: deque[tuple[float, int]] = deque()   # (time, tokens) per step, for tokens/s
        while True:
            try:
                if not self._iterate(in_flight, rate):
                    return
            except Exception as e:   # our own bug or a broken engine: keep answering, never hang a caller
                log.exception("engine thread iteration failed; marking the engine broken")
                self._broken = self._broken or f"engine thread error: {e!r}"
                for rid in sorted(in_flight):
                    self._loop.call_soon_threadsafe(self._fail, rid, EngineError(self._broken))
                in_flight.clear()

    def _iterate(self, in_flight: set[str], rate: deque) -> bool:
        """One round: take commands (waiting for one when idle), step once. False on shutdown."""
        busy = bool(in_flight) or (self._broken is None and self.engine.has_unfinished())
        for cmd in self._take_commands(block=not busy):
            if cmd is _STOP:
                return False
            self._apply(cmd, in_flight)
        if self._broken is None and self.engine.has_unfinished():
            self._step(in_flight, rate)
        now = time.monotonic()
        while rate and rate[0][0] < now - _RATE_WINDOW_S:
            rate.popleft()
        self._publish_metrics(len(in_flight), sum(n for _, n in rate) / _RATE_WINDOW_S)
        return True

    def _take_commands(self, block: bool) -> list:
        out = []
        try:
            out.append(self._commands.get(block=block, timeout=1.0 if block else None))
            while True:
                out.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return out

    def _apply(self, cmd, in_flight: set[str]) -> None:
        if isinstance(cmd, _Add):
            err = None
            if self._broken is not None:
                err = EngineError(f"engine is broken: {self._broken}")
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
            self._loop.call_soon_threadsafe(self._resolve, cmd.accepted, err)
        elif isinstance(cmd, _Abort):
            if cmd.rid in in_flight and self._broken is None:
                try:
                    self.engine.abort(cmd.rid)
                except Exception:
                    log.exception("abort(%s) failed", cmd.rid)

    def _step(self, in_flight: set[str], rate: deque) -> None:
        try:
            outputs = self.engine.step()
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
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _recover(self, in_flight: set[str], err: EngineError) -> None:
        failed = sorted(in_flight)
        in_flight.clear()
        for rid in failed:
            self._loop.call_soon_threadsafe(self._fail, rid, err)
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
            self._broken = f"{err}; recovery failed: {e!r}"

    def _publish_metrics(self, in_flight: int, rate: float) -> None:
        snap = {}
        if self._broken is None:
            try:
                snap = dict(self.engine.metrics())
            except Exception as e:
                log.exception("engine metrics failed")
                snap = {"metrics_error": repr(e)}
        snap["in_flight"] = in_flight
        snap["tokens_per_s"] = rate
        self._snapshot = snap
