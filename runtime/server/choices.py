"""How one request's generations become OpenAI choices: indices (prompt k, sample j -> k * n + j),
best-of selection, echo, logprobs, chat messages (reasoning / tool calls), usage.

The non-streaming path renders each finished Choice (`whole_choice`); the streaming path renders
each Delta as it comes (`delta_choice`), keeping per-choice state (echo sent, text offsets, chat
output parser).
"""
from __future__ import annotations

from . import protocol as P
from .logprobs import chat_logprobs, completion_logprobs


class ChoiceView:
    def __init__(self, req, prompts: list[list[int]], chat: bool, tokenizer, chat_format):
        self.req, self.prompts, self.chat, self.tok, self.fmt = req, prompts, chat, tokenizer, chat_format
        self.samples = getattr(req, "best_of", None) or req.n
        self.echo = getattr(req, "echo", False)
        self._parsers: dict = {}
        self._offsets: dict[int, int] = {}   # completions logprobs text_offset, per streamed choice

    def _prompt_index(self, index: int) -> int:
        return index // self.samples

    def _prompt_text(self, k: int) -> str:
        p = self.req.prompts[k]
        return p if isinstance(p, str) else self.tok.decode(p)

    def _parser(self, index: int):
        if index not in self._parsers:
            self._parsers[index] = self.fmt.parser(self.req)
        return self._parsers[index]

    def usage(self, results) -> dict:
        """Prompts count once each; every sample's tokens count (best-of's discarded ones too)."""
        firsts = {}
        for c in results:
            firsts.setdefault(self._prompt_index(c.index), c)
        return P.usage(sum(len(p) for p in self.prompts), sum(c.last.completion_tokens for c in results),
                       sum(c.last.cached_tokens for c in firsts.values()))

    def best(self, results) -> list:
        """best_of > n: per prompt, the n samples with the highest cumulative logprob, renumbered."""
        if self.samples == self.req.n:
            return results
        out = []
        for k in range(len(self.prompts)):
            group = [c for c in results if self._prompt_index(c.index) == k]
            group.sort(key=lambda c: c.cumulative_logprob, reverse=True)
            for j, c in enumerate(group[: self.req.n]):
                c.prompt_k, c.index = k, k * self.req.n + j
                out.append(c)
        return out

    def whole_choice(self, c) -> dict:
        token_ids = c.token_ids if self.req.return_token_ids else None
        finish = c.last.finish_reason
        if self.chat:
            msg = self._parser(c.index).whole(c.text)
            if msg.get("tool_calls") and finish == "stop":
                finish = "tool_calls"
            lp = chat_logprobs(self.tok, c.logprobs) if self.req.logprobs is not None else None
            return P.chat_choice(msg, finish, token_ids, c.index, lp)
        k = getattr(c, "prompt_k", None)
        k = self._prompt_index(c.index) if k is None else k
        text, ids, entries = c.text, c.token_ids, c.logprobs
        if self.echo:
            text = self._prompt_text(k) + text
            ids = list(self.prompts[k]) + ids
            entries = (c.prompt_logprobs or [None] * len(self.prompts[k])) + entries
        lp = completion_logprobs(self.tok, ids, entries) if self.req.logprobs is not None else None
        return P.completion_choice(text, finish, token_ids, c.index, lp)

    def delta_choice(self, d) -> dict | None:
        """The chunk's choice for one delta, or None when it carries nothing to send. A delta that
        brought tokens is sent even when their text is held back (an incomplete character, a
        possible stop string, ids without text, a tool call being parsed): one chunk per engine
        step keeps the stream's timing the engine's (as vLLM streams such chunks), instead of a
        burst when the text completes -- with a byte tokenizer on a large vocabulary, at the end."""
        token_ids = d.token_ids if self.req.return_token_ids else None
        want_lp = self.req.logprobs is not None
        if self.chat:
            parser = self._parser(d.index)
            delta = parser.feed(d.text)
            finish = d.finish_reason
            if finish is not None:
                for key, v in parser.finish().items():
                    delta[key] = delta.get(key, [] if key == "tool_calls" else "") + v
                if parser.calls and finish == "stop":
                    finish = "tool_calls"
            lp = chat_logprobs(self.tok, d.logprobs or []) if want_lp and d.token_ids else None
            if not delta and finish is None and lp is None and not d.token_ids:
                return None
            return P.chat_delta_choice(delta, finish, token_ids, d.index, lp)
        text, ids, entries = d.text, d.token_ids, d.logprobs or []
        if self.echo and d.index not in self._offsets:
            k = self._prompt_index(d.index)
            text = self._prompt_text(k) + text
            ids = list(self.prompts[k]) + ids
            entries = (d.prompt_logprobs or [None] * len(self.prompts[k])) + entries
        offset = self._offsets.get(d.index, 0)
        lp = None
        if want_lp:
            lp = completion_logprobs(self.tok, ids, entries, offset)
            self._offsets[d.index] = offset + sum(len(t) for t in lp["tokens"])
        else:
            self._offsets.setdefault(d.index, 0)
        if not (text or d.finish_reason is not None or d.token_ids or (lp and lp["tokens"])):
            return None
        return P.completion_choice(text, d.finish_reason, token_ids, d.index, lp)
