"""Request parsing: every invalid field is a 400 naming the parameter; valid bodies parse exactly."""
import pytest

from k3compile.runtime.server.protocol import ApiError, parse_chat, parse_completion

BASE = {"model": "m", "prompt": "hi"}


def err(fn, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body)
    assert e.value.status == 400
    return e.value


def test_completion_defaults_and_values():
    r = parse_completion(BASE)
    assert (r.prompt, r.max_tokens, r.temperature, r.top_p, r.top_k, r.stop, r.stream) == ("hi", None, 1.0, 1.0, 0, [], False)
    r = parse_completion({**BASE, "max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 7,
                          "stop": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed, r.stop, r.include_usage) == (5, 0.0, 0.5, 3, 7, ["x"], True)
    assert parse_completion({**BASE, "stop": ["a", "b"], "top_k": -1}).stop == ["a", "b"]
    assert parse_completion({**BASE, "top_k": -1}).top_k == 0


@pytest.mark.parametrize("prompt, expect", [("x", "x"), (["x"], "x"), ([1, 2], [1, 2]), ([[3]], [3])])
def test_prompt_forms(prompt, expect):
    assert parse_completion({**BASE, "prompt": prompt}).prompt == expect


@pytest.mark.parametrize("patch, param", [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": "0.5"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"n": 129}, "n"), ({"n": 0}, "n"), ({"stop": 3}, "stop"), ({"stop": [""]}, "stop"),
    ({"stop": ["a", 1]}, "stop"), ({"seed": "1"}, "seed"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"prompt": None}, "prompt"),
    ({"prompt": 5}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ["a", 3]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"model": None}, "model"), ({"model": 3}, "model"),
    ({"echo": 1}, "echo"), ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"), ({"logit_bias": {"x": 2}}, "logit_bias"),
    ({"logit_bias": {"1": 200}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"), ({"suffix": "s"}, "suffix"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a", "guided_grammar": "start: a"}, "response_format"), ({"bogus": 1}, "bogus"),
])
def test_completion_rejections_name_the_parameter(patch, param):
    assert err(parse_completion, {**BASE, **patch}).param == param


def test_body_must_be_an_object():
    assert err(parse_completion, [1, 2]).code == "invalid_type"
    assert err(parse_completion, {"prompt": "x"}).param == "model"


def test_chat_messages():
    r = parse_chat({"model": "m", "messages": [{"role": "system", "content": "s"},
                                               {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 4, "max_tokens": 9})
    assert r.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
    assert r.max_tokens == 4   # max_completion_tokens supersedes max_tokens
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}).max_tokens is None


@pytest.mark.parametrize("messages, param", [
    (None, "messages"), ([], "messages"), ("hi", "messages"), ([1], "messages[0]"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"), ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_chat_rejections(messages, param):
    body = {"model": "m"} if messages is None else {"model": "m", "messages": messages}
    assert err(parse_chat, body).param == param


def test_chat_bad_features_are_rejected_not_ignored():
    msgs = [{"role": "user", "content": "x"}]
    assert err(parse_chat, {"model": "m", "messages": msgs, "tools": [{"type": "function"}]}).param == "tools"
    assert err(parse_chat, {"model": "m", "messages": msgs, "top_logprobs": 2}).param == "top_logprobs"
    assert err(parse_chat, {"model": "m", "messages": msgs, "logprobs": True, "top_logprobs": 21}).param == "top_logprobs"
    assert err(parse_chat, {"model": "m", "messages": msgs, "tool_choice": "required"}).param == "tool_choice"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert err(parse_chat, {"model": "m", "messages": msgs, "tools": tools,
                            "tool_choice": {"type": "function", "function": {"name": "g"}}}).param == "tool_choice"
    assert err(parse_chat, {"model": "m", "messages": msgs,
                            "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}).param \
        == "response_format"


def test_new_fields_parse():
    r = parse_completion({**BASE, "prompt": ["a", [1, 2]], "n": 2, "best_of": 3, "echo": True, "max_tokens": 0,
                          "logprobs": 5, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                          "logit_bias": {"7": -100, "9": 3.5}, "guided_regex": "[ab]+"})
    assert (r.prompts, r.n, r.best_of, r.echo, r.max_tokens, r.logprobs) == (["a", [1, 2]], 2, 3, True, 0, 5)
    assert (r.presence_penalty, r.frequency_penalty, r.repetition_penalty) == (0.5, -1.0, 1.2)
    assert r.logit_bias == ((7, -100.0), (9, 3.5)) and r.guide == ("regex", "[ab]+")
    assert parse_completion({**BASE, "logprobs": False}).logprobs is None
    msgs = [{"role": "user", "content": "x"}]
    c = parse_chat({"model": "m", "messages": msgs, "logprobs": True, "top_logprobs": 3,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}})
    assert c.logprobs == 3 and c.guide == ("json_schema", '{"type": "object"}')
    assert parse_chat({"model": "m", "messages": msgs, "logprobs": True}).logprobs == 0
    assert parse_chat({"model": "m", "messages": msgs}).logprobs is None
    assert parse_chat({"model": "m", "messages": msgs, "response_format": {"type": "json_object"}}).guide[0] == "json_object"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    c = parse_chat({"model": "m", "messages": msgs + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "functions.f:0", "type": "function",
                                                               "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "ok"}], "tools": tools})
    assert c.tool_choice == "auto" and c.tools[0]["function"]["name"] == "f"
    assert c.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert c.messages[2]["tool_call_id"] == "functions.f:0"


def test_error_body_shape():
    e = err(parse_completion, {**BASE, "top_p": 2})
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert "top_p" in e.body()["error"]["message"]
