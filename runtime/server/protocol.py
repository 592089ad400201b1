"""The OpenAI wire format: request bodies checked field by field into plain dataclasses, and the
response / stream-chunk dicts the official clients expect.

Validation is by hand rather than by pydantic models so that every rejection is a 400 in OpenAI's
error shape naming the offending parameter, and so nothing is coerced silently ("0.5" is not a
number, `true` is not an integer). OpenAI parameters we do not implement are accepted only at
their neutral value (e.g. `suffix: ""`); anything else is rejected rather than ignored.
Extensions (vLLM's names): `top_k` (0 or -1 = off), `repetition_penalty`, `ignore_eos`,
`return_token_ids` (adds `token_ids` to each choice or chunk: the generated ids, so clients can
check them exactly), `guided_json` / `guided_regex` / `guided_grammar` (Lark) for structured
output without `response_format`, chat's `chat_template_kwargs` (e.g. {"thinking": true}).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from k3compile.runtime.sampling import SEED_RANGE


class ApiError(Exception):
    """A request we answer with `status` and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """What both endpoints have in common once parsed."""
    model: str
    max_tokens: int | None          # None: the endpoint's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None      # top alternatives per token; None: no logprobs
    guide: tuple[str, str] | None = None   # (kind, spec): runtime/structured_output.py


@dataclass
class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = ""    # the first prompt (text or token ids)
    prompts: list = field(default_factory=list)   # every prompt of the request, in order
    echo: bool = False
    best_of: int | None = None


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] = field(default_factory=list)   # [{"role", "content": str, ...}]
    tools: list[dict] = field(default_factory=list)      # [{"type": "function", "function": {...}}]
    tool_choice: str | dict = "auto"                     # "none" | "auto" | "required" | {"function": {"name"}}
    chat_template_kwargs: dict = field(default_factory=dict)


# -- field readers -------------------------------------------------------------------------------

_MISSING = object()


def _number(body: dict, key: str, default):
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(key, f"'{key}' must be a finite number, got {v!r}", "invalid_type")
    return float(v)


def _int(body: dict, key: str, default):
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(key, f"'{key}' must be an integer, got {v!r}", "invalid_type")
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(key, f"'{key}' must be a boolean, got {v!r}", "invalid_type")
    return v


def _neutral_only(body: dict, key: str, neutral: tuple, what: str) -> None:
    """Parameters we don't implement: fine when absent or at their no-op value."""
    v = body.get(key)
    if v is not None and v not in neutral:
        raise invalid(key, f"'{key}' ({what}) is not supported by this server; got {v!r}", "unsupported_parameter")


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", f"'stop' must be a string or a list of strings, got {v!r}", "invalid_type")
    if any(s == "" for s in stops):
        raise invalid("stop", "'stop' strings must be non-empty")
    if len(stops) > 16:
        raise invalid("stop", f"at most 16 stop strings, got {len(stops)}")
    return stops


_COMMON_KEYS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
                "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user", "ignore_eos",
                "return_token_ids", "logprobs", "repetition_penalty", "guided_json", "guided_regex",
                "guided_grammar", "response_format"}
_COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "echo", "best_of", "suffix"}
_CHAT_KEYS = _COMMON_KEYS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                             "tool_choice", "parallel_tool_calls", "store", "metadata", "service_tier",
                             "reasoning_effort", "modalities", "chat_template_kwargs"}
MAX_N = 128
MAX_LOGPROBS = 20


def _common(body, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_type")
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(unknown[0], f"unrecognized request argument(s): {', '.join(unknown)}", "unknown_parameter")
    model = body.get("model")
    if model is None:
        raise invalid("model", "'model' is required", "missing_required_parameter")
    if not isinstance(model, str):
        raise invalid("model", f"'model' must be a string, got {model!r}", "invalid_type")

    n = _int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise invalid("n", f"'n' must be in [1, {MAX_N}], got n={n}")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise invalid("temperature", f"'temperature' must be >= 0, got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise invalid("top_p", f"'top_p' must be in (0, 1], got {top_p}")
    top_k = _int(body, "top_k", 0)
    if top_k < -1:
        raise invalid("top_k", f"'top_k' must be >= 0 (0 or -1 = off), got {top_k}")
    seed = _int(body, "seed", None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise invalid("seed", f"'seed' must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed}")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options", f"'stream_options' must be an object with 'include_usage', got {opts!r}")
        include_usage = _bool(opts, "include_usage", False)
    penalties = {}
    for key in ("presence_penalty", "frequency_penalty"):
        penalties[key] = _number(body, key, 0.0)
        if not -2.0 <= penalties[key] <= 2.0:
            raise invalid(key, f"'{key}' must be in [-2, 2], got {penalties[key]}")
    rep = _number(body, "repetition_penalty", 1.0)
    if rep <= 0:
        raise invalid("repetition_penalty", f"'repetition_penalty' must be > 0, got {rep}")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("user", "'user' must be a string", "invalid_type")
    return dict(model=model, temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed,
                stop=_stop(body), stream=stream, include_usage=include_usage,
                ignore_eos=_bool(body, "ignore_eos", False), return_token_ids=_bool(body, "return_token_ids", False),
                n=n, repetition_penalty=rep, logit_bias=_logit_bias(body), guide=_guide(body), **penalties)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """{"token id as a string": bias in [-100, 100]}; ids are checked against the vocabulary later."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise invalid("logit_bias", f"'logit_bias' must be an object mapping token ids to biases, got {v!r}",
                      "invalid_type")
    out = []
    for key, bias in v.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids, got {key!r}", "invalid_type") from None
        if tok < 0:
            raise invalid("logit_bias", f"'logit_bias' token id {tok} is negative")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}")
        out.append((tok, float(bias)))
    return tuple(out)


def _guide(body: dict) -> tuple[str, str] | None:
    """Structured output: response_format json_object / json_schema, or one extension field."""
    import json
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("json_object", "{}"))
        elif kind == "json_schema":
            js = fmt.get("json_schema")
            schema = js.get("schema", {}) if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise invalid("response_format", "response_format json_schema needs {'json_schema': {'name': ..., "
                              "'schema': {...}}}", "invalid_type")
            found.append(("json_schema", json.dumps(schema)))
        elif kind != "text":
            raise invalid("response_format", f"response_format type must be 'text', 'json_object' or 'json_schema', "
                          f"got {fmt!r}")
    gj = body.get("guided_json")
    if gj is not None:
        if isinstance(gj, str):
            try:
                gj = json.loads(gj)
            except ValueError as e:
                raise invalid("guided_json", f"'guided_json' is not valid JSON: {e}") from None
        if not isinstance(gj, dict):
            raise invalid("guided_json", "'guided_json' must be a JSON schema object", "invalid_type")
        found.append(("json_schema", json.dumps(gj)))
    for key, kind in (("guided_regex", "regex"), ("guided_grammar", "lark")):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, str) or not v:
                raise invalid(key, f"'{key}' must be a non-empty string", "invalid_type")
            found.append((kind, v))
    if len(found) > 1:
        raise invalid("response_format", "give at most one of response_format (json), guided_json, guided_regex, "
                      "guided_grammar")
    return found[0] if found else None


def _logprobs_count(body: dict, key: str) -> int | None:
    k = _int(body, key, None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise invalid(key, f"'{key}' must be in [0, {MAX_LOGPROBS}], got {k}")
    return k


def _max_tokens(body: dict, *keys: str, minimum: int = 1) -> int | None:
    for key in keys:   # the first present wins (chat: max_completion_tokens supersedes max_tokens)
        v = _int(body, key, None)
        if v is not None:
            if v < minimum:
                raise invalid(key, f"'{key}' must be >= {minimum}, got {v}" +
                              (" (0 only with echo)" if minimum == 1 and v == 0 and key == "max_tokens" else ""))
            return v
    return None


MAX_PROMPTS = 1024


def parse_completion(body) -> CompletionRequest:
    common = _common(body, _COMPLETION_KEYS)
    _neutral_only(body, "suffix", ("",), "suffixes")
    echo = _bool(body, "echo", False)
    logprobs = body.get("logprobs")
    logprobs = None if logprobs is False else _logprobs_count(body, "logprobs")
    best_of = _int(body, "best_of", None)
    if best_of is not None:
        if not common["n"] <= best_of <= MAX_N:
            raise invalid("best_of", f"'best_of' must be in [n, {MAX_N}] (n={common['n']}), got {best_of}")
        if common["stream"] and best_of > common["n"]:
            raise invalid("best_of", "'best_of' > n cannot be streamed (the best choices are known only at the end)")
    prompts = _prompts(body.get("prompt", _MISSING))
    return CompletionRequest(**common, logprobs=logprobs, max_tokens=_max_tokens(body, "max_tokens",
                                                                                 minimum=0 if echo else 1),
                             prompt=prompts[0], prompts=prompts, echo=echo, best_of=best_of)


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _prompts(v) -> list:
    """A string, a list of token ids, or a list of either (one choice per prompt)."""
    if v is _MISSING or v is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(v, str) or _is_ids(v):
        return [v]
    if isinstance(v, list) and v and all(isinstance(p, str) or _is_ids(p) for p in v):
        if len(v) > MAX_PROMPTS:
            raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
        return list(v)
    raise invalid("prompt", "'prompt' must be a string, a non-empty list of token ids, or a list of those",
                  "invalid_type")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body) -> ChatRequest:
    common = _common(body, _CHAT_KEYS)
    want = _bool(body, "logprobs", False)
    top = _logprobs_count(body, "top_logprobs")
    if top is not None and top > 0 and not want:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice", "auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid("tool_choice", f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {choice!r}")
        if choice == "required" and not tools:
            raise invalid("tool_choice", "'tool_choice' 'required' needs 'tools'")
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in {t["function"]["name"] for t in tools}:
            raise invalid("tool_choice", f"'tool_choice' names no function among 'tools': {choice!r}")
    else:
        raise invalid("tool_choice", f"'tool_choice' must be a string or an object, got {choice!r}", "invalid_type")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type")
    return ChatRequest(**{**common, "logprobs": (top or 0) if want else None},
                       max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens"),
                       messages=_messages(body.get("messages", _MISSING)), tools=tools, tool_choice=choice,
                       chat_template_kwargs=kwargs)


def _tools(v) -> list[dict]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise invalid("tools", "'tools' must be a list", "invalid_type")
    out = []
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                          f"'parameters': {{...}}}}}}", "invalid_type")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid("tools", f"tools[{i}].function.parameters must be a JSON schema object", "invalid_type")
        out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                     "parameters": params}})
    return out


def _messages(v) -> list[dict]:
    if v is _MISSING or v is None:
        raise invalid("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(v, list) or not v:
        raise invalid("messages", "'messages' must be a non-empty list", "invalid_type")
    out = []
    for i, m in enumerate(v):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(param, f"{param} must be an object", "invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise invalid(f"{param}.role", f"{param}.role must be one of {', '.join(_ROLES)}; got {role!r}")
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content", _MISSING)
        if calls and content in (None, _MISSING):
            content = ""
        msg = {"role": role, "content": _content(content, f"{param}.content")}
        if calls:
            msg["tool_calls"] = _tool_calls(calls, f"{param}.tool_calls")
        for key in ("tool_call_id", "name", "reasoning_content"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _tool_calls(calls, param: str) -> list[dict]:
    import json
    if not isinstance(calls, list):
        raise invalid(param, f"{param} must be a list", "invalid_type")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(param, f"{param}: each call needs a function with a name", "invalid_type")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise invalid(param, f"{param}: function arguments must be a JSON string") from None
        out.append({"id": c.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": parsed}})
    return out


def _content(c, param: str) -> str:
    """A string, or a list of text parts joined (other part types are not supported)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(param, f"{param}: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                              "unsupported_parameter")
            texts.append(part["text"])
        return "".join(texts)
    if c is _MISSING:
        raise invalid(param, f"{param} is required", "missing_required_parameter")
    raise invalid(param, f"{param} must be a string or a list of text parts, got {c!r}", "invalid_type")


# -- responses -----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(text: str, finish_reason: str | None, token_ids: list[int] | None, index: int = 0,
                      logprobs: dict | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(message: dict, finish_reason: str | None, token_ids: list[int] | None, index: int = 0,
                logprobs: dict | None = None) -> dict:
    """`message`: {"content": ..., optionally "reasoning_content", "tool_calls"}."""
    choice = {"index": index, "message": {"role": "assistant", **message}, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_delta_choice(delta: dict, finish_reason: str | None, token_ids: list[int] | None, index: int = 0,
                      logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def envelope(rid: str, obj: str, created: int, model: str, choices: list[dict], usage_: dict | None = None,
             with_usage_key: bool = True) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if with_usage_key:
        out["usage"] = usage_
    return out
