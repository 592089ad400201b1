"""Many clients at once, and clients that leave early.

64 streaming clients run concurrently (AsyncOpenAI); every stream's tokens, joined, must equal the
non-streamed greedy result for its prompt (no token lost, duplicated or sent to the wrong client).
Closing a stream (or a non-streaming request timing out) early must abort the engine request.
"""
import asyncio
import time

import httpx
import pytest

from .conftest import API_KEY, MODEL

CLIENTS = 64
MAX_TOKENS = 8
SYSTEMS = ["You are a helpful assistant. ", "Answer in French. ", "def solve(): "]


def prompt(i: int) -> str:
    # shared prefixes (prefix cache hits) and different lengths (mixed prefill chunks)
    return SYSTEMS[i % len(SYSTEMS)] + f"client {i} " + "x" * (i % 7)


def test_64_concurrent_streams_lose_nothing(server, reference):
    prompts = [prompt(i) for i in range(CLIENTS)]
    extra = {"return_token_ids": True}

    async def main():
        client = server.async_client(timeout=120)

        async def streamed(p):
            ids, text, usage, finish = [], [], None, None
            stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body=extra)
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    ids.extend(c.model_extra["token_ids"])
                    text.append(c.text)
                    finish = c.finish_reason or finish
            return ids, "".join(text), usage, finish

        async def whole(p):
            r = await client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                extra_body=extra)
            return r.choices[0].model_extra["token_ids"], r.choices[0].text

        t0 = time.perf_counter()
        streams = await asyncio.gather(*(streamed(p) for p in prompts))
        wall = time.perf_counter() - t0
        wholes = await asyncio.gather(*(whole(p) for p in prompts))
        await client.close()
        return streams, wholes, wall

    streams, wholes, wall = asyncio.run(main())
    total = 0
    for p, (ids, text, usage, finish), (whole_ids, whole_text) in zip(prompts, streams, wholes):
        assert ids == whole_ids, p
        assert text == whole_text == server.tokenizer.decode(ids), p
        assert usage.completion_tokens == len(ids) and finish in ("stop", "length")
        total += len(ids)
    for i in (0, 1, 31, 63):   # and against offline generation
        assert streams[i][0] == reference(server.tokenizer.encode(prompts[i]), MAX_TOKENS), prompts[i]
    print(f"\nconcurrency: {CLIENTS} streaming clients, {total} tokens, {wall:.2f} s wall, "
          f"{total / wall:.1f} tokens/s (CPU, k3-tiny; relative only)")
    server.wait_idle()


def test_closing_a_stream_aborts_its_request(server):
    before = server.wait_idle()
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt="abort me", max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    seen = 0
    for chunk in stream:
        seen += len(chunk.choices[0].model_extra["token_ids"])
        if seen >= 3:
            break
    during = server.front.metrics()   # the request holds pages and a working slot of its own
    assert during["running"] == 1
    assert during["pages_used"] > during["tree_pages"] and during["slots_used"] > during["checkpoints"]
    stream.close()
    after = server.wait_idle()   # nothing running or queued: the request was aborted, not run out
    assert after["generated_tokens"] - before["generated_tokens"] < 2000
    assert_pools_released(after)


def test_a_non_streaming_client_that_gives_up_aborts_its_request(server):
    before = server.wait_idle()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "prompt": "slow", "max_tokens": 2000, "ignore_eos": True}, timeout=0.5)
    after = server.wait_idle()
    assert after["generated_tokens"] - before["generated_tokens"] < 2000
    assert_pools_released(after)


def assert_pools_released(after):
    """No request holds pages or state slots any more: every page in use belongs to the prefix
    cache's tree and every slot in use is a checkpoint (both are the cache's, evictable)."""
    assert after["pages_used"] == after["tree_pages"], after
    assert after["slots_used"] == after["checkpoints"], after
    assert after["running"] == 0 and after["queued"] == 0
