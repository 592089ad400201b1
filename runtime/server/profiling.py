"""Profile a running server: `POST /start_profile` and `POST /stop_profile` (SGLang's names).

    curl -X POST localhost:8000/start_profile -d '{"num_steps": 5, "output_dir": "/tmp/prof"}'
    ... traffic ...
    curl -X POST localhost:8000/stop_profile        # or let it stop after num_steps
    k3compile report /tmp/prof/k3compile-<time>.trace.json.gz

The profiler must run on the engine thread (the only thread that touches the engine), so this
module wraps the engine's `step` (the AsyncEngine's public `engine` attribute): when armed, the
wrapper starts torch.profiler before the next step, puts each step in a `k3.step#i` range (the
report's default step pattern), and after `num_steps` steps or on /stop_profile exports a chrome
trace (gzipped). With CUDA graphs it first runs the decode graph node by node on padding rows
(writes land in the reserved sinks only) so the report can attribute replayed kernels to nodes.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from fastapi import Request

log = logging.getLogger("k3compile.server")


class ServerProfiler:
    def __init__(self, engine):
        self.engine = engine
        self._step = engine.step
        self._lock = threading.Lock()
        self._armed: dict | None = None      # set by start(), consumed by the engine thread
        self._stop = False
        self._prof = None
        self._steps = 0
        self.last_trace: str | None = None
        self.done = threading.Event()
        engine.step = self.step              # every step now goes through us (engine thread)

    # ---- HTTP side ----
    def start(self, num_steps: int | None, output_dir: str, attribution_buckets: tuple = (1,)) -> None:
        with self._lock:
            if self._armed is not None or self._prof is not None:
                raise ValueError("a profile is already running; POST /stop_profile first")
            os.makedirs(output_dir, exist_ok=True)
            self.done.clear()
            self._armed = {"num_steps": num_steps, "output_dir": output_dir, "buckets": attribution_buckets}

    def stop(self) -> None:
        with self._lock:
            if self._armed is None and self._prof is None:
                raise ValueError("no profile is running; POST /start_profile first")
            self._stop = True

    # ---- engine thread ----
    def step(self):
        from torch.profiler import record_function

        if self._armed is not None and self._prof is None:
            self._begin()
        if self._prof is None:
            return self._step()
        with record_function(f"k3.step#{self._steps}"):
            out = self._step()
        self._steps += 1
        limit = self._cfg["num_steps"]
        if self._stop or (limit is not None and self._steps >= limit):
            self._finish()
        return out

    def _begin(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self._cfg, self._armed, self._stop, self._steps = self._armed, None, False, 0
        cuda = torch.cuda.is_available()
        self._prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        self._prof.__enter__()
        self._tables = self._attribution()

    def _attribution(self) -> list[dict]:
        """Node tables for the decode graph at each requested bucket, when the executor replays graphs."""
        from k3compile.engine.profiling import AttributionRun, attribution_table, padding_step_args, sync

        ex = getattr(getattr(self.engine, "runner", None), "executor", None)
        graphs = getattr(getattr(self.engine, "provider", None), "graphs", None)
        if ex is None or not getattr(ex, "cuda_graphs", False) or not graphs or "decode" not in graphs:
            return []
        tables = []
        for i, bs in enumerate(b for b in self._cfg["buckets"] if b in ex.buckets):
            run = AttributionRun(f"decode bs={bs} (padding rows)", graphs["decode"], padding_step_args(ex, bs))
            tables.append(attribution_table(run, i, (ex.cache.ssm, ex.cache.conv, ex.cache.kv)))
            sync(ex.device)
        return tables

    def _finish(self) -> None:
        from k3compile.engine.profiling import write_trace

        prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
            path = os.path.join(self._cfg["output_dir"], f"k3compile-{time.strftime('%Y%m%d-%H%M%S')}.trace.json.gz")
            self.last_trace = write_trace(prof, path, self._tables)
            log.info("profile of %d steps written to %s", self._steps, path)
        except Exception:
            log.exception("writing the profile failed")
        finally:
            self._stop = False
            self.done.set()


def register(app, front) -> ServerProfiler | None:
    """Add POST /start_profile and /stop_profile to the app (answering 501 when the engine runs in a
    process of its own)."""
    from fastapi.responses import JSONResponse

    if front.engine is None:   # the engine runs in its own process: its steps cannot be wrapped from here
        gone = {"error": {"message": "profiling needs the engine in the server's process: serve without "
                          "--engine-process", "type": "invalid_request_error", "param": None, "code": None}}

        @app.post("/start_profile")
        async def start_profile_unavailable():
            return JSONResponse(gone, status_code=501)

        @app.post("/stop_profile")
        async def stop_profile_unavailable():
            return JSONResponse(gone, status_code=501)

        return None
    profiler = ServerProfiler(front.engine)

    @app.post("/start_profile")
    async def start_profile(request: Request):
        from .edge import parse_json   # a body that is not JSON is a 400, like on every route

        raw = await request.body()
        body = parse_json(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "body must be a JSON object", "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=400)
        steps = body.get("num_steps")
        buckets = body.get("attribution_buckets", [1])
        bad = (steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1)) or \
            not isinstance(buckets, list) or not all(isinstance(b, int) and b >= 1 for b in buckets)
        if bad:
            return JSONResponse({"error": {"message": "num_steps must be a positive integer and attribution_buckets "
                                                      "a list of positive integers", "type": "invalid_request_error",
                                           "param": "num_steps", "code": None}}, status_code=400)
        out = str(body.get("output_dir") or os.environ.get("K3COMPILE_PROFILE_DIR", "profiles"))
        try:
            profiler.start(steps, out, tuple(buckets))
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": None,
                                           "code": None}}, status_code=409)
        return {"status": "armed", "num_steps": steps, "output_dir": out}

    @app.post("/stop_profile")
    async def stop_profile():
        try:
            profiler.stop()
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": None,
                                           "code": None}}, status_code=409)
        return {"status": "stopping: the trace is written after the engine's next step"}

    return profiler
