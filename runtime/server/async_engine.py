"""The asyncio face of an LLMEngine: the engine runs on its own thread or in its own process, the
event loop only talks to it.

`LLMEngine` is not thread-safe, so exactly one thread calls its methods after `start()`: the
engine loop (runtime/server/engine_loop.py). The event loop sends it commands (add, abort); it runs
`step()` while there is work and hands each step's outputs back to the loop, where they land in the
request's own asyncio.Queue.

Two ways to run it. `AsyncEngine(engine)`: on a thread of this process; outputs come back with
`loop.call_soon_threadsafe`. `AsyncEngine.spawn(factory)`: the engine is built and stepped in a
child process (runtime/server/engine_process.py, vLLM V1's EngineCore split), commands and outputs
cross a pipe, one message per step. On a thread, the engine's host work (scheduling, batch building,
applying results) and the HTTP side (detokenizing, SSE framing, socket writes for every stream)
share one GIL and run one after the other; at 64 streams that made the served step twice the
engine's own (traces/serve_cpu/). In a process they run side by side.

Failures: `add_request` rejecting a request (ValueError) fails that request only. A request the
engine itself failed (an output with `error`: its sampling or a forward it ran alone raised, see
LLMEngine) gets an EngineError; the others go on. If `step()` itself raises (a bug outside any
forward), every request the engine holds fails with an EngineError, is aborted, and the engine is
stepped until it has nothing left; requests arriving afterwards are served normally. If even that
recovery raises, or leaves requests behind, the engine is marked broken: new requests fail at once
and `health()` reports the cause. An engine process that dies is a broken engine too.

Fatal errors (FatalEngineError: a rank of a parallel engine died or hung): every request held
fails with it, the engine is broken, `fatal` holds the error and `on_fatal(err)` is called once
(`k3compile serve` then shuts the server down).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import replace

from .engine_loop import Abort, Add, EngineError, EngineLoop, Stop

log = logging.getLogger("k3compile.server")

__all__ = ["AsyncEngine", "EngineError", "RequestStream"]


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
        """`warmup`: the engine loop first runs `engine.warmup()` (kernels compiled, graphs warm);
        until it finishes `health()` says "warming up" and requests wait in the queue."""
        self.engine = engine   # None when it runs in a process (spawn)
        self._warmup = warmup and hasattr(engine, "warmup")
        self._warming = self._warmup
        self.warmup_report: dict | None = None
        # read once here: after start() only the engine loop touches the engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.max_context = engine.max_context
        self.memory_summary = engine.memory_summary() if hasattr(engine, "memory_summary") else ""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}   # loop side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._process = None   # engine_process.EngineProcess when spawned
        self._accepting: dict[str, asyncio.Future] = {}   # process: add futures by rid, until resolved
        self._broken: str | None = None
        self._snapshot: dict = {}   # replaced (never mutated) by the engine side; read anywhere
        self.on_latency = None   # fn(kind, seconds), kinds "ttft" | "itl" | "e2e" | "queue" (on the loop)
        self.on_fatal = None   # fn(FatalEngineError), called once (on the engine thread, or on the loop)
        self.fatal = None

    @classmethod
    def spawn(cls, factory, warmup: bool = True) -> "AsyncEngine":
        """The engine built by `factory()` (picklable, e.g. functools.partial(LLMEngine, args)) in a
        child process; returns once it is built (raises RuntimeError if building it failed)."""
        from .engine_process import EngineProcess

        proc = EngineProcess(factory, warmup)
        self = cls.__new__(cls)
        self.engine = None
        self._warmup = self._warming = warmup
        self.warmup_report = None
        self.tokenizer, self.config, self.max_context = proc.tokenizer, proc.config, proc.max_context
        self.memory_summary = proc.memory_summary
        self._commands = None
        self._streams, self._accepting = {}, {}
        self._loop = self._thread = None
        self._process = proc
        self._broken = None
        self._snapshot = {}
        self.on_latency = None
        self.on_fatal = self.fatal = None
        return self

    # ---- event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        """Call from the event loop that will consume the outputs."""
        if self._thread is not None or (self._process is not None and self._loop is not None):
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        if self._process is not None:
            self._process.attach(self._loop, self)
            return
        engine_loop = EngineLoop(self.engine, self._take_commands, _ThreadSink(self), self._warmup)
        engine_loop._publish(0, 0.0)
        self._thread = threading.Thread(target=engine_loop.run, name="k3compile-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        if self._process is not None:
            self._process.stop(timeout)
        elif self._thread is not None:
            self._commands.put(Stop())
            self._thread.join(timeout)

    def _send(self, cmd) -> None:
        if self._process is not None:
            self._process.send(cmd)
        else:
            self._commands.put(cmd)

    async def add(self, rid: str, prompt_ids: list[int], params, fork_rids: tuple[str, ...] = ()):
        """Submit a request; returns its stream once the engine accepted it (with `fork_rids`: the
        list of streams, rid's first). Raises ValueError (the engine's message) if the request is
        invalid, EngineError if the engine is broken."""
        if self._loop is None:
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
        if self._process is not None:   # a future cannot cross the pipe: the engine answers by rid
            self._accepting[rid] = accepted
            self._send(Add(rid, list(prompt_ids), params, rid, tuple(fork_rids)))
        else:
            self._send(Add(rid, list(prompt_ids), params, accepted, tuple(fork_rids)))
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
        finally:
            self._accepting.pop(rid, None)
        return streams if fork_rids else streams[0]

    def abort(self, rid: str) -> None:
        """Stop a request; its outputs are dropped from now on. Safe to call more than once."""
        if self._streams.pop(rid, None) is not None:
            self._send(Abort(rid))

    def metrics(self) -> dict:
        """The engine's metrics as of its last iteration, plus `tokens_per_s` and `in_flight`."""
        return self._snapshot

    def health(self) -> str | None:
        """None when healthy, else why not."""
        if self._broken is not None:
            return f"engine is broken: {self._broken}"
        if self._process is not None:
            if not self._process.alive():
                return "engine process is not running"
        elif self._thread is None or not self._thread.is_alive():
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

    def engine_message(self, kind: str, *rest) -> None:   # on the loop: what the engine process says
        if kind == "step":
            outputs, self._snapshot = rest
            if outputs:
                self._deliver(outputs)
        elif kind == "resolve":
            fut = self._accepting.pop(rest[0], None)
            if fut is not None:
                self._resolve(fut, rest[1])
        elif kind == "fail":
            self._fail(*rest)
        elif kind == "warmed":
            self.warmup_report, self._warming = rest[0], False
        elif kind == "broken":
            self._broken = rest[0]
        elif kind == "fatal":
            self._fatal(rest[0])
        elif kind == "lost":   # the process died: everything it held is lost
            self._broken = self._broken or rest[0]
            for fut in list(self._accepting.values()):
                self._resolve(fut, EngineError(self._broken))
            self._accepting.clear()
            for rid in list(self._streams):
                self._fail(rid, EngineError(self._broken))
        else:
            log.error("unknown message from the engine process: %r", kind)

    def _fatal(self, err) -> None:
        self.fatal = err
        if self.on_fatal is not None:
            self.on_fatal(err)

    # ---- engine thread ----------------------------------------------------------------------

    def _take_commands(self, block: bool) -> list:
        out = []
        try:
            out.append(self._commands.get(block=block, timeout=1.0 if block else None))
            while True:
                out.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return out


class _ThreadSink:
    """The engine loop's sink on a thread of this process: results go to the event loop."""

    def __init__(self, front: AsyncEngine):
        self.front = front

    def resolve(self, accepted, err) -> None:
        self.front._loop.call_soon_threadsafe(self.front._resolve, accepted, err)

    def deliver(self, outputs) -> None:
        self.front._loop.call_soon_threadsafe(self.front._deliver, outputs)

    def fail(self, rid, err) -> None:
        self.front._loop.call_soon_threadsafe(self.front._fail, rid, err)

    def publish(self, snapshot: dict) -> None:
        self.front._snapshot = snapshot

    def warmed(self, report: dict) -> None:
        self.front.warmup_report = report
        self.front._warming = False

    def broken(self, reason: str) -> None:
        self.front._broken = reason

    def fatal(self, err) -> None:
        self.front._fatal(err)
