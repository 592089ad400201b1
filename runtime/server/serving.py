"""One accepted request, from the engine's token outputs to text deltas for either endpoint.

Both the streaming and the non-streaming paths read `Generation.deltas()`; the difference is only
whether the deltas are sent as they come or joined. Leaving the iteration early (client gone,
stop string hit) aborts the engine request, which frees its pages and state slots.
"""
from __future__ import annotations

from dataclasses import dataclass

from .async_engine import AsyncEngine, RequestStream
from .text_stream import IncrementalDetokenizer, StopStringFilter

# prompt tokens decoded in front of the first output tokens, so they render as they would in
# context (sentencepiece-style leading spaces); never emitted
_DETOKENIZE_CONTEXT = 4


@dataclass
class Delta:
    text: str
    token_ids: list[int]               # ids generated since the previous delta
    finish_reason: str | None          # set on the last delta only
    prompt_tokens: int
    completion_tokens: int             # generated so far (a stop string's own tokens included)
    cached_tokens: int


class Generation:
    def __init__(self, stream: RequestStream, tokenizer, prompt_ids: list[int], stops: list[str]):
        self.stream = stream
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids[-_DETOKENIZE_CONTEXT:])
        self.stops = StopStringFilter(stops)
        self.prompt_tokens = len(prompt_ids)

    async def deltas(self):
        completion, cached, prompt = 0, 0, self.prompt_tokens
        try:
            async for out in self.stream:
                completion += len(out.new_token_ids)
                cached, prompt = out.cached_tokens, out.prompt_tokens
                text = self.detok.push(out.new_token_ids)
                if out.finished:
                    text += self.detok.flush()
                piece, stopped = self.stops.feed(text)
                if stopped:
                    yield Delta(piece, out.new_token_ids, "stop", prompt, completion, cached)
                    return   # the finally clause aborts the engine request
                if out.finished:
                    piece += self.stops.finish()
                    yield Delta(piece, out.new_token_ids, out.finish_reason, prompt, completion, cached)
                    return
                if piece or out.new_token_ids:
                    yield Delta(piece, out.new_token_ids, None, prompt, completion, cached)
        finally:
            self.stream.abort()   # no-op when the engine already finished it


async def start_generation(front: AsyncEngine, rid: str, prompt_ids: list[int], params,
                           stops: list[str]) -> Generation:
    """Submits the request and waits until the engine accepted it, so a rejection (ValueError /
    EngineError) can still become an HTTP error status before any byte of a stream is sent."""
    stream = await front.add(rid, prompt_ids, params)
    return Generation(stream, front.tokenizer, prompt_ids, stops)
