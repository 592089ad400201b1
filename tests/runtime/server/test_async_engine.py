"""The async front over a real k3-tiny engine: ordering, rejection, and engine failures (injected
by a wrapper whose step/abort raise on demand) that fail only the requests the engine held."""
import asyncio

import httpx
import pytest

from k3compile.runtime.sampling import SamplingParams
from k3compile.runtime.server.app import build_app
from k3compile.runtime.server.async_engine import AsyncEngine, EngineError

from .conftest import MODEL, RunningServer


def new_engine():
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    return LLMEngine(EngineArgs(model=MODEL))


class Flaky:
    """The real engine, but `step()` raises while `fail_steps` > 0 and `abort()` while `fail_abort`."""

    def __init__(self, engine):
        self.engine, self.fail_steps, self.fail_abort = engine, 0, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        return self.engine.step()

    def abort(self, rid):
        if self.fail_abort:
            raise RuntimeError("injected abort failure")
        return self.engine.abort(rid)


@pytest.fixture(scope="module")
def flaky():
    return Flaky(new_engine())


def params(n, **kw):
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def run(front: AsyncEngine, coro_fn):
    async def main():
        front.start()
        try:
            return await coro_fn()
        finally:
            front.shutdown()
    return asyncio.run(main())


async def drain(stream) -> list[int]:
    ids = []
    async for out in stream:
        ids.extend(out.new_token_ids)
    return ids


def test_outputs_arrive_complete_and_rejections_are_per_request(flaky):
    front = AsyncEngine(flaky)
    tok = flaky.tokenizer

    async def body():
        a = await front.add("a", tok.encode("first"), params(7))
        b = await front.add("b", tok.encode("second"), params(5))
        with pytest.raises(ValueError, match="already in use"):
            await front.add("a", tok.encode("dup"), params(3))
        with pytest.raises(ValueError):
            await front.add("empty", [], params(3))   # the engine's own check
        ids_a, ids_b = await asyncio.gather(drain(a), drain(b))
        assert (len(ids_a), len(ids_b)) == (7, 5)
        assert a.finished and b.finished

    run(front, body)
    assert front.metrics()["in_flight"] == 0


def test_failed_step_fails_the_held_requests_and_later_ones_are_served(flaky):
    front = AsyncEngine(flaky)
    tok = flaky.tokenizer

    async def body():
        victim = await front.add("victim", tok.encode("doomed"), params(200))
        first = await victim.__anext__()
        assert first.new_token_ids
        flaky.fail_steps = 1
        with pytest.raises(EngineError, match="injected step failure"):
            await drain(victim)
        assert front.health() is None   # recovered: the aborts drained
        after = await front.add("after", tok.encode("fine"), params(6))
        assert len(await drain(after)) == 6

    run(front, body)
    assert not flaky.engine.has_unfinished()


def test_unrecoverable_engine_is_reported_and_refuses_work():
    broken = Flaky(new_engine())
    front = AsyncEngine(broken)
    server = RunningServer(build_app(front, MODEL), front, broken.tokenizer)
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "ignore_eos": True}
        broken.fail_steps, broken.fail_abort = 10**9, True
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        h = httpx.get(f"{server.base_url}/health")
        assert h.status_code == 503 and "injected" in h.json()["error"]
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 503
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert "k3compile_engine_healthy 0.0" in metrics
    finally:
        server.stop()


def test_error_mid_stream_is_an_sse_error_event(flaky):
    import openai
    front = AsyncEngine(flaky)
    server = RunningServer(build_app(front, MODEL), front, flaky.tokenizer)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="stream", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        flaky.fail_steps = 1
        with pytest.raises(openai.APIError, match="injected step failure"):
            for _ in stream:
                pass
        ok = client.completions.create(model=MODEL, prompt="next", max_tokens=3, extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 3
    finally:
        server.stop()
