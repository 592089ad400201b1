"""Continuous batching over the hybrid radix cache: what runs next, and what each result changes.

    batch = scheduler.schedule()          # admission, chunking, pages, snapshots, metadata; None: nothing to run
    ... run batch.forward, then copy each (working -> snapshot) slot pair in batch.snapshot_copies
    scheduler.process(batch, tokens)      # sampled tokens in; finishes, donations, releases, retractions

Batches. With prefill work, a "prefill" batch: first one decode token for every decoding request
(`mixed`, the default; each takes one token of the budget), then every running request still in
prefill gets its next chunk, then waiting requests are admitted (FCFS) while the token budget
(`max_batch_tokens`), the running limit and memory allow. The decode rows of a mixed batch run
through the prefill step as one-token extends (Row.decode marks them). Without prefill work, a
"decode" batch with one decode step for every running request (the CUDA-graph path). A request
appears at most once per batch.

Chunks end at absolute multiples of `chunk_size`, at the prompt's end, and -- so the cache can
take a state there -- at the branch point the admission match reported and (policy
`split_prompt_tail`) at the last checkpoint boundary before the prompt's last token (both are
donated as soon as their chunk is processed). A chunk cut short by the budget
is pulled back to a checkpoint boundary when one lies inside it.

State moves (runtime/cache/state_slots.py): admission restores the working slot from the matched
checkpoint (copy-on-write; zero state on a miss). A chunk that ends on a checkpoint boundary, and
a decode step that reaches a multiple of `track_interval`, get a snapshot slot when the batch is
built; the runner copies the working state into it right after the forward, before any later
forward can write the working slot. Only once `process` has seen the batch finish is the
snapshot "complete"; older complete snapshots are then dropped, and the policy decides whether it
is donated now (chunk / decode track point / branch point / prompt tail) or kept for the finish.

Overlap. `schedule` may run while the previous batch is still in flight: positions advance at
scheduling time (`num_scheduled`), and a decode row whose input token is still being sampled
gets a placeholder that the engine fills from the request's tokens before launching. A request
that finishes or is aborted by the in-flight batch rides along in the next one as a harmless
zombie (its own slot and pages); its resources are released only when no batch includes it.
Every block a batch references is pinned while it exists (InFlightMemory), so nothing it reads
moves or is reused underneath it.

Memory pressure. Admission needs the working slot plus pages for the whole remaining prefill and
for `decode_reserve_ratio` of the output still to come (for it and every running request);
the tree gives up LRU checkpoints, then LRU leaves, to make room. When a running request cannot
get pages for its next step, the newest running request is retracted: its newest complete
snapshot is donated (so its prefix may stay in the tree), everything else goes back to memory,
and it returns to the front of the queue to be re-admitted and recompute what it lost
(prompt + output so far is prefilled again, so its outputs are unchanged). A retraction of a
request in flight waits until its batch is processed; only one retraction is pending at a time.

Failures (`fail_batch`, `fail`). A batch whose forward raised is applied as nothing: its pins and
in-flight counts are released and no position advances. If it held one live request, that request
caused it and fails (finish_reason "error"). Otherwise nobody can tell which one did, so each is
retracted -- recomputed from its tokens, outputs unchanged; results of its batches still in flight
are discarded (`void`) -- and marked `isolate`: from then on it runs in batches of its own, taking
turns with the others, so if it fails again it fails alone.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.runtime.cache.radix import HybridRadixCache
from k3compile.runtime.cache.request_table import RequestTable
from k3compile.runtime.cache.state_slots import TooManyStateSlotsError
from k3compile.runtime.memory.base import OutOfMemoryError

from .batch_sampling import BatchSample
from .cache_policy import CachePolicy
from .inflight_memory import InFlightMemory
from .request import Request, Status


# Share of each request's remaining output reserved at admission: SGLang's new_token_ratio, which
# starts at 0.7 and decays while nothing retracts. We hold it at the starting value: bench memory
# showed 0.3 letting a tightly packed (unified) memory retract within a few steps of a burst, while
# 0.7 retracted nothing and cost at most one request of concurrency (traces/memory_k3-tiny*.md).
DEFAULT_RESERVE_RATIO = 0.7


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    chunk_size: int
    max_batch_tokens: int
    max_running: int
    track_interval: int
    checkpoint_interval: int
    device: str = "cpu"
    # Admission keeps pages free for this share of every running request's remaining output (SGLang's
    # new_token_ratio, held constant): without it a burst of admissions fills the memory with prompts
    # and the first decode steps retract. 0 admits on prompt pages alone.
    decode_reserve_ratio: float = DEFAULT_RESERVE_RATIO
    # Snapshots at decode track points. Off with speculative decoding: a verify step moves a request by
    # several positions, so a copy after it would not hold the state at the track point.
    decode_snapshots: bool = True
    # A batch with prefill work also carries one decode token for every decoding request (within the
    # token budget, decode first), so running streams keep producing tokens while prompts prefill
    # (SGLang's mixed chunk, vLLM's chunked prefill). Off: a batch is all-prefill or all-decode.
    mixed: bool = True


@dataclass
class Row:
    req: Request
    start: int  # computes positions [start, end)
    end: int
    samples: bool  # its logits give the request's next token
    snapshot: int | None = None  # position whose state is copied into a snapshot slot after the forward
    decode: bool = False  # one decode token (in a decode batch, or riding in a prefill batch)


@dataclass
class ScheduledBatch:
    mode: str  # "prefill" (prefill chunks, possibly with decode rows) | "decode"
    rows: list[Row]
    forward: ForwardBatch
    snapshot_copies: list[tuple[int, int]]  # (working slot, snapshot slot), run right after the forward
    placeholders: list[tuple[int, Row]] = field(default_factory=list)  # (input_ids index, row): token not sampled yet
    pinned: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # (slots, pages) pinned while it exists
    # rows [a, b) of the step's logits belong to row i; b - 1 is its last position. b - a > 1 only for
    # a prefill row that scores its prompt (prompt logprobs): one logits row per position.
    logit_spans: list[tuple[int, int]] = field(default_factory=list)


_BATCH_TENSORS = ("input_ids", "positions", "cu_seqlens", "seq_lens", "page_table", "state_slots",
                  "out_cache_loc", "logits_indices")


def _upload(fb: ForwardBatch, device: torch.device) -> None:
    """Move a host-built batch to the device through pinned memory, asynchronously: a plain copy
    would synchronize the stream, i.e. wait for the batch in flight (see the module docstring)."""
    if device.type == "cpu":
        return
    for name in _BATCH_TENSORS:
        t = getattr(fb, name)
        setattr(fb, name, (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True))


class Scheduler:
    def __init__(self, memory: InFlightMemory, cache: HybridRadixCache, table: RequestTable, policy: CachePolicy,
                 cfg: SchedulerConfig):
        self.memory, self.cache, self.table, self.policy, self.cfg = memory, cache, table, policy, cfg
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admissions = 0
        self._isolated_turn = False  # the last batch was an isolated request's: the others go next
        # counters for metrics
        self.retractions = 0
        self.prefill_tokens = 0  # tokens computed by prefill rows (cache hits excluded, recomputation included)
        self.generated_tokens = 0
        self.prompt_tokens = 0  # prompt tokens of first admissions
        self.cache_hit_tokens = 0  # of those, served from the cache
        self.forked = 0  # followers that continued from a forked state instead of a prefill
        # what first tokens cost (metrics "first_token"): requests that got one, the prefill forwards each
        # rode in until then (summed), and their engine-side seconds from add_request to that token (n > 1
        # followers are not counted: their first token is sampled from the leader's forward)
        self.first_tokens = 0
        self.first_token_forwards = 0
        self.first_token_seconds = 0.0

    # ------------------------------------------------------------------ requests in and out
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request, reason: str = "abort") -> None:
        """Finish now; resources go back at once, or when the last batch that includes it is processed."""
        if req.finished:
            return
        req.finish(reason)
        if req.fork_leader is not None and req in req.fork_leader.followers:  # a follower not forked yet
            req.fork_leader.followers.remove(req)
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req.followers:  # its followers still wait for a first sample: the next one leads them
            self._promote(req)
        self._settle(req)

    def _promote(self, leader: Request) -> None:
        new, *rest = leader.followers
        leader.followers = []
        new.fork_leader, new.followers = None, rest
        for f in rest:
            f.fork_leader = new
        self.waiting.appendleft(new)

    def fail(self, req: Request, error: str) -> None:
        """Finish a request with finish_reason "error" (`error` says why); the others go on."""
        if not req.finished:
            req.error = error
            self.abort(req, "error")

    def fail_batch(self, batch: ScheduledBatch, error: str) -> list[Request]:
        """A batch whose forward raised (see the module docstring). Returns the requests that failed."""
        self.memory.unpin(*batch.pinned)
        live: list[Request] = []
        for row in batch.rows:
            row.req.inflight -= 1
            if not row.req.finished and row.req.status is Status.RUNNING and not row.req.void \
                    and row.req not in live:
                live.append(row.req)
        if len(live) == 1:
            self.fail(live[0], error)
        else:
            for req in live:
                req.isolate = req.void = True
                req.latest_snapshot = None  # donate nothing of a request whose state is in doubt
                self._retract(req)
        for row in batch.rows:
            self._settle(row.req)
        return live if len(live) == 1 else []

    def num_running(self) -> int:
        return sum(1 for r in self.running if not r.finished)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch | None:
        for _ in range(len(self.running) + 1):  # each round without a batch retracts one request
            batch = self._schedule_once()
            if batch is not None or not self._stuck():
                return batch
            self._retract(self._newest())
        return None

    def _schedule_once(self) -> ScheduledBatch | None:
        """Isolated requests (fail_batch) run alone, taking turns with the batch of all the others."""
        regular = lambda: self._schedule_prefill() or self._schedule_decode()  # noqa: E731
        order = (regular, self._schedule_isolated) if self._isolated_turn else (self._schedule_isolated, regular)
        for schedule in order:
            batch = schedule()
            if batch is not None:
                self._isolated_turn = any(r.req.isolate for r in batch.rows)
                return batch
        return None

    def _schedule_isolated(self) -> ScheduledBatch | None:
        for req in self.running:
            if req.isolate and self._schedulable(req):
                if req.in_prefill:
                    row = self._prefill_row(req, self.cfg.max_batch_tokens)
                else:
                    row = self._decode_row(req)
                if row is not None:
                    return self._build("prefill" if req.in_prefill else "decode", [row])
        return None

    def _stuck(self) -> bool:
        """Running requests exist, none is in flight or being retracted, and nothing could be scheduled."""
        live = [r for r in self.running if not r.finished]
        return bool(live) and not any(r.inflight or r.retract_pending for r in self.running)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        rows, budget = [], self.cfg.max_batch_tokens
        if self.cfg.mixed and self._has_prefill_work():
            rows = self._decode_rows(budget)
            budget -= len(rows)
        n_decode = len(rows)
        for req in list(self.running):
            if budget > 0 and req.in_prefill and self._schedulable(req) and not req.isolate:
                row = self._prefill_row(req, budget)
                if row is not None:
                    rows.append(row)
                    budget -= row.end - row.start
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            if req.isolate and rows:
                break  # it prefills alone
            if not self._admit(req):
                break
            self.waiting.popleft()
            row = self._prefill_row(req, budget)
            if row is not None:
                rows.append(row)
                budget -= row.end - row.start
            if req.isolate:
                break
        if len(rows) == n_decode:  # no prefill row after all: the decode rows make a decode batch
            return self._build("decode", rows) if rows else None
        return self._build("prefill", rows)

    def _has_prefill_work(self) -> bool:
        return any(r.in_prefill and self._schedulable(r) and not r.isolate for r in self.running) or (
            bool(self.waiting) and len(self.running) < self.cfg.max_running)

    def _decode_rows(self, limit: int | None = None) -> list[Row]:
        rows = []
        for req in list(self.running):
            if limit is not None and len(rows) >= limit:
                break
            if not self._schedulable(req) or req.in_prefill or req.isolate:
                continue
            row = self._decode_row(req)
            if row is not None:
                rows.append(row)
        return rows

    def _schedule_decode(self) -> ScheduledBatch | None:
        rows = self._decode_rows()
        return self._build("decode", rows) if rows else None

    def _decode_row(self, req: Request) -> Row | None:
        pending = req.num_scheduled + 1 - req.num_tokens  # 1: a token still comes from the batch in flight
        if len(req.output_ids) + pending >= req.params.max_new_tokens:
            return None  # that token ends it
        pos = req.num_scheduled
        if not self._ensure_pages(req, pos + 1, retract=True):
            return None
        snap = pos + 1 if self.policy.enabled and self.cfg.decode_snapshots and \
            (pos + 1) % self.cfg.track_interval == 0 else None
        return Row(req, pos, pos + 1, samples=True, snapshot=self._alloc_snapshot(req, snap), decode=True)

    def _schedulable(self, req: Request) -> bool:
        return req.status is Status.RUNNING and not req.retract_pending

    def _admit(self, req: Request) -> bool:
        """Match, lock, restore; room for the whole remaining prefill. False: nothing held, try later.
        The table is keyed by the Request itself: a finished request's rid may be reused while its
        zombie row still holds the old entry."""
        tokens = req.all_ids
        # a request scoring its prompt needs logits at every prompt position: it matches nothing
        # (vLLM does the same), but still donates what it computes, so the cache stays as useful
        match = tokens[:0] if req.needs_prompt_logprobs else tokens[:-1]
        handle = self._retry(lambda: self.table.admit(req, match), slots=1)
        if handle is None:
            return False
        # alone in memory, a request is admitted on its prompt pages (its decode retracts nobody else)
        reserve = self._decode_reserve(req) if self.running else 0
        need = self._pages_short(len(tokens) + reserve, handle.prefix_len // self.cfg.page_size)
        if not self._make_room(0, need + self._reserved_pages()):
            self.table.release(handle)
            return False
        hit = handle.prefix_len
        req.handle, req.status = handle, Status.RUNNING
        req.num_scheduled = req.num_computed = hit
        req.prefill_target = len(tokens)
        req.latest_snapshot = None
        bp = handle.hit.branch_point if self.policy.branch_points else None
        req.branch_point = bp if bp is not None and hit < bp < len(tokens) else None
        self._admissions += 1
        req.admit_seq = self._admissions
        if not req.admitted_once:
            req.admitted_once, req.cached_tokens, req.admit_time = True, hit, time.monotonic()
            self.prompt_tokens += len(req.prompt_ids)
            self.cache_hit_tokens += hit
        self.running.append(req)
        return True

    def _pages_short(self, num_tokens: int, have: int) -> int:
        return max(0, -(-num_tokens // self.cfg.page_size) - have)

    def _decode_reserve(self, req: Request) -> int:
        """Tokens of decode growth admission keeps room for: a share of the output still to come."""
        remaining = req.params.max_new_tokens - len(req.output_ids)
        return math.ceil(remaining * self.cfg.decode_reserve_ratio) if remaining > 0 else 0

    def _reserved_pages(self) -> int:
        """Pages running requests still need to finish their prefill and their reserved share of decode
        (admission leaves them room)."""
        p = self.cfg.page_size
        return sum(self._pages_short(max(r.prefill_target, r.num_scheduled) + self._decode_reserve(r),
                                     r.handle.prefix_len // p + len(r.handle.own_pages))
                   for r in self.running if r.handle is not None)

    def _chunk_end(self, req: Request, budget: int) -> int:
        start, target = req.num_scheduled, req.prefill_target
        c, g = self.cfg.chunk_size, self.cfg.checkpoint_interval
        end = min(target, (start // c + 1) * c, start + budget)
        cuts = [req.branch_point, self._tail_point(req)]
        for cut in cuts:
            if cut is not None and start < cut < end:
                end = cut
        if end < target and end % g and end - end % g > start:
            end -= end % g  # cut by the budget: keep chunk ends on checkpoint boundaries
        return end

    def _tail_point(self, req: Request) -> int | None:
        """Policy `split_prompt_tail`: the last checkpoint boundary before the prompt's last token.
        A repeat of the prompt matches prompt[:-1] (one token must be computed for logits), so the
        state that serves it sits at the boundary <= len - 1, not at the prompt's end."""
        if not (self.policy.enabled and self.policy.split_prompt_tail) or req.prefill_target < 2:
            return None
        share = self.policy.tail_min_new
        if share is not None and req.handle is not None and \
                req.prefill_target - req.handle.hit.kv_match_len < share * req.prefill_target:
            return None  # mostly a known prefix (a tree search's next prompt, an agent's next turn): no tail
        g = self.cfg.checkpoint_interval
        return (req.prefill_target - 1) // g * g or None

    def _prefill_row(self, req: Request, budget: int) -> Row | None:
        end = self._chunk_end(req, budget)
        if not self._ensure_pages(req, end, retract=False):  # admission reserved them; decode retracts
            return None
        snap = end if self.policy.enabled and end % self.cfg.checkpoint_interval == 0 else None
        return Row(req, req.num_scheduled, end, samples=end == req.prefill_target,
                   snapshot=self._alloc_snapshot(req, snap))

    # ------------------------------------------------------------------ memory
    def _alloc_snapshot(self, req: Request, pos: int | None) -> int | None:
        """A snapshot slot for the state after `pos` tokens (copied by the runner). Skipped, not
        fatal, when no slot can be had: a missing snapshot only costs a future cache hit."""
        if pos is None:
            return None
        try:
            ok = self._retry(lambda: req.handle.slots.snapshot(pos, copy=False), slots=1)
        except TooManyStateSlotsError:
            return None
        return pos if ok is not None else None

    def _ensure_pages(self, req: Request, num_tokens: int, retract: bool) -> bool:
        """Pages for `num_tokens`; under pressure evict from the tree, then retract the newest request."""
        while True:
            if self._retry(lambda: self.table.ensure_pages(req.handle, num_tokens), pages=1) is not None:
                return True
            if not retract or any(r.retract_pending for r in self.running):
                return False  # memory comes back when the pending retraction is processed
            victim = self._newest()
            self._retract(victim)
            if victim is req or req.status is not Status.RUNNING:
                return False

    def _retry(self, fn, slots: int = 0, pages: int = 0):
        """fn(); on OutOfMemoryError make room in the tree and try once more. None if still out."""
        try:
            return fn()
        except OutOfMemoryError as e:
            if not self._make_room(slots, max(pages, e.requested - e.free if "page" in e.kind else 0)):
                return None
        try:
            return fn()
        except OutOfMemoryError:
            return None

    def _make_room(self, n_slots: int, n_pages: int) -> bool:
        """Evict from the tree until the memory can hold n_slots + n_pages: checkpoints first (their KV
        stays for a later refill), then least recently used leaves."""
        mem, cache = self.memory, self.cache
        while not mem.can_fit(n_slots, n_pages):
            pages_short = mem.num_free_pages() < n_pages
            if n_slots and (mem.num_free_slots() < n_slots or not pages_short) and cache.evict_checkpoints(1):
                continue
            if cache.evict_pages(max(1, n_pages - mem.num_free_pages())) or cache.evict_checkpoints(1):
                continue
            return False
        return True

    # ------------------------------------------------------------------ building a batch
    def _build(self, mode: str, rows: list[Row]) -> ScheduledBatch:
        p, ids, placeholders, copies = self.cfg.page_size, [], [], []
        tables, slots, pins_s, pins_p = [], [], [], []
        offset, spans, scoring = 0, [], False
        for row in rows:
            req, h = row.req, row.req.handle
            toks = [req.token_at(q) if q < req.num_tokens else None for q in range(row.start, row.end)]
            for j, t in enumerate(toks):
                if t is None:
                    placeholders.append((offset + j, row))
            ids.append([0 if t is None else t for t in toks])
            offset += len(toks)
            pages = self.table.page_table(h)[: -(-row.end // p)]
            tables.append(pages)
            slots.append(h.slots.working)
            pins_p.extend(pages)
            pins_s.append(h.slots.working)
            if row.snapshot is not None:
                snap_slot = h.slots.snapshot_slot(row.snapshot)
                copies.append((h.slots.working, snap_slot))
                pins_s.append(snap_slot)
            n_logits = row.end - row.start if not row.decode and self._scores_prompt(row) else 1
            scoring |= n_logits > 1
            spans.append((offset - n_logits, offset))
            req.num_scheduled = row.end
            req.inflight += 1
            if mode == "prefill" and not row.decode:
                req.prefill_forwards += 1
        self.memory.pin(pins_s, pins_p)
        fb = ForwardBatch.build(mode, ids, [r.start for r in rows], tables, slots, p)  # on the host first
        if scoring:
            fb.logits_indices = torch.tensor([i for a, b in spans for i in range(a, b)], dtype=torch.int64)
            k = 0
            for j, (a, b) in enumerate(spans):
                spans[j], k = (k, k + b - a), k + b - a
        else:
            spans = [(j, j + 1) for j in range(len(rows))]
        _upload(fb, torch.device(self.cfg.device))
        return ScheduledBatch(mode, rows, fb, copies, placeholders, (pins_s, pins_p), spans)

    @staticmethod
    def _scores_prompt(row: Row) -> bool:
        req = row.req
        return req.needs_prompt_logprobs and row.start < len(req.prompt_ids) - 1

    # ------------------------------------------------------------------ results
    def process(self, batch: ScheduledBatch, sampled) -> list[Request]:
        """Apply a finished batch. `sampled`: a BatchSample (runtime/batch_sampling.py), or a plain
        list where `tokens[i]` is row i's sampled token (None where it samples nothing).
        Returns the requests that got a token (or finished)."""
        if isinstance(sampled, list):
            sampled = BatchSample(sampled, [None] * len(sampled))
        self.memory.unpin(*batch.pinned)
        touched = []
        pol = self.policy
        for i, (row, tok) in enumerate(zip(batch.rows, sampled.tokens)):
            req = row.req
            req.inflight -= 1
            if req.finished or req.status is not Status.RUNNING or req.void:
                continue  # a zombie row (finished or aborted while this batch was built), or void
            req.num_computed = row.end
            if not row.decode:
                self.prefill_tokens += row.end - row.start
            if row.snapshot is not None:
                req.handle.slots.drop_before(row.snapshot)  # superseded by the newer complete state
                req.latest_snapshot = row.snapshot
                if (not row.decode and pol.donate_chunks) or (row.decode and pol.donate_decode) \
                        or row.snapshot in (req.branch_point, self._tail_point(req)):
                    self._donate_latest(req)
            if not row.decode and row.end == req.prefill_target and pol.donate_handover:
                self._donate_latest(req)
            if i in sampled.prompt_logprobs:
                first, entries = sampled.prompt_logprobs[i]
                del req.prompt_lp[first:]
                req.prompt_lp.extend(entries)
            if row.samples and req.params.max_new_tokens == 0:
                req.finish("length")  # scored the prompt, generates nothing
                touched.append(req)
            elif row.samples and tok is not None:
                first = not req.output_ids
                req.append_token(tok, sampled.logprobs[i])
                self.generated_tokens += 1
                if first:
                    self.first_tokens += 1
                    self.first_token_forwards += req.prefill_forwards
                    self.first_token_seconds += req.first_token_time - req.arrival_time
                touched.append(req)
                if req.followers:
                    touched.extend(self._fork(req, sampled.forks.get(i, [])))
        for row in batch.rows:
            self._settle(row.req)
        return touched

    def extend(self, batch: ScheduledBatch, extra: dict[int, list[int]]) -> list[Request]:
        """Speculative decoding, after `process`: row i's request also committed the tokens `extra[i]`
        (accepted drafts, then the target's own), each one more computed position. Stop conditions cut
        as in decode: tokens after the one that finishes a request are dropped."""
        touched = []
        for i, toks in extra.items():
            req = batch.rows[i].req
            for tok in toks:
                if req.finished or req.status is not Status.RUNNING or req.void:
                    break
                req.append_token(tok, None)
                req.num_computed += 1
                req.num_scheduled += 1
                self.generated_tokens += 1
            touched.append(req)
            self._settle(req)
        return touched

    def _fork(self, leader: Request, samples: list) -> list[Request]:
        """n > 1: the leader's prompt is computed; each follower continues from a copy of its state
        (working slot -> the follower's own: copy-on-write, conv windows included), reads the same
        tree pages (a lock on the node the leader reads from) and gets copies of the leader's few own
        pages past it (the unaligned tail), then takes its own first sample. A follower that cannot
        get a slot and pages (or a running place) now is queued instead with that sample: its prefill
        recomputes the prompt's tail from the cache."""
        followers, leader.followers = leader.followers, []
        out, pos = [], len(leader.prompt_ids)
        for f, (tok, lp) in zip(followers, samples):
            f.fork_leader = None
            if f.finished:
                continue
            handle = None
            if len(self.running) < self.cfg.max_running:
                handle = self._retry(lambda: self.table.fork(leader.handle, f, pos), slots=1, pages=1)
            f.prompt_lp = list(leader.prompt_lp)  # the prompt is the same: scored once
            f.append_token(tok, lp)
            self.generated_tokens += 1
            if not f.admitted_once:
                f.admitted_once, f.cached_tokens = True, leader.cached_tokens
                self.prompt_tokens += len(f.prompt_ids)
                self.cache_hit_tokens += leader.cached_tokens
            out.append(f)
            if handle is None:
                if not f.finished:
                    self.waiting.appendleft(f)
                continue
            self.forked += 1
            f.handle, f.status = handle, Status.RUNNING
            f.num_scheduled = f.num_computed = f.prefill_target = pos
            self._admissions += 1
            f.admit_seq = self._admissions
            self.running.append(f)
            self._settle(f)  # its first token may have finished it
        return out

    def _donate_latest(self, req: Request) -> None:
        if req.latest_snapshot is not None:
            self.table.donate(req.handle, req.all_ids, req.latest_snapshot)
            req.latest_snapshot = None

    def _settle(self, req: Request) -> None:
        """Release a finished request, or carry out a pending retraction, once no batch includes it."""
        if req.inflight or req.handle is None:
            return
        if req.finished:
            if req.finish_reason not in ("abort", "error") and self.policy.donate_finish:
                self._donate_latest(req)
            self.table.release(req.handle)
            req.handle = None
            self.running.remove(req)
        elif req.retract_pending:
            self._retract(req)

    def _newest(self) -> Request:
        return max((r for r in self.running if not r.finished), key=lambda r: r.admit_seq)

    def _retract(self, req: Request) -> None:
        if req.inflight:
            req.retract_pending = True
            return
        if self.policy.donate_finish:
            self._donate_latest(req)
        self.table.release(req.handle)
        req.handle, req.status, req.retract_pending, req.void = None, Status.WAITING, False, False
        req.num_scheduled = req.num_computed = req.prefill_target = 0
        req.latest_snapshot = req.branch_point = None
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.retractions += 1
