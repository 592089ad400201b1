"""The OpenAI wire format: request bodies checked field by field into plain dataclasses, and the
response / stream-chunk dicts the official clients expect.

Validation is by hand rather than by pydantic models so that every rejection is a 400 in OpenAI's
error shape naming the offending parameter, and so nothing is coerced silently ("0.5" is not a
number, `true` is not an integer). OpenAI parameters we do not implement are accepted only at
their neutral value (e.g. `presence_penalty: 0`); anything else is rejected rather than ignored.
Extensions: `top_k` (0 or -1 = off), `ignore_eos`, `return_token_ids` (adds `token_ids` to each
choice or chunk: the generated ids, so clients can check them exactly).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field


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


@dataclass
class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = ""    # text, or token ids


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] = field(default_factory=list)   # [{"role", "content": str}]


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
                "return_token_ids", "logprobs"}
_COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "echo", "best_of", "suffix"}
_CHAT_KEYS = _COMMON_KEYS | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                             "tool_choice", "parallel_tool_calls", "store", "metadata", "service_tier",
                             "reasoning_effort", "modalities"}


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
    if n != 1:
        raise invalid("n", f"only n=1 is supported, got n={n}", "unsupported_parameter")
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
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options", f"'stream_options' must be an object with 'include_usage', got {opts!r}")
        include_usage = _bool(opts, "include_usage", False)
    for key in ("presence_penalty", "frequency_penalty"):
        _neutral_only(body, key, (0, 0.0), "penalties")
    if body.get("logit_bias") not in (None, {}):
        raise invalid("logit_bias", "'logit_bias' is not supported by this server", "unsupported_parameter")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("user", "'user' must be a string", "invalid_type")
    return dict(model=model, temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed,
                stop=_stop(body), stream=stream, include_usage=include_usage,
                ignore_eos=_bool(body, "ignore_eos", False), return_token_ids=_bool(body, "return_token_ids", False))


def _max_tokens(body: dict, *keys: str) -> int | None:
    for key in keys:   # the first present wins (chat: max_completion_tokens supersedes max_tokens)
        v = _int(body, key, None)
        if v is not None:
            if v < 1:
                raise invalid(key, f"'{key}' must be >= 1, got {v}")
            return v
    return None


def parse_completion(body) -> CompletionRequest:
    common = _common(body, _COMPLETION_KEYS)
    _neutral_only(body, "logprobs", (0, False), "log probabilities")
    _neutral_only(body, "echo", (False,), "echoing the prompt")
    _neutral_only(body, "best_of", (1,), "best-of sampling")
    _neutral_only(body, "suffix", ("",), "suffixes")
    return CompletionRequest(**common, max_tokens=_max_tokens(body, "max_tokens"),
                             prompt=_prompt(body.get("prompt", _MISSING)))


def _prompt(v) -> str | list[int]:
    if v is _MISSING or v is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]   # a batch of one
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        raise invalid("prompt", f"only one prompt per request is supported, got {len(v)}", "unsupported_parameter")
    raise invalid("prompt", "'prompt' must be a string or a non-empty list of token ids", "invalid_type")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body) -> ChatRequest:
    common = _common(body, _CHAT_KEYS)
    _neutral_only(body, "logprobs", (False,), "log probabilities")
    _neutral_only(body, "top_logprobs", (0,), "log probabilities")
    _neutral_only(body, "tools", ([],), "tool calling")
    _neutral_only(body, "tool_choice", ("none",), "tool calling")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise invalid("response_format", f"only response_format {{'type': 'text'}} is supported, got {fmt!r}",
                      "unsupported_parameter")
    return ChatRequest(**common, max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens"),
                       messages=_messages(body.get("messages", _MISSING)))


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
        out.append({"role": role, "content": _content(m.get("content", _MISSING), f"{param}.content")})
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


def completion_choice(text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_delta_choice(delta: dict, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def envelope(rid: str, obj: str, created: int, model: str, choices: list[dict], usage_: dict | None = None,
             with_usage_key: bool = True) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if with_usage_key:
        out["usage"] = usage_
    return out
