"""Schema fuzz: hypothesis draws request bodies over the whole parameter space of both endpoints --
every key the validator knows, with values of every JSON type, extreme numbers (subnormal, 1e308,
2**70, NaN, inf), lone surrogates, deep nesting, invalid UTF-8 -- and posts them while greedy
streams (the victims) run on the same server. Asserts: no 5xx (and no error event inside a 200
stream), the victims' tokens equal offline generation, the server healthy after.

Bounded for CI on CPU: a fixed number of examples, derandomized (a fixed seed, no example
database), max_tokens of accepted requests at most 4, 127.0.0.1 only. It prints what it tried:
accepted bodies and rejections by (status, code, param).
"""
import asyncio
import json
import threading

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
EXAMPLES = 60
VICTIM_PROMPTS = ["victim one: ", "the second victim ", "3rd"]
VICTIM_TOKENS = 24

# -- values -----------------------------------------------------------------------------------------
# Each body is valid except, in about half of them, one parameter set to something else: valid
# values cover the edges the validator accepts (subnormal and huge temperatures, top_p down to
# 5e-324, top_k and seed at the ends of their ranges); "something else" is any JSON value, with
# extreme numbers (2**70, 1e308, NaN, inf) and strings holding lone surrogates.
lone_surrogate = st.characters(categories=["Cs"])
texts = st.text(max_size=12)
odd_texts = st.one_of(texts, st.text(st.one_of(st.characters(), lone_surrogate), min_size=1, max_size=6))
extreme_floats = st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-6, 1e-5, 1.0, 2.0, 1e308, -1.0, -1e308,
                                  float("inf"), float("-inf"), float("nan")])
edge_ints = st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63),
                             -(2**63) - 1, -(2**70)])
ints = st.one_of(st.integers(-3, 3), edge_ints, st.integers())
scalars = st.one_of(st.none(), st.booleans(), ints, extreme_floats, st.floats(), odd_texts)
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(odd_texts, inner, max_size=3)),
                        max_leaves=6)

VALID = {   # the valid values of every parameter, edges included
    "temperature": st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1e-6, 1e-5, 2.0, 1e308]), st.floats(0, 2)),
    "top_p": st.one_of(st.sampled_from([5e-324, 1e-300, 1e-6, 1.0]), st.floats(0, 1, exclude_min=True)),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 2**63, 2**70]), st.integers(0, 400)),
    "seed": st.one_of(st.sampled_from([0, -1, 2**63 - 1, 2**64 - 1, -(2**63)]), st.integers(-2**63, 2**64 - 1)),
    "n": st.just(1),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=16)),
    "stream": st.booleans(),
    "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0),
    "logit_bias": st.just({}),
    "user": texts,
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "logprobs": st.just(False),
}
COMPLETION = {"echo": st.just(False), "best_of": st.just(1), "suffix": st.just("")}
CHAT = {"top_logprobs": st.just(0), "response_format": st.just({"type": "text"}), "tools": st.just([]),
        "tool_choice": st.just("none")}
prompts = st.one_of(st.text(min_size=0, max_size=40), st.lists(st.integers(0, 258), min_size=1, max_size=12))
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
     "content": st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                          max_size=2))}), min_size=1, max_size=3)


@st.composite
def bodies(draw, chat: bool):
    extra = CHAT if chat else COMPLETION
    body = {"model": MODEL, "max_tokens": draw(st.integers(1, 4))}   # short generations on a CPU
    body["messages" if chat else "prompt"] = draw(messages if chat else prompts)
    for key in draw(st.sets(st.sampled_from(sorted({**VALID, **extra})), max_size=6)):
        body[key] = draw({**VALID, **extra}[key])
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if draw(st.booleans()):   # one parameter set to something else (or an unknown key)
        keys = sorted({"model", "max_tokens", "messages" if chat else "prompt", "stream_options",
                       "max_completion_tokens" if chat else "best_of", "no_such_key", *VALID, *extra})
        body[draw(st.sampled_from(keys))] = draw(anything)
    return body


raw_bodies = st.sampled_from([
    b"[" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b"\xff\xfe\xfd", b'{"model": "k3-tiny", "prompt": "\xc3"}',
    json.dumps({"model": MODEL, "prompt": "\ud800", "max_tokens": 2}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\udfff x"}], "max_tokens": 2}).encode(),
    b'{"model": "k3-tiny", "prompt": "x", "max_tokens": 1e400}', b"", b"null", b'"just a string"', b"{}",
])
requests = st.one_of(st.tuples(st.just("/v1/completions"), bodies(chat=False)),
                     st.tuples(st.just("/v1/chat/completions"), bodies(chat=True)),
                     st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw_bodies))


# -- victims ----------------------------------------------------------------------------------------
class Victims:
    """Greedy streams in rounds on a thread of their own until stopped; every round's tokens recorded."""

    def __init__(self, server):
        self.server, self.rounds, self.error = server, [], None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            asyncio.run(self._rounds())
        except BaseException as e:   # reported by the test
            self.error = e

    async def _rounds(self):
        async with httpx.AsyncClient(base_url=self.server.base_url, headers=AUTH, timeout=120) as client:
            while not self.stop.is_set() or not self.rounds:
                self.rounds.append(await asyncio.gather(*(self._stream(client, p) for p in VICTIM_PROMPTS)))

    @staticmethod
    async def _stream(client, prompt):
        ids = []
        body = {"model": MODEL, "prompt": prompt, "max_tokens": VICTIM_TOKENS, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    ids.extend(chunk["choices"][0]["token_ids"])
        return ids


def errors_500(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    line = next((ln for ln in text.splitlines() if ln.startswith('k3compile_request_errors_total{status="500"}')),
                None)
    return float(line.split()[-1]) if line else 0.0


def test_schema_fuzz_while_victims_stream(server, reference):
    expected = [reference(server.tokenizer.encode(p), VICTIM_TOKENS) for p in VICTIM_PROMPTS]
    before_500 = errors_500(server)
    tried = {"accepted": 0, "rejected": {}}
    victims = Victims(server)
    victims.thread.start()
    client = httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    @example(("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": -1.0}))
    @example(("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "top_p": 0.0}))
    @example(("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2**70}))
    @example(("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 0}))
    @example(("/v1/completions", {"model": MODEL, "max_tokens": 2}))
    @example(("/v1/completions", {"model": "no-such-model", "prompt": "x", "max_tokens": 2}))
    @example(("/v1/chat/completions", {"model": MODEL, "messages": "not a list", "max_tokens": 2}))
    @example(("/v1/chat/completions", b"\xff\xfe\xfd"))
    @example(("/v1/completions", b"[1, 2"))  # explicit rejections of distinct kinds: the drawn ones vary by version
    def post(req):
        path, payload = req
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8", "surrogatepass")
        r = client.post(path, content=content)
        assert r.status_code < 500, (path, payload, r.status_code, r.text)
        if r.status_code == 200:
            tried["accepted"] += 1
            assert "server_error" not in r.text, (path, payload, r.text)
        else:
            err = r.json()["error"]
            key = (r.status_code, err["code"], err["param"])
            tried["rejected"][key] = tried["rejected"].get(key, 0) + 1

    try:
        post()
    finally:
        victims.stop.set()
        victims.thread.join(300)
        client.close()
    assert victims.error is None, repr(victims.error)
    for round_ in victims.rounds:
        assert round_ == expected
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert errors_500(server) == before_500
    assert tried["accepted"] >= EXAMPLES // 4 and len(tried["rejected"]) >= 8, tried   # it reached both sides
    print(f"\nschema fuzz: {EXAMPLES} bodies, {tried['accepted']} accepted, rejections by (status, code, param): "
          f"{dict(sorted(tried['rejected'].items(), key=str))}; {len(victims.rounds)} victim rounds unchanged")
    server.wait_idle()
