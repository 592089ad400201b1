"""Logprobs on the wire: the engine's TokenLogprobs -> OpenAI's two shapes.

Completions (legacy): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"};
with `echo` the prompt's tokens come first, the very first one with logprob None (nothing predicts
it). Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
A logprob of -inf (a token top-k / top-p / a mask removed) is sent as -9999.0, as vLLM does: JSON
has no infinity.
"""
from __future__ import annotations

import math

_NEG_INF = -9999.0


def _num(x: float) -> float:
    return x if math.isfinite(x) else _NEG_INF


def _token_str(tok, token_id: int) -> str:
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(tok, token_ids: list[int], entries: list, text_offset: int = 0) -> dict:
    """`entries[i]` scores token_ids[i] (None: unscored, the prompt's first token)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for t, e in zip(token_ids, entries):
        s = _token_str(tok, t)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(_num(e.logprob))
            top: dict[str, float] = {}
            for i, v in e.top:   # tokens that render alike (partial UTF-8) keep the likelier one
                top.setdefault(_token_str(tok, i), _num(v))
            out["top_logprobs"].append(top)
    return out


def chat_logprobs(tok, entries: list) -> dict:
    def item(token_id: int, lp: float) -> dict:
        b = tok.token_bytes(token_id)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": _num(lp), "bytes": list(b)}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]}
                        for e in entries if e is not None]}
