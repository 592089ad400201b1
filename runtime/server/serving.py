"""One accepted request, from the engine's token outputs to text deltas for either endpoint.

Both the streaming and the non-streaming paths read `Generation.deltas()`; the difference is only
whether the deltas are sent as they come or joined. Leaving the iteration early (client gone,
stop string hit) aborts the engine request, which frees its pages and state slots.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

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
    logprobs: list | None = None       # TokenLogprobs of token_ids, when asked for
    prompt_logprobs: list | None = None   # on the first delta only, when asked for
    index: int = 0                     # the choice this delta belongs to


class Generation:
    def __init__(self, stream: RequestStream, tokenizer, prompt_ids: list[int], stops: list[str], index: int = 0,
                 decoder=None):
        self.stream = stream
        self.detok = IncrementalDetokenizer(decoder or tokenizer, prompt_ids[-_DETOKENIZE_CONTEXT:])
        self.stops = StopStringFilter(stops)
        self.prompt_tokens = len(prompt_ids)
        self.index = index

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
                extra = dict(logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs, index=self.index)
                if stopped:
                    yield Delta(piece, out.new_token_ids, "stop", prompt, completion, cached, **extra)
                    return   # the finally clause aborts the engine request
                if out.finished:
                    piece += self.stops.finish()
                    yield Delta(piece, out.new_token_ids, out.finish_reason, prompt, completion, cached, **extra)
                    return
                if piece or out.new_token_ids:
                    yield Delta(piece, out.new_token_ids, None, prompt, completion, cached, **extra)
        finally:
            self.stream.abort()   # no-op when the engine already finished it


async def start_generation(front: AsyncEngine, rid: str, prompt_ids: list[int], params,
                           stops: list[str], n: int = 1, first_index: int = 0, decoder=None) -> list[Generation]:
    """Submits the request (n samples of one prompt: one prefill, the state forked n ways) and waits
    until the engine accepted it, so a rejection (ValueError / EngineError) can still become an
    HTTP error status before any byte of a stream is sent. Choice i gets index first_index + i."""
    fork_rids = tuple(f"{rid}-{i}" for i in range(1, n))
    streams = await front.add(rid, prompt_ids, params, fork_rids=fork_rids) if fork_rids else \
        [await front.add(rid, prompt_ids, params)]
    return [Generation(st, front.tokenizer, prompt_ids, stops, first_index + i, decoder) for i, st in enumerate(streams)]


@dataclass
class Choice:
    """One generation run to its end (the non-streaming path)."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    last: Delta | None = None

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs or [])
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.last = d

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs if lp is not None)


async def merged_deltas(gens: list[Generation]):
    """The deltas of several generations as they come (streamed n > 1 / prompt lists). Leaving early
    aborts every generation still running."""
    if len(gens) == 1:
        async for d in gens[0].deltas():
            yield d
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g: Generation):
        try:
            async for d in g.deltas():
                await queue.put(d)
        except BaseException as e:   # an EngineError reaches the consumer
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(gens)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            g.stream.abort()


async def collect(gens: list[Generation]) -> list[Choice]:
    choices = {g.index: Choice(g.index) for g in gens}
    async for d in merged_deltas(gens):
        choices[d.index].add(d)
    return [choices[i] for i in sorted(choices)]
