"""Parameterized request traces for the cache benchmark, in simulated time (issue 15).

A trace is a forest of requests. A root arrives at a time (seconds, Poisson); a child arrives
`think` seconds after its parent finishes, with the parent's prompt + answer + its own `user`
tokens as its prompt (a `standalone` request: its own `user` tokens only, the parent is only
when it is sent). Five kinds of traffic, mixed by weight and interleaved in time:

* chat: sessions over a few shared system prompts; turns with think time of minutes.
* agent: tool loops over a long shared tool/system prefix: many steps, each appending a short
  tool result to the whole context so far; think time = tool latency (seconds).
* tot: tree-of-thought as Yao et al.'s BFS sends it (princeton-nlp/tree-of-thought-llm, src/tot/methods/
  bfs.py): per level, a propose call for each kept state, then a value call (n samples) for each
  candidate (one request with n, as the reference client sends it); the best `tot_breadth`
  candidates go on (`_prompted_tot`). Every prompt is a few-shot template + the
  problem + the steps so far + an instruction suffix (`_prompted_tot`), so two prompts of a problem
  share template + problem + common steps and part inside a prompt, before the suffix.
* tot_fork: tree-of-thought as SGLang's tree_of_thought_deep benchmark sends it: a problem, a first
  answer, then forks into branches that extend the parent's whole context with a shared lead-in
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

KINDS = ("chat", "agent", "tot", "tot_fork", "oneoff")


@dataclass
class Req:
    tid: str
    user: list[int]  # appended to the parent's prompt + answer (a root: its whole prompt)
    max_new_tokens: int
    think: float = 0.0  # seconds after the parent finishes
    children: list["Req"] = field(default_factory=list)
    tags: tuple[str, ...] = ()
    standalone: bool = False  # the prompt is `user` alone (not the parent's prompt + answer + `user`)
    n: int = 1  # samples of this one prompt (OpenAI `n`): the server prefills it once and forks n ways


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
    # tree of thought, prompted BFS (`tot`): Yao et al. 2023, princeton-nlp/tree-of-thought-llm. Search
    # settings from scripts/game24/bfs.sh and the tasks' `steps`; prompt layout and lengths from the
    # math-reasoning task's prompts (commit 84f2bb6, src/tot/prompts/math_reasoning.py: template,
    # "Question: {question}", "Steps: {steps}", instruction suffix), tokens ~ characters / 4
    tot_depth_bfs: int = 4  # levels (Game24Task.steps = MathTask.steps = 4)
    tot_breadth: int = 5  # states kept per level (bfs.sh --n_select_sample 5)
    tot_proposals: Length = (1, 8)  # candidates per propose call (math: one next step; game24's example: 8)
    tot_gen_samples: int = 1  # propose calls per state (bfs.get_proposals: n=1)
    tot_value_samples: int = 3  # samples per value call (bfs.sh --n_evaluate_sample 3)
    # how a call's n samples are sent: False = one request with n (get_values -> gpt(value_prompt, n=...):
    # the reference client's shape, which a server prefills once and forks), True = n separate requests
    # of the same prompt submitted together (the shape session 7's rows were run on)
    tot_samples_as_requests: bool = False
    tot_first_template: int = 265  # propose_first_step_prompt before the question: 1058 chars
    tot_next_template: int = 360  # propose_next_step_prompt before the question: 1434 chars
    tot_value_template: int = 275  # value_prompt before the question: 1096 chars
    tot_question: Length = (40.0, 0.8, 8, 400)  # the templates' example questions: ~83, 9, 31 tokens
    tot_steps_label: int = 5  # "\nSteps until now: " / "\nSteps: " between the question and the steps
    tot_step: Length = (24.0, 0.5, 4, 200)  # one thought: the templates' example steps, 26-130 chars
    tot_gen_suffix: int = 5  # "\nNext step: \n</Task>\n" (20 chars)
    tot_value_suffix: int = 8  # "\nReasoning: \nEvaluation: \n</Task>\n" (33 chars)
    tot_value_answer: Length = (14.0, 0.4, 4, 64)  # "Reasoning: ... Evaluation: likely": examples 49-77 chars
    tot_think: float = 0.0  # seconds between calls: the reference client sends its next call at once
    # tree of thought, forks of the whole context (`tot_fork`): SGLang's tree_of_thought_deep shape
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
            if name in ("mix", "seed", "roots", "duration", "repeat_prob") or isinstance(v, (float, bool)):
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
    "tot_fork": (("tot_fork", 1.0), ("oneoff", 1.0)),
    "chat": (("chat", 1.0), ("oneoff", 0.5)),
    "mixed": (("chat", 1.0), ("agent", 1.0), ("tot", 1.0), ("tot_fork", 1.0), ("oneoff", 1.0)),
}


def make_trace(spec: TraceSpec) -> list[Root]:
    spec.check()
    rng = random.Random(spec.seed)
    toks = lambda n: [rng.randrange(0, 256) for _ in range(n)]  # noqa: E731
    rint = lambda d: draw_length(rng, d)  # noqa: E731
    systems = [toks(rint(spec.system_len)) for _ in range(spec.systems)]
    tool_prefixes = [toks(rint(spec.tool_prefix_len)) for _ in range(spec.tool_prefixes)]
    # the ToT app's few-shot templates (drawn lazily, so traces without `tot` keep their random draws)
    tot_templates: list[list[int]] = []
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
            if not tot_templates:
                tot_templates += [toks(n) for n in (spec.tot_first_template, spec.tot_next_template,
                                                     spec.tot_value_template)]
            req, *samples = _prompted_tot(rng, toks, rint, spec, rid, *tot_templates)  # samples: as requests
            stem = "tot_template"
        elif kind == "tot_fork":
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
        if kind == "tot":
            roots += [Root(t, kind, q) for q in samples]  # the other samples of its first call
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


def _prompted_tot(rng, toks, rint, spec, rid: str, first: list[int], nxt: list[int], value: list[int]) -> list[Req]:
    """One problem solved by BFS as bfs.solve sends it: the calls one after the other (each waits
    for the previous, all its samples: the reference client is sequential). A call with n samples
    (`tot_value_samples` for a value call) is one request with n, as get_values sends it
    (`gpt(value_prompt, n=n_evaluate_sample)`: an OpenAI-compatible server prefills it once and forks),
    or with `tot_samples_as_requests` n identical requests submitted together. Level 0 proposes from
    the question alone (propose_first_step_prompt); later levels propose from each kept state's steps
    (propose_next_step_prompt); every candidate (kept steps + one new step) gets a value call. The
    kept states are a seeded random choice (the values are the model's; which candidates win does not
    change the traffic's shape). Returns the first call's request(s); the rest hang off the last of
    them as a chain of `standalone` requests."""
    question = toks(rint(spec.tot_question))
    gen_label, value_label = toks(spec.tot_steps_label), toks(spec.tot_steps_label)
    gen_suffix, value_suffix = toks(spec.tot_gen_suffix), toks(spec.tot_value_suffix)
    first_suffix = toks(spec.tot_gen_suffix)
    calls: list[tuple[list[int], int, int, str]] = []  # (prompt, answer length, samples, label)
    frontier: list[list[list[int]]] = [[]]  # kept states: their steps so far
    for level in range(spec.tot_depth_bfs):
        candidates = []
        for s, state in enumerate(frontier):
            if level == 0:
                prompt = first + question + first_suffix
            else:
                prompt = nxt + question + gen_label + [t for step in state for t in step] + gen_suffix
            new = [toks(rint(spec.tot_step)) for _ in range(spec.tot_gen_samples * rint(spec.tot_proposals))]
            # the proposals are this call's answer (one line each); the samples split them
            per_sample = max(1, sum(map(len, new)) // spec.tot_gen_samples)
            calls.append((prompt, per_sample, spec.tot_gen_samples, f"p{level}.{s}"))
            candidates += [state + [step] for step in new]
        for c, cand in enumerate(candidates):
            prompt = value + question + value_label + [t for step in cand for t in step] + value_suffix
            calls.append((prompt, rint(spec.tot_value_answer), spec.tot_value_samples, f"v{level}.{c}"))
        frontier = rng.sample(candidates, min(spec.tot_breadth, len(candidates)))
    first_group, tail = None, None
    for prompt, answer, samples, label in calls:
        if spec.tot_samples_as_requests:
            group = [Req(f"{rid}.{label}" + (f"#{k}" if samples > 1 else ""), list(prompt), answer,
                         think=spec.tot_think, standalone=True) for k in range(samples)]
        else:
            group = [Req(f"{rid}.{label}", list(prompt), answer, think=spec.tot_think, standalone=True, n=samples)]
        if tail is None:
            first_group = group  # the problem's first call: arrives as root(s)
        else:
            tail.children = group  # the next call waits for the previous call (all its samples)
        tail = group[-1]
    return first_group


def count(roots: list[Root]) -> int:
    """Sequences the trace asks for: a request with n samples counts n (the engine runs n requests)."""
    n, stack = 0, [r.req for r in roots]
    while stack:
        q = stack.pop()
        n += q.n
        stack.extend(q.children)
    return n


def count_prompts(roots: list[Root]) -> int:
    """Prompts the trace sends (a request with n samples is one prompt, prefilled once)."""
    n, stack = 0, [r.req for r in roots]
    while stack:
        q = stack.pop()
        n += 1
        stack.extend(q.children)
    return n
