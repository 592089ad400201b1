"""The engine in a child process of the server (`AsyncEngine.spawn`), as vLLM V1 runs its EngineCore:
the child builds the LLMEngine and runs the engine loop (runtime/server/engine_loop.py); the server
process keeps the HTTP side, detokenization and streaming. They share no GIL.

One duplex pipe. Server -> engine: the loop's commands (Add, Abort, Stop), pickled. Engine ->
server: ("ready", tokenizer, config, max_context, memory summary) once built (or ("failed", why)),
then ("step", outputs, metrics snapshot) once per iteration with outputs -- and for idle iterations,
at most every _IDLE_PUBLISH_S -- plus ("resolve", rid, error), ("fail", rid, error), ("warmed",
report), ("broken", reason). The event loop reads the pipe with `add_reader`: no thread of its own.
A child that exits unasked (killed, out of memory) breaks the engine: every request it held fails
and /health says so.

The child is started with "spawn" (a CUDA context cannot cross a fork), so `factory` must pickle:
functools.partial(LLMEngine, EngineArgs(...)) does.
"""
from __future__ import annotations

import logging
import multiprocessing
import time

from .engine_loop import EngineError, EngineLoop, Stop

log = logging.getLogger("k3compile.server")

_IDLE_PUBLISH_S = 0.05   # metrics of iterations without outputs are sent at most this often
_START_TIMEOUT_S = 1800.0   # building a large engine (weights, graphs) takes minutes


class EngineProcess:
    """Server-side handle of the engine process."""

    def __init__(self, factory, warmup: bool):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_main, args=(factory, child, warmup), name="k3compile-engine", daemon=True)
        self.proc.start()
        child.close()
        self._front = self._loop = None
        self._stopping = False
        msg = self._first_message()
        if msg[0] != "ready":
            self.proc.join(5)
            raise RuntimeError(f"the engine process failed to build the engine: {msg[1]}")
        _, self.tokenizer, self.config, self.max_context, self.memory_summary = msg

    def _first_message(self):
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                return ("failed", f"it exited with code {self.proc.exitcode}")
            if time.monotonic() > deadline:
                self.proc.kill()
                return ("failed", f"not built within {_START_TIMEOUT_S:g} s")
        try:
            return self.conn.recv()
        except EOFError:
            return ("failed", f"it exited with code {self.proc.join(5) or self.proc.exitcode}")

    def alive(self) -> bool:
        return self.proc.is_alive()

    def attach(self, loop, front) -> None:
        """Read the engine's messages on `loop`, handing each to `front.engine_message(kind, ...)`."""
        self._front, self._loop = front, loop
        loop.add_reader(self.conn.fileno(), self._on_readable)

    def send(self, cmd) -> None:
        try:
            self.conn.send(cmd)
        except (OSError, EOFError, ValueError):   # the engine is gone: _on_readable reports it
            pass

    def _on_readable(self) -> None:   # on the loop
        front = self._front
        try:
            while self.conn.poll():
                front.engine_message(*self.conn.recv())
        except (EOFError, OSError):
            self._lost()

    def _detach(self) -> None:
        if self._loop is not None:
            try:
                self._loop.remove_reader(self.conn.fileno())
            except (ValueError, OSError):
                pass
            self._loop = None

    def _lost(self) -> None:
        self._detach()
        if not self._stopping:
            self.proc.join(1)
            log.error("the engine process exited (code %s)", self.proc.exitcode)
            self._front.engine_message("lost", f"the engine process exited (code {self.proc.exitcode})")

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stopping = True
        self._detach()
        self.send(Stop())
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()


class _PipeSink:
    """The engine loop's sink in the engine process: one message per iteration with outputs."""

    def __init__(self, conn):
        self.conn = conn
        self._outputs: list = []
        self._last_publish = 0.0

    def resolve(self, rid, err) -> None:
        self.conn.send(("resolve", rid, err))

    def deliver(self, outputs) -> None:
        self._outputs.extend(outputs)

    def fail(self, rid, err) -> None:
        self.conn.send(("fail", rid, err))

    def publish(self, snapshot: dict) -> None:
        now = time.monotonic()
        if self._outputs or now - self._last_publish >= _IDLE_PUBLISH_S:
            self.conn.send(("step", self._outputs, snapshot))
            self._outputs, self._last_publish = [], now

    def warmed(self, report: dict) -> None:
        self.conn.send(("warmed", report))

    def broken(self, reason: str) -> None:
        self.conn.send(("broken", reason))

    def fatal(self, err) -> None:
        self.conn.send(("fatal", err))


def _take_commands(conn):
    def take(block: bool) -> list:
        out = []
        try:
            if block and not conn.poll(1.0):
                return out
            while conn.poll():
                out.append(conn.recv())
        except (EOFError, OSError):   # the server closed its end: stop
            out.append(Stop())
        return out
    return take


def _main(factory, conn, warmup: bool) -> None:
    """The engine process: build, report, loop until Stop (or the server's end of the pipe closes)."""
    server_log = logging.getLogger("k3compile.server")   # the warm-up time and engine failures, as on a thread
    if not server_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("k3compile serve: %(message)s"))
        server_log.addHandler(handler)
        server_log.setLevel(logging.INFO)
    try:
        engine = factory()
    except BaseException as e:
        conn.send(("failed", repr(e)))
        return
    conn.send(("ready", engine.tokenizer, engine.config, engine.max_context, engine.memory_summary()))
    loop = EngineLoop(engine, _take_commands(conn), _PipeSink(conn), warmup and hasattr(engine, "warmup"))
    try:
        loop.run()
    finally:
        engine.close()


__all__ = ["EngineProcess", "EngineError"]
