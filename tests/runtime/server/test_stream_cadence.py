"""Tokens reach the client as each engine step completes: one SSE chunk per generated token, also
when the tokens decode to no text (ids outside the byte vocabulary, as a random large-vocabulary
model emits through the byte tokenizer; an incomplete character; a possible stop string) -- before,
such tokens sent nothing until the text completed, so a random k3-mini-6b streamed everything at
the end (traces/serve_cpu/). Checked on both endpoints, with the engine on a thread and in its own
process (runtime/server/engine_process.py), whose streams, aborts and death are checked too.
The model is the timed stand-in at zero cost (bench/stand_in_step.py); nothing here is timed."""
import functools
import time

import httpx
import pytest

from k3compile.bench.serve_stand_in import stand_in_engine
from k3compile.runtime.engine import EngineArgs
from k3compile.runtime.server.app import build_app
from k3compile.runtime.server.async_engine import AsyncEngine

from .conftest import MODEL, RunningServer

ARGS = EngineArgs(model=MODEL, device="cpu", overlap=True, memory_bytes=16 << 20)


def serve(tokens: str, process: bool) -> RunningServer:
    factory = functools.partial(stand_in_engine, ARGS, 0.0, 0.0, tokens, MODEL)
    front = AsyncEngine.spawn(factory) if process else AsyncEngine(factory())
    return RunningServer(build_app(front, MODEL, api_key=None), front, front.tokenizer)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request):
    s = serve("no-text", request.param == "process")
    yield s
    s.stop()


def completion_chunks(server, n: int, **extra) -> list[dict]:
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt=[65, 66, 67, 68], max_tokens=n, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, **extra})
    return [c for c in stream if c.choices]


def test_one_chunk_per_token_when_the_tokens_have_no_text(server):
    chunks = completion_chunks(server, 12)
    assert len(chunks) == 12
    assert "".join(c.choices[0].text for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "length"
    ids = [t for c in completion_chunks(server, 12, return_token_ids=True) for t in c.choices[0].token_ids]
    assert len(ids) == 12 and all(t >= 256 for t in ids)   # none of them is a byte: no text


def test_chat_streams_one_chunk_per_token_too(server):
    client = server.client()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=9, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) == 1 + 9 and chunks[-1].choices[0].finish_reason == "length"


def test_text_tokens_stream_one_chunk_per_token():
    s = serve("text", process=False)
    try:
        chunks = completion_chunks(s, 10)
    finally:
        s.stop()
    assert len(chunks) == 10 and all(len(c.choices[0].text) == 1 for c in chunks)


def test_the_engine_process_streams_what_the_thread_does():
    a, b = serve("text", process=False), serve("text", process=True)
    try:
        want = [c.choices[0].text for c in completion_chunks(a, 16)]
        got = [c.choices[0].text for c in completion_chunks(b, 16)]
        m = b.client().completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0)
        assert m.usage.completion_tokens == 5 and len(m.choices[0].text) == 5
    finally:
        a.stop()
        b.stop()
    assert got == want and len(want) == 16


def test_engine_process_abort_and_death():
    s = serve("no-text", process=True)
    try:
        client = s.client()
        stream = client.completions.create(model=MODEL, prompt=[70, 71], max_tokens=3000, stream=True,
                                           extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()   # the client leaves: the engine process frees the request
        assert s.wait_idle()["running"] == 0
        assert httpx.get(f"{s.base_url}/health").status_code == 200
        s.front._process.proc.kill()   # the engine process dies: the server says so and refuses work
        deadline = time.monotonic() + 30
        while httpx.get(f"{s.base_url}/health").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.get(f"{s.base_url}/health")
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]
        r = httpx.post(f"{s.base_url}/v1/completions", json={"model": MODEL, "prompt": [65], "max_tokens": 2})
        assert r.status_code == 503
        assert httpx.post(f"{s.base_url}/start_profile", json={}).status_code == 501
    finally:
        s.stop()
