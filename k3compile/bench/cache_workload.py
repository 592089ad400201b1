"""The cache benchmark's workload: multi-turn sessions over shared system prompts, with forks.

A session starts with one of a few system prompts, then runs turns: each turn appends a user message
to the conversation so far and generates an answer, which becomes part of the next turn's prompt.
At a turn a session may fork into several branches (tree-of-thought style): the branches continue
the same conversation with different messages that share a short common lead-in, and each branch
goes on with its own turns. Token ids are random bytes; answers come from the model (greedy), so the
token trace is the same for every cache policy.

Time is counted in engine steps: session i starts at step i * stagger; a turn is submitted `think`
steps after the turn it continues has finished.

The KV-only bound: what a pure-attention radix cache (KV per page, no state) could hit on the same
trace. A request's hit is the longest page-aligned prefix of its prompt (less the last token, which
must be computed) that some earlier request had: the prompt of any request submitted before it
(as if its prefill were instant -- optimistic, so this is an upper bound) or prompt + output of any
request finished before it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Turn:
    tid: str  # stable id: the same request across policies
    user: list[int]  # appended to the conversation before this turn's answer
    max_new_tokens: int
    think: int  # steps between the parent turn's finish and this turn's submission
    children: list["Turn"] = field(default_factory=list)  # the next turn, or the branches of a fork


@dataclass
class Session:
    start_step: int
    system: list[int]
    first: Turn


@dataclass(frozen=True)
class WorkloadSpec:
    sessions: int = 10
    systems: int = 3
    system_len: int = 400
    turns: int = 3
    user_len: tuple[int, int] = (16, 64)
    answer_len: tuple[int, int] = (16, 48)
    fork_prob: float = 0.35
    branches: int = 3
    branch_shared_len: int = 24  # common lead-in of a fork's branch messages
    stagger: int = 12
    seed: int = 0

    def check(self) -> None:
        for name in ("sessions", "systems", "system_len", "turns", "branches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("user_len", "answer_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range lo,hi with 1 <= lo <= hi, got {lo},{hi}")
        if not 0.0 <= self.fork_prob <= 1.0:
            raise ValueError(f"fork_prob must be in [0, 1], got {self.fork_prob}")
        if self.stagger < 0 or self.branch_shared_len < 0:
            raise ValueError("stagger and branch_shared_len must be >= 0")


def make_workload(spec: WorkloadSpec) -> list[Session]:
    spec.check()
    rng = random.Random(spec.seed)
    toks = lambda n: [rng.randrange(0, 256) for _ in range(n)]  # noqa: E731
    systems = [toks(max(1, int(spec.system_len * rng.uniform(0.75, 1.25)))) for _ in range(spec.systems)]

    def turn(tid: str, depth: int, lead: list[int]) -> Turn:
        t = Turn(tid, lead + toks(rng.randint(*spec.user_len)), rng.randint(*spec.answer_len), rng.randint(0, 2))
        if depth + 1 < spec.turns:
            if rng.random() < spec.fork_prob:
                shared = toks(spec.branch_shared_len)
                t.children = [turn(f"{tid}.b{k}", depth + 1, shared) for k in range(spec.branches)]
            else:
                t.children = [turn(f"{tid}.t{depth + 1}", depth + 1, [])]
        return t

    return [Session(i * spec.stagger, systems[i % spec.systems], turn(f"s{i}", 0, [])) for i in range(spec.sessions)]


def count_requests(sessions: list[Session]) -> int:
    n, stack = 0, [s.first for s in sessions]
    while stack:
        t = stack.pop()
        n += 1
        stack.extend(t.children)
    return n


class PageTrie:
    """Page-aligned token prefixes seen so far (a radix cache's KV, with unlimited memory)."""

    def __init__(self, page_size: int):
        self.page_size, self.root = page_size, {}

    def insert(self, tokens: list[int]) -> None:
        node, p = self.root, self.page_size
        for i in range(0, len(tokens) - len(tokens) % p, p):
            node = node.setdefault(tuple(tokens[i:i + p]), {})

    def match(self, tokens: list[int]) -> int:
        node, p, n = self.root, self.page_size, 0
        for i in range(0, len(tokens) - len(tokens) % p, p):
            node = node.get(tuple(tokens[i:i + p]))
            if node is None:
                break
            n += p
        return n


def kv_only_bound(events: list[tuple], page_size: int) -> dict:
    """Replay ("submit", tid, prompt) / ("finish", tid, prompt + output) events in order."""
    trie, hit, total = PageTrie(page_size), 0, 0
    for kind, _, seq in events:
        if kind == "submit":
            hit += trie.match(seq[:-1])
            total += len(seq)
            trie.insert(seq)
        else:
            trie.insert(seq[:-1])  # the last generated token was never fed back: it has no KV
    return {"hit_tokens": hit, "prompt_tokens": total, "hit_rate": hit / total if total else 0.0}
