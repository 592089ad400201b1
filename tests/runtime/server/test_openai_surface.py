"""The OpenAI surface clients rely on, through the official `openai` client against a real server:
logprobs (checked against the CPU reference model's distribution), echo + max_tokens=0 prompt
scoring, prompt lists, n / best_of, penalties and logit_bias, structured outputs, tool calls and
reasoning in Kimi's chat format, /version /tokenize /detokenize."""
import json
import math

import httpx
import pytest
import torch

from .conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The quick brown fox"


def ids_of(choice):
    return choice.model_extra["token_ids"]


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The reference for the distribution sampled from: temperature, top-k, top-p on one row, plainly."""
    x = logits.double() / temperature
    if top_k:
        kth = x.topk(top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if top_p < 1.0:
        p, order = probs.sort(descending=True)
        drop = p.cumsum(-1) - p >= top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x.log_softmax(-1)


def test_sampled_logprobs_match_the_reference_distribution(server, ref_logits):
    ids = server.tokenizer.encode(PROMPT)
    kw = dict(temperature=0.8, top_p=0.9, top_k=40)
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=5, seed=7,
                                           temperature=kw["temperature"], top_p=kw["top_p"],
                                           extra_body={"top_k": kw["top_k"], "return_token_ids": True})
    c = r.choices[0]
    out = ids_of(c)
    logits = ref_logits(ids + out)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(out)
    for j, tok in enumerate(out):
        ref = processed_logprobs(logits[len(ids) - 1 + j], **kw)
        assert math.isfinite(ref[tok]) and abs(lp.token_logprobs[j] - float(ref[tok])) < 1e-3
        top = ref.topk(5).values.tolist()
        got = lp.top_logprobs[j].values()   # a dict by token text: byte tokens that render alike collapse
        assert max(got) == pytest.approx(top[0], abs=1e-3)
        assert all(any(abs(g - t) < 1e-3 for t in top) for g in got)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_and_streamed(server, ref_logits):
    msgs = [{"role": "user", "content": "hi"}]
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"return_token_ids": True})
    content = r.choices[0].logprobs.content
    out = ids_of(r.choices[0])
    assert len(content) == len(out) and all(len(t.top_logprobs) == 3 for t in content)
    from k3compile.runtime.server.chat_format import ChatFormat
    prompt = ChatFormat(server.tokenizer).render(msgs, None, {})
    logits = ref_logits(prompt + out)
    for j, t in enumerate(content):   # greedy: logprobs of the plain distribution, the token is its argmax
        ref = logits[len(prompt) - 1 + j].double().log_softmax(-1)
        assert t.logprob == pytest.approx(float(ref.max()), abs=1e-3) and t.bytes == list(server.tokenizer.token_bytes(out[j]))
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)


def test_echo_scores_the_prompt_like_lm_eval(server, ref_logits):
    """lm-evaluation-harness loglikelihood: echo + logprobs + max_tokens=0, a prompt list; the prompt
    logprobs are the reference model's, and the prefix cache still serves later requests."""
    prompts = ["Paris is the capital of France", "Paris is the capital of Spain"]
    r = server.client().completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1,
                                           temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, prompts):
        ids = server.tokenizer.encode(p)
        assert c.text == p and c.finish_reason == "length"
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = ref_logits(ids).double().log_softmax(-1)
        want = [float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)]
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
        assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(len(server.tokenizer.encode(p)) for p in prompts)
    # the scoring requests left their prefix in the cache: a repeat generation hits it
    again = server.client().completions.create(model=MODEL, prompt=prompts[0] + " and", max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # echo with generation, streamed: the prompt comes first
    chunks = list(server.client().completions.create(model=MODEL, prompt=prompts[0], max_tokens=3, echo=True,
                                                     logprobs=0, temperature=0, stream=True))
    text = "".join(ch.choices[0].text for ch in chunks)
    n_tokens = sum(len(ch.choices[0].logprobs.tokens) for ch in chunks if ch.choices[0].logprobs)
    assert text.startswith(prompts[0]) and n_tokens > len(server.tokenizer.encode(prompts[0]))
    server.wait_idle()


def test_prompt_list_equals_separate_requests(server, reference):
    prompts = ["abc", "def fib(n):", [256, 70, 71]]
    r = server.client().completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, p in zip(r.choices, prompts):
        ids = server.tokenizer.encode(p) if isinstance(p, str) else p
        assert ids_of(c) == reference(ids, 5)


def test_n_forks_one_prefill(server, reference):
    ids = server.tokenizer.encode(PROMPT + " jumps")
    before = server.front.metrics()
    r = server.client().completions.create(model=MODEL, prompt=PROMPT + " jumps", max_tokens=5, n=4, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(ids_of(c) == reference(ids, 5) for c in r.choices)   # greedy: every fork continues identically
    m = server.wait_idle()
    assert m["forked_requests"] - before["forked_requests"] == 3
    assert m["prefill_tokens"] - before["prefill_tokens"] <= len(ids)   # one prefill for the four
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == len(ids)
    sampled = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0,
                                                 seed=3, extra_body={"return_token_ids": True})
    assert len({tuple(ids_of(c)) for c in sampled.choices}) > 1   # each fork draws its own tokens
    chunks = list(server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                          max_tokens=3, n=2, temperature=0, stream=True))
    by_index = {}
    for ch in chunks:
        for c in ch.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
    assert set(by_index) == {0, 1} and by_index[0] == by_index[1]


def test_best_of_keeps_the_most_likely(server):
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=1, best_of=4, temperature=1.0,
                                           seed=11, logprobs=0)
    (c,) = r.choices
    assert c.index == 0 and r.usage.completion_tokens == 16   # all four samples count
    server.wait_idle()


def test_logit_bias_and_penalties(server, reference):
    ids = server.tokenizer.encode(PROMPT)
    greedy = reference(ids, 6)
    client = server.client()
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={"65": 100}, extra_body={"return_token_ids": True})
    assert ids_of(forced.choices[0]) == [65] * 4
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={str(greedy[0]): -100}, extra_body={"return_token_ids": True})
    assert ids_of(banned.choices[0])[0] != greedy[0]
    # a strong frequency penalty after a forced repeat: greedy never picks the same token twice in a row...
    rep = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, frequency_penalty=2.0,
                                    presence_penalty=2.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    out = ids_of(rep.choices[0])
    assert len(out) == 8
    # ...and it equals the reference greedy under the same penalty applied by hand at each step
    assert out == penalized_greedy(server, ids, 8, freq=2.0, pres=2.0)


def penalized_greedy(server, ids, n, freq, pres):
    from k3compile.model_def.loader import load_model
    model = load_model(MODEL, seed=0)
    from k3compile.model_def.batch import ForwardBatch
    from k3compile.model_def.cache import CacheTensors
    out = []
    with torch.no_grad():
        for _ in range(n):
            full = ids + out
            pages = -(-len(full) // 16)
            cache = CacheTensors.allocate(model.cache_spec(), 2, pages + 1, 16)
            logits = model.step(ForwardBatch.build("prefill", [full], [0], [list(range(1, pages + 1))], [1], 16),
                                cache)[0].double()
            for t in set(out):
                logits[t] -= freq * out.count(t) + pres
            out.append(int(logits.argmax()))
    return out


def test_structured_outputs(server):
    client = server.client()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json please"}],
                                       max_tokens=60, temperature=0.7, seed=1,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "s", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"n", "ok"} and isinstance(obj["n"], int) and isinstance(obj["ok"], bool)
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                       temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")
    chunks = list(client.completions.create(model=MODEL, prompt="code: ", max_tokens=12, temperature=1.0, seed=5,
                                            stream=True, extra_body={"guided_regex": "[A-F]{3}-[0-9]{2}"}))
    text = "".join(ch.choices[0].text for ch in chunks)
    import re
    assert re.fullmatch("[A-F]{3}-[0-9]{2}", text), text
    server.wait_idle()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                                     "maxLength": 8}},
                                                          "required": ["city"], "additionalProperties": False}}}]


def test_forced_tool_call_is_parsed_into_tool_calls(server):
    client = server.client()
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=400,
                                       temperature=0.5, seed=2)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("functions.get_weather:")
    assert set(json.loads(call.function.arguments)) == {"city"}
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=400, temperature=0.5, seed=2, stream=True))
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call and its result go back in as history
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=3, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length")


def test_reasoning_content_is_split(server):
    """A thinking request (chat_template_kwargs thinking): the output up to </think> is reasoning."""
    client = server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "think"}], max_tokens=30, temperature=1.0, seed=4,
              extra_body={"chat_template_kwargs": {"thinking": True}, "guided_regex": "[a-z]{4}</think>[A-Z]{3}"})
    m = client.chat.completions.create(**kw).choices[0].message
    assert len(m.model_extra["reasoning_content"]) == 4 and m.model_extra["reasoning_content"].islower()
    assert len(m.content) == 3 and m.content.isupper()
    chunks = list(client.chat.completions.create(**kw, stream=True))
    reasoning = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in chunks if ch.choices)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert (reasoning, content) == (m.model_extra["reasoning_content"], m.content)


def test_version_tokenize_detokenize(server):
    v = httpx.get(f"{server.base_url}/version")
    assert v.status_code == 200 and isinstance(v.json()["version"], str)
    r = httpx.post(f"{server.base_url}/tokenize", headers=AUTH, json={"model": MODEL, "prompt": "héllo"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == server.tokenizer.encode("héllo") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.front.max_context
    r = httpx.post(f"{server.base_url}/v1/detokenize", headers=AUTH, json={"model": MODEL, "tokens": body["tokens"]})
    assert r.json() == {"prompt": "héllo", "text": "héllo"}
    r = httpx.post(f"{server.base_url}/tokenize", headers=AUTH,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    from k3compile.runtime.server.chat_format import ChatFormat
    assert r.json()["tokens"] == ChatFormat(server.tokenizer).render([{"role": "user", "content": "hi"}], None, {})
    assert httpx.post(f"{server.base_url}/tokenize", json={"prompt": "x"}).status_code == 401
