"""Parameterized request traces for the cache benchmark, in simulated time (issue 15).

A trace is a forest of requests. A root arrives at a time (seconds, Poisson); a child arrives
`think` seconds after its parent finishes, with the parent's prompt + answer + its own `user`
tokens as its prompt. Four kinds of traffic, mixed by weight and interleaved in time:

* chat: sessions over a few shared system prompts; turns with think time of minutes.
* agent: tool loops over a long shared tool/system prefix: many steps, each appending a short
  tool result to the whole context so far; think time = tool latency (seconds).
* tot: tree-of-thought: a problem, a first answer, then forks into branches that share a lead-in
  and diverge; branches go on a few levels; submitted together (think time ~0).
* oneoff: unrelated single requests (noise that competes for memory); a share of them are exact
  repeats of an earlier one-off (retries, evaluation harnesses, n samples).

Token ids are random bytes; answers come from the model (greedy, ignore_eos), so the token trace
is the same under every cache policy. Tags on requests: `repeat` (an exact repeat of an earlier
prompt) and `stem` (a root whose prompt starts with a shared prefix two earlier roots had), for
"repeats and shared stems always hit". A stem counts from its third root on: a hybrid cache learns
that a prefix is shared only when a second request diverges from it (that one plants the branch
point; the first stored its state past the stem), so the second root cannot hit the stem.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

KINDS = ("chat", "agent", "tot", "oneoff")


@dataclass
class Req:
    tid: str
    user: list[int]  # appended to the parent's prompt + answer (a root: its whole prompt)
    max_new_tokens: int
    think: float = 0.0  # seconds after the parent finishes
    children: list["Req"] = field(default_factory=list)
    tags: tuple[str, ...] = ()


@dataclass
class Root:
    arrival: float  # seconds
    kind: str
    req: Req


Length = "int | tuple[int, int] | tuple[float, float, int, int]"


def draw_length(rng: random.Random, d) -> int:
    """A token count from a length spec: an int (fixed), (lo, hi) (uniform), or (median, sigma, lo,
    hi) (log-normal with that median and log-space sigma, clipped to [lo, hi]: token lengths of
    prompts, tool outputs and answers are heavy-tailed, so a uniform range misstates both the
    typical request and the long ones that fill memory)."""
    if isinstance(d, int):
        return d
    if len(d) == 2:
        return rng.randint(*d)
    median, sigma, lo, hi = d
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


@dataclass(frozen=True)
class TraceSpec:
    """Trace shape. The defaults are scaled-down production shapes (see DISTRIBUTIONS below); every
    length is an int, a (lo, hi) range or a (median, sigma, lo, hi) log-normal."""
    mix: tuple[tuple[str, float], ...] = (("agent", 1.0), ("oneoff", 1.0))  # kind -> weight of roots
    roots: int = 40  # root requests (sessions, agent tasks, ToT problems, one-offs)
    duration: float = 600.0  # seconds over which roots arrive
    # chat
    systems: int = 3
    system_len: Length = (1200.0, 0.5, 400, 4000)
    chat_turns: Length = (2, 6)
    chat_user: Length = (80.0, 1.0, 8, 2000)
    chat_answer: Length = (150.0, 0.7, 16, 600)
    chat_think: float = 90.0  # mean seconds between turns
    # agent
    tool_prefixes: int = 2  # distinct agent apps (system prompt + tool schemas), each shared by its tasks
    tool_prefix_len: Length = (3000.0, 0.4, 1500, 8000)
    task_len: Length = (150.0, 0.8, 16, 2000)
    agent_steps: Length = (6, 14)
    tool_result: Length = (300.0, 1.0, 16, 4000)
    agent_answer: Length = (60.0, 0.6, 8, 300)
    tool_latency: float = 7.0  # mean seconds
    # tree of thought
    problem_len: Length = (1500.0, 0.5, 400, 4000)
    tot_answer: Length = (120.0, 0.6, 16, 400)
    branches: Length = (2, 3)
    tot_depth: int = 2
    branch_lead: int = 24
    branch_user: Length = (60.0, 0.6, 8, 300)
    # one-off
    oneoff_len: Length = (600.0, 0.9, 32, 6000)
    oneoff_answer: Length = (100.0, 0.7, 8, 400)
    repeat_prob: float = 0.2
    repeat_window: int = 3  # a repeat resends one of the last `repeat_window` distinct one-offs (retries, n samples)
    seed: int = 0

    def check(self) -> None:
        kinds = dict(self.mix)
        if not kinds or any(k not in KINDS for k in kinds) or any(w < 0 for w in kinds.values()) \
                or sum(kinds.values()) <= 0:
            raise ValueError(f"mix must weigh kinds from {KINDS} with non-negative weights (sum > 0), got {self.mix}")
        if self.roots < 1 or self.duration < 0:
            raise ValueError(f"roots must be >= 1 and duration >= 0, got {self.roots}, {self.duration}")
        for name, v in vars(self).items():
            if name in ("mix", "seed", "roots", "duration", "repeat_prob") or isinstance(v, float):
                continue
            if isinstance(v, int):
                if v < (0 if name == "tot_depth" else 1):
                    raise ValueError(f"{name} must be >= 1, got {v}")
            elif len(v) == 2:
                if not (all(isinstance(x, int) for x in v) and 1 <= v[0] <= v[1]):
                    raise ValueError(f"{name} must be a range lo,hi with 1 <= lo <= hi, got {v}")
            elif len(v) == 4:
                median, sigma, lo, hi = v
                if not (median > 0 and sigma >= 0 and isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                    raise ValueError(f"{name} must be a log-normal (median > 0, sigma >= 0, lo, hi with 1 <= lo <= hi), "
                                     f"got {v}")
            else:
                raise ValueError(f"{name} must be an int, (lo, hi) or (median, sigma, lo, hi), got {v!r}")
        if not 0 <= self.repeat_prob <= 1:
            raise ValueError(f"repeat_prob must be in [0, 1], got {self.repeat_prob}")


PRESETS = {  # named mixes the benchmark reports
    "agent": (("agent", 1.0), ("oneoff", 1.0)),
    "tot": (("tot", 1.0), ("oneoff", 1.0)),
    "chat": (("chat", 1.0), ("oneoff", 0.5)),
    "mixed": (("chat", 1.0), ("agent", 1.0), ("tot", 1.0), ("oneoff", 1.0)),
}


def make_trace(spec: TraceSpec) -> list[Root]:
    spec.check()
    rng = random.Random(spec.seed)
    toks = lambda n: [rng.randrange(0, 256) for _ in range(n)]  # noqa: E731
    rint = lambda d: draw_length(rng, d)  # noqa: E731
    systems = [toks(rint(spec.system_len)) for _ in range(spec.systems)]
    tool_prefixes = [toks(rint(spec.tool_prefix_len)) for _ in range(spec.tool_prefixes)]
    kinds, weights = zip(*spec.mix)
    stems_seen: dict[str, int] = {}  # roots seen per shared prefix
    oneoffs: list[list[int]] = []
    roots, t = [], 0.0
    rate = spec.roots / spec.duration if spec.duration > 0 else 0.0
    for i in range(spec.roots):
        kind = rng.choices(kinds, weights)[0]
        rid = f"{kind[0]}{i}"
        if kind == "chat":
            k = rng.randrange(spec.systems)
            req = Req(rid, systems[k] + toks(rint(spec.chat_user)), rint(spec.chat_answer))
            _chain(rng, toks, rint, req, rint(spec.chat_turns), spec.chat_user, spec.chat_answer, spec.chat_think)
            stem = f"system{k}"
        elif kind == "agent":
            k = rng.randrange(spec.tool_prefixes)
            req = Req(rid, tool_prefixes[k] + toks(rint(spec.task_len)), rint(spec.agent_answer))
            _chain(rng, toks, rint, req, rint(spec.agent_steps), spec.tool_result, spec.agent_answer, spec.tool_latency)
            stem = f"tools{k}"
        elif kind == "tot":
            req = Req(rid, toks(rint(spec.problem_len)), rint(spec.tot_answer))
            _fork(rng, toks, rint, spec, req, spec.tot_depth)
            stem = None
        else:
            if oneoffs and rng.random() < spec.repeat_prob:
                req = Req(rid, list(rng.choice(oneoffs[-spec.repeat_window:])), rint(spec.oneoff_answer),
                          tags=("repeat",))
            else:
                req = Req(rid, toks(rint(spec.oneoff_len)), rint(spec.oneoff_answer))
                oneoffs.append(req.user)
            stem = None
        if stem is not None:
            if stems_seen.get(stem, 0) >= 2:
                req.tags += ("stem",)
            stems_seen[stem] = stems_seen.get(stem, 0) + 1
        roots.append(Root(t, kind, req))
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return roots


def _chain(rng, toks, rint, first: Req, turns: int, user, answer, think_mean: float) -> None:
    """Turns 2..`turns` after `first`, one after the other: a chat session or an agent's tool loop."""
    node = first
    for k in range(1, turns):
        child = Req(f"{first.tid}.{k}", toks(rint(user)), rint(answer), think=rng.expovariate(1.0 / think_mean))
        node.children = [child]
        node = child


def _fork(rng, toks, rint, spec, node: Req, depth: int) -> None:
    if depth <= 0:
        return
    lead = toks(spec.branch_lead)
    for b in range(rint(spec.branches)):
        child = Req(f"{node.tid}.{b}", lead + toks(rint(spec.branch_user)), rint(spec.tot_answer),
                    think=rng.uniform(0.0, 1.0))
        node.children.append(child)
        _fork(rng, toks, rint, spec, child, depth - 1)


def count(roots: list[Root]) -> int:
    n, stack = 0, [r.req for r in roots]
    while stack:
        q = stack.pop()
        n += 1
        stack.extend(q.children)
    return n
