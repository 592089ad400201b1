"""The server through the official openai client: completions and chat, streamed and not, equal to
offline greedy generation; stop strings; models; health; metrics; auth."""
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import API_KEY, MODEL

PROMPTS = ["def fib(n):", "The quick brown fox", "k3compile serves hybrid models. "]
N = 12


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"] if hasattr(choice, "model_extra") else choice.token_ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_offline_generate(server, reference, prompt):
    ids = server.tokenizer.encode(prompt)
    expect = reference(ids, N)
    r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    (choice,) = r.choices
    assert token_ids(choice) == expect
    assert choice.text == server.tokenizer.decode(expect)
    assert choice.finish_reason == ("stop" if expect[-1] == server.tokenizer.eos_token_id else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expect))
    assert r.usage.total_tokens == len(ids) + len(expect)
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < len(ids)


def test_completion_prompt_as_token_ids(server, reference):
    ids = [256, 300, 65, 66, 400, 67]   # specials and non-byte ids are fine as token-id prompts
    r = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=N, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert token_ids(r.choices[0]) == reference(ids, N)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_streamed_completion_equals_offline(server, reference, prompt):
    ids = server.tokenizer.encode(prompt)
    expect = reference(ids, N)
    stream = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"return_token_ids": True})
    chunks = list(stream)
    *deltas, usage_chunk = chunks
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in deltas) == server.tokenizer.decode(expect)
    assert [t for c in deltas for t in token_ids(c.choices[0])] == expect
    assert [c.choices[0].finish_reason for c in deltas][-1] in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expect)
    assert usage_chunk.usage.prompt_tokens == len(ids)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]


def test_chat_greedy_and_streamed_equal_offline(server, reference):
    from k3compile.runtime.server.chat_format import ChatFormat
    ids = ChatFormat(server.tokenizer).render(MESSAGES, None, {})
    expect = reference(ids, N)
    text = server.tokenizer.decode(expect)
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expect))

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=N,
                                                 temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_is_reproducible(server):
    client = server.client()
    kw = dict(model=MODEL, prompt="abc", max_tokens=N, temperature=0.9, top_p=0.9, seed=1234,
              extra_body={"top_k": 50, "return_token_ids": True})
    a, b = (token_ids(client.completions.create(**kw).choices[0]) for _ in range(2))
    assert a == b and len(a) >= 1


def test_stop_string_spanning_tokens_cuts_the_text(server, reference):
    """Pick a two-character stop string from the greedy output (two byte tokens): the text ends right
    before its first occurrence, streamed or not, with finish_reason 'stop'."""
    prompt, text, stop = None, None, None
    for p in PROMPTS:
        t = server.tokenizer.decode(reference(server.tokenizer.encode(p), N))
        for k in range(1, len(t) - 1):
            if "\ufffd" not in t[k:k + 2] and len(t[k:k + 2].encode()) >= 2:
                prompt, text, stop = p, t, t[k:k + 2]
                break
        if stop:
            break
    assert stop is not None, "no greedy output with two decodable characters to use as a stop string"
    expect = text[:text.find(stop)]
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, stop=[stop, "\x7f\x7f"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expect, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"
    server.wait_idle()   # the stop aborted the engine request


def test_models(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_health(server):
    r = httpx.get(f"{server.base_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics_parse_as_prometheus_text(server):
    server.client().completions.create(model=MODEL, prompt="metrics", max_tokens=4, temperature=0)
    server.wait_idle()
    r = httpx.get(f"{server.base_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    assert samples["k3compile_engine_healthy"] == 1.0
    assert samples["k3compile_requests_running"] == 0 and samples["k3compile_requests_queued"] == 0
    assert samples["k3compile_generation_tokens_total"] >= 4
    assert samples["k3compile_generation_tokens_per_second"] >= 0
    for name in ("k3compile_cache_hit_tokens_total", "k3compile_cache_hit_rate", "k3compile_kv_pool_usage",
                 "k3compile_state_pool_usage"):
        assert name in samples, name
    assert 0.0 <= samples["k3compile_cache_hit_rate"] <= 1.0


def test_api_key_is_enforced(server):
    import openai as oa
    bad = oa.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(oa.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(oa.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/health").status_code == 200   # probes need no key
    ok = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_server_without_api_key_is_open():
    from .conftest import start_server
    s = start_server(api_key=None)
    try:
        r = httpx.post(f"{s.base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        s.stop()
