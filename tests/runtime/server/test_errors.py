"""Malformed requests: each gets the right 4xx with an OpenAI-style error body, and the server
keeps serving (the next request succeeds)."""
import httpx
import openai
import pytest

from .conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK = {"model": MODEL, "prompt": "ok", "max_tokens": 2, "temperature": 0}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES = [
    # (path, raw body or JSON, status, param, code)
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"\xff\xfe", 400, None, "invalid_json"),
    ("/v1/completions", [1, 2], 400, None, "invalid_type"),
    ("/v1/completions", {**OK, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/completions", {k: v for k, v in OK.items() if k != "model"}, 400, "model", "missing_required_parameter"),
    ("/v1/completions", {k: v for k, v in OK.items() if k != "prompt"}, 400, "prompt", "missing_required_parameter"),
    ("/v1/completions", {**OK, "max_tokens": -5}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**OK, "max_tokens": "10"}, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {**OK, "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {**OK, "top_p": 1.01}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {**OK, "top_k": "5"}, 400, "top_k", "invalid_type"),
    ("/v1/completions", {**OK, "n": 0}, 400, "n", "invalid_value"),
    ("/v1/completions", {**OK, "logit_bias": {"100000": 1}}, 400, "logit_bias", None),   # out of vocabulary
    ("/v1/completions", {**OK, "guided_regex": "a("}, 400, "prompt", None),   # llguidance rejects the regex
    ("/v1/detokenize", {"model": MODEL, "tokens": [1, 100000]}, 400, "tokens", "invalid_value"),
    ("/v1/completions", {**OK, "stop": {"a": 1}}, 400, "stop", "invalid_type"),
    ("/v1/completions", {**OK, "stream": "true"}, 400, "stream", "invalid_type"),
    ("/v1/completions", {**OK, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("/v1/completions", {**OK, "prompt": [1, 2, 100000]}, 400, "prompt", None),   # out of vocabulary
    ("/v1/completions", lambda ctx: {**OK, "prompt": "x" * ctx}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", lambda ctx: {**OK, "prompt": "x" * 100, "max_tokens": ctx}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", {k: v for k, v in CHAT_OK.items() if k != "messages"}, 400, "messages",
     "missing_required_parameter"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": []}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user"}]}, 400, "messages[0].content",
     "missing_required_parameter"),
    ("/v1/chat/completions", lambda ctx: {**CHAT_OK, "messages": [{"role": "user", "content": "x" * ctx}]}, 400,
     "messages", "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT_OK, "model": "nope"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": -0.5, "stream": True}, 400, "temperature", "invalid_value"),
    ("/v1/no-such-route", {}, 404, None, "not_found"),
]


@pytest.mark.parametrize("path, body, status, param, code", CASES)
def test_bad_request_is_a_4xx_and_the_server_keeps_serving(server, path, body, status, param, code):
    if callable(body):   # sized by the engine's context length
        body = body(server.front.max_context)
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.base_url}{path}", headers={**AUTH, "Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code)
    nxt = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, json=OK)
    assert nxt.status_code == 200 and nxt.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_wrong_method_is_405(server):
    r = httpx.get(f"{server.base_url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_openai_client_raises_on_client_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="'n'"):
        client.completions.create(model=MODEL, prompt="x", n=500)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * server.front.max_context}],
                                       stream=True)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=2).choices[0].text is not None
    server.wait_idle()
