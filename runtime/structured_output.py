"""Structured output through llguidance: a grammar per request, a token bitmask per sampling step.

Kinds (protocol.py maps the request fields onto them): `json_object` (any JSON object),
`json_schema`, `regex`, `lark` (llguidance's Lark dialect, which also embeds JSON schemas with
`%json {...}`; chat's forced tool calls use it). A compiled grammar is shared; each request (and
each of its n samples) gets its own matcher.

Per step: `fill_mask()` computes the allowed-token bitmask for the matcher's current state into the
request's own [ceil(V/32)] int32 row (the engine calls it right after launching the forward, so
the mask is built while the step runs; the sampler applies it batched, runtime/penalties.py).
`accept(token)` advances the matcher; a matcher that has stopped (the grammar is complete and only
EOS is allowed) finishes the request. With speculative decoding, `consume_tokens` / `rollback` of
the same matcher check draft tokens; the bitmask layout is the one xgrammar uses too.
"""
from __future__ import annotations

import json
from functools import lru_cache

import torch

KINDS = ("json_object", "json_schema", "regex", "lark")


class _ByteVocab:
    """What llguidance.TokenizerWrapper reads from a tokenizer: the byte-level preset vocabulary."""

    def __init__(self, tok, vocab_size: int):
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.tokens = [tok.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))
        self._tok = tok

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


@lru_cache(maxsize=4)
def _ll_tokenizer(tok, vocab_size: int):
    import llguidance
    if hasattr(tok, "tok"):  # HFTokenizer: its fast tokenizer
        import llguidance.hf
        return llguidance.hf.from_tokenizer(tok.tok, n_vocab=vocab_size)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(tok, vocab_size)))


class Guide:
    """A compiled grammar for one request body; `matcher()` per sample."""

    def __init__(self, ll_tok, grammar: str, vocab_size: int):
        import llguidance
        self.ll_tok, self.grammar, self.vocab_size = ll_tok, grammar, vocab_size
        error = llguidance.LLMatcher.validate_grammar(grammar, ll_tok)  # "" when valid
        if error:
            raise ValueError(f"invalid structured-output grammar: {error}")

    def matcher(self) -> "GuideMatcher":
        return GuideMatcher(self)


class GuideMatcher:
    def __init__(self, guide: Guide):
        import llguidance
        self.m = llguidance.LLMatcher(guide.ll_tok, guide.grammar)
        self.bitmask = torch.zeros(-(-guide.vocab_size // 32), dtype=torch.int32)
        self._filled = False

    def fill_mask(self) -> None:
        if self._filled:
            return
        import llguidance.torch as llt
        llt.fill_next_token_bitmask(self.m, self.bitmask.view(1, -1), 0)
        self._filled = True

    def accept(self, token: int) -> None:
        if not self.m.is_stopped() and not self.m.consume_token(token):
            raise RuntimeError(f"structured output: token {token} violates the grammar ({self.m.get_error()})")
        self._filled = False

    def is_terminated(self) -> bool:
        return self.m.is_stopped()


def grammar_for(kind: str, spec: str) -> str:
    import llguidance
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(json.loads(spec))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"unknown structured-output kind {kind!r}; known: {', '.join(KINDS)}")


def compile_guide(engine, guide: tuple[str, str]) -> Guide:
    """ValueError (a 400 at the server) for a grammar llguidance rejects."""
    if engine.tokenizer is None:
        raise ValueError("structured output needs a tokenizer")
    kind, spec = guide
    vocab = engine.config.vocab_size
    return Guide(_ll_tokenizer(engine.tokenizer, vocab), grammar_for(kind, spec), vocab)
