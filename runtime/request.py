"""One request's life in the engine: its tokens, sampling, status and scheduling position.

Positions count tokens of `all_ids` (prompt + generated output):
* `num_scheduled`: tokens whose forward has been put into a batch (KV and state cover them once
  that batch has run). With the overlap scheduler this runs one batch ahead of `num_computed`.
* `num_computed`: tokens whose forward has finished.
* `prefill_target`: how far prefill goes before decoding starts (the whole of `all_ids` at
  admission: the prompt, or prompt + output for a request re-admitted after a retraction). The
  last prefill chunk's logits give the next token; from then on each decode step feeds one token.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from k3compile.runtime.cache.request_table import CachedRequest
from k3compile.runtime.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued for (re-)admission
    RUNNING = "running"  # admitted: holds a working state slot and KV pages
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # eos (unless ignore_eos) and the request's stop_token_ids
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # finish_reason "error": what failed
    # scheduling
    num_scheduled: int = 0
    num_computed: int = 0
    prefill_target: int = 0
    branch_point: int | None = None  # where this admission's prefill plants a checkpoint (Marconi)
    handle: CachedRequest | None = None  # pages, slots and tree lock, while running
    admit_seq: int = 0  # admission order: retraction takes the newest
    prefill_forwards: int = 0  # prefill-mode forwards that computed some of its positions (TTFT accounting)
    inflight: int = 0  # batches scheduled or running that include this request
    retract_pending: bool = False  # retract once no batch includes it any more
    latest_snapshot: int | None = None  # position of the newest complete snapshot not yet donated
    # failure isolation (Scheduler.fail_batch)
    isolate: bool = False  # shared a batch whose forward failed: runs in batches of its own from now on
    void: bool = False  # what batches still in flight compute for it is discarded (it is being recomputed)
    # accounting
    # n > 1: requests sampled from this one's first logits row and forked from its state after the
    # prompt (runtime/scheduler.py `_fork`); a follower waits outside the queues until then
    followers: list["Request"] = field(default_factory=list)
    fork_leader: "Request | None" = None
    # logprobs: one entry per output token when params.logprobs is set; prompt_lp[i] scores prompt token i+1
    output_logprobs: list = field(default_factory=list)
    prompt_lp: list = field(default_factory=list)
    guide: object | None = None  # structured-output matcher (runtime/structured_output.py)
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    admitted_once: bool = False
    num_reported: int = 0  # output tokens already handed out by LLMEngine.step
    finish_reported: bool = False
    prompt_reported: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    admit_time: float | None = None  # first admission
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def queue_time(self) -> float | None:
        return None if self.admit_time is None else self.admit_time - self.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_scheduled < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (a prefill must then cover the whole prompt)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_lp) < len(self.prompt_ids) - 1

    def append_token(self, token: int, logprobs=None) -> None:
        """Record a sampled token and finish the request if it hits a stop condition."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_ids.append(token)
        if self.params.logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.guide is not None:
            self.guide.accept(token)
        if token in self.stop_ids or (self.guide is not None and self.guide.is_terminated()):
            self.finish("stop")
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        if self.status is not Status.FINISHED:
            self.status, self.finish_reason, self.finish_time = Status.FINISHED, reason, time.monotonic()
