"""Generated token ids → text pieces safe to send: incremental detokenization and stop strings.

Detokenizing one token at a time is wrong for two reasons: a character can span several tokens (the
byte tokenizer emits UTF-8 one byte per token; BPE vocabularies split rare characters too), and
some tokenizers render a token differently depending on what precedes it (the leading space of
sentencepiece pieces). So `IncrementalDetokenizer` always decodes a short window that ends at the
newest token and starts a little before the text already produced, and emits the difference
between that window with and without its new tokens. While the window's text ends in U+FFFD (an
incomplete character) it waits for more tokens; `flush()` at the end emits whatever is left.

Stop strings are matched on that text, not on token ids, because a stop string can span token
boundaries (or end in the middle of a token). `StopStringFilter` holds back the longest tail of
the text that could still become the start of a stop string, so nothing of a stop string ever
reaches the client. When a stop string is complete, the text is cut where it starts (the stop
string and anything after it in the same token are dropped) and the request ends with
finish_reason "stop".
"""
from __future__ import annotations

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """`push(ids)` returns the text those tokens completed; `flush()` the rest at the end.

    The concatenation of everything returned equals decoding all pushed ids at once, given that
    `context` (the last prompt tokens, used only so the first output token renders as it would
    after the prompt) ends on a character boundary.
    """

    def __init__(self, tokenizer, context: list[int] | None = None):
        self.tok = tokenizer
        self.ids: list[int] = list(context or [])
        self.prefix_offset = 0               # window start: decoded only for context, never emitted
        self.read_offset = len(self.ids)     # tokens before this are already emitted as text

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self.tok.decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return ""  # nothing new yet, or a character still incomplete: wait for more tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """The text still held back (an incomplete character renders as U+FFFD)."""
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self.tok.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]


class StopStringFilter:
    """Feeds text through; `feed` returns (text safe to send now, stopped)."""

    def __init__(self, stops: list[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self.pending = ""     # text that might be the start of a stop string
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            raise RuntimeError("feed() after a stop string ended the text")
        buf = self.pending + text
        # A stop string cannot start in text already sent: that text was sent only because no
        # suffix of it was a prefix of any stop string. So searching the buffer is enough.
        # The stop string that completes first ends generation, as if the text had arrived one
        # character at a time (so the result does not depend on how tokens cut the text); of two
        # completing at the same character the longer one wins, as it starts earlier.
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return buf[:min(hits)[1]], True
        hold = self._held_tail(buf)
        self.pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def finish(self) -> str:
        """At the end of generation the held-back tail is just text."""
        out, self.pending = self.pending, ""
        return out

    def _held_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
