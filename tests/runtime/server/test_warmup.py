"""Start-up warm-up: /health answers 503 ("warming up") until the engine's warm-up finished;
a request sent meanwhile waits and is then served; the warm-up leaves no trace in the engine."""
import threading

import httpx

from k3compile.runtime.server.app import build_app
from k3compile.runtime.server.async_engine import AsyncEngine

from .conftest import MODEL, RunningServer


class HeldWarmup:
    """The real engine, but its warm-up waits for `release` (so the test sees the window)."""

    def __init__(self, engine):
        self.engine, self.release = engine, threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def warmup(self):
        assert self.release.wait(60)
        return self.engine.warmup()


def test_health_waits_for_warmup_and_requests_queue_behind_it():
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    engine = HeldWarmup(LLMEngine(EngineArgs(model=MODEL, memory_bytes=16 << 20)))
    front = AsyncEngine(engine)
    server = RunningServer(build_app(front, MODEL), front, engine.tokenizer)
    try:
        h = httpx.get(f"{server.base_url}/health")
        assert h.status_code == 503 and "warming up" in h.json()["error"]
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        result = {}
        sender = threading.Thread(target=lambda: result.update(
            r=httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)))
        sender.start()
        sender.join(0.5)
        assert sender.is_alive(), "the request must wait for the warm-up"
        engine.release.set()
        sender.join(120)
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        report = front.warmup_report
        assert report is not None and report["seconds"] > 0 and "error" not in report
        m = server.wait_idle()
        usage = result["r"].json()["usage"]
        assert m["generated_tokens"] == 3 and m["prompt_tokens"] == usage["prompt_tokens"]   # counters reset
    finally:
        server.stop()
