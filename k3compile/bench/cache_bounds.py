"""Feasibility bounds for issue 15's goals on a replayed trace: what ANY cache policy with
foresight needs (bytes) or can reach (hits under a memory budget), on the replay's request order
and step clock.

The model (every relaxation below gives the policy more freedom, so the bounds stay valid):

* A hit of depth L (page-aligned, KDA state + KV) for prompt i needs the KDA state at exactly
  depth L of i's prompt and the KV of every page above it. Nothing can recreate the state or a KV
  page except a request whose sequence passes through that prefix. Let `use_i` be the engine step
  from which prompt i could be looked up (its submission; admission is first-come first-served, so
  no request submitted after i computes anything before i's lookup) and, for a prefix x, `created_i(x)`
  the latest step <= use_i at which a request submitted before i can have made x:
  - KV: a request j keeps the KV of its whole sequence in its pages until its finish step f_j, so
    created_i(x) = min(max f_j over the j whose sequence starts with x, use_i);
  - state: a KDA state is overwritten every token, so it exists only in the step that computes it:
    a prompt position by the step of j's first token, the state after output token k - 1 in the step
    that sampled token k, and, after a hole in j's token steps (a retraction re-prefills), anything
    before the next token by that token's step (`compute_steps`; the latest such step, capped at use_i).
  A state or page dropped after that step cannot be had again before use_i, so it is held over
  [created_i(x), use_i) at least (on the oracle's clock: stored in step s, used in step h -> h - s
  samples of the mean). Running requests making x at use_i "for free", any state depth on the
  page grid: optimistic.
* Two hits at the same prefix x by prompts i1 before i2 never share a holding interval: i1 itself
  passes through x (by its first token step >= use_i1), so created_i2(x) >= use_i1. So the intervals
  of different (prompt, prefix) pairs are charged independently.

(a) `min_state_curve`: the least mean checkpoint bytes for a target of hit tokens is the
multiple-choice knapsack "pick one depth per prompt, gain = depth, cost = state-holding steps" with
a sum-of-gains constraint. Its LP relaxation (fractional choices) is solved exactly by walking the
segments of every prompt's lower convex hull of (gain, cost) in order of cost per gained token
(Sinha & Zoltners 1979: the LP optimum of a multiple-choice knapsack is that greedy), and an LP
relaxation's optimum is <= the integer optimum: a lower bound on what any policy holds.

(b) `hit_upper_bound`: a policy with P KV pages and S state slots (split pools) or B bytes of one
arena must, at every step t, hold the KV pages and states whose intervals cover t. Maximizing hits
under those per-step capacities is an integer program; its Lagrangian relaxation (prices on every
step's capacity) gives, for ANY prices >= 0, an upper bound (weak duality):
    sum_t price_t * capacity + sum_i max(0, max_L [L - price of the KV and state intervals L needs]).
We search prices by projected subgradient steps and report the smallest bound seen; convergence only
tightens it. Running requests' own KV and working states are left out of the capacity (optimistic).
A KV-only cache with Belady's eviction at the same pages is not such a bound: Belady is optimal only
for unit-size pages with no structure, while prefix caching evicts leaves of a tree and values a page
by how deep a hit it completes, so Belady can lose to a smarter KV policy; and a KV-only policy's hits
need no state, so even the true KV optimum bounds hybrid hits only if it is exact, which it is not
known to be here. The bound above covers the state and KV constraints at once.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

INF = float("inf")


@dataclass
class PromptOptions:
    """One prompt's possible hits: depth k pages (k = 1..len(created)) needs its state held from
    created_state[k-1] and the KV of page d (d = 1..k) from created[d-1], to `use`."""
    use: int
    tokens: int
    created: list[int]  # KV: non-increasing in k
    created_state: list[int]  # state: not monotone (a request computes deeper positions later)


def compute_steps(prompt_len: int, steps: list[int]):
    """For one request with output tokens produced in `steps`: the latest step at which the state
    after its first d tokens can have been computed, as a function of d. Prompt positions are
    computed by the step of its first token; the state after d > prompt_len tokens in the step that
    sampled output d - prompt_len. A gap in the steps may be a retraction, after which everything
    before is recomputed by the next token's step: so never earlier than the last token after a gap."""
    last_gap = max((k for k in range(1, len(steps)) if steps[k] - steps[k - 1] > 1), default=0)
    return lambda d: steps[min(len(steps) - 1, max(d - prompt_len, last_gap, 0))]


def _leader(rid: str) -> str:
    return rid.split("#")[0]  # cache_replay.fork_ids: sample i of `tid` is `tid#i`


def hit_options(events: list[tuple], event_steps: list[int], page_size: int,
                token_steps: dict[str, list[int]]) -> tuple[list[PromptOptions], int]:
    """Per submitted prompt (cache_replay.replay's events, in order, with their steps, and the steps
    that gave each request a token): the depths it could hit and from when each prefix's KV and state
    must have been held. Returns (options, prompt tokens).

    KV of a prefix stays in a running request's pages until it finishes, so a request makes it
    available up to its finish step; a KDA state exists only at the step that computes it
    (`compute_steps`), so a request makes the state after d tokens available at that step only."""
    if len(events) != len(event_steps):
        raise ValueError("one step per event")
    finish: dict[str, tuple[list[int], int]] = {}
    for (kind, rid, seq), step in zip(events, event_steps):
        if kind == "finish":
            finish[rid] = (seq, step)
    samples: dict[str, list[str]] = {}
    for rid in finish:
        samples.setdefault(_leader(rid), []).append(rid)
    p = page_size
    # node: [latest finish of a request through it (KV), latest step computing its state, children by page]
    root: list = [-1, -1, {}]
    out, total = [], 0
    for (kind, tid, prompt), use in zip(events, event_steps):
        if kind != "submit":
            continue
        q = prompt[:-1]  # the engine matches prompt[:-1]: one token is always computed
        node, created, created_state = root, [], []
        for i in range(0, len(q) - len(q) % p, p):
            node = node[2].get(tuple(q[i:i + p]))
            if node is None:
                break
            created.append(min(node[0], use))
            created_state.append(min(node[1], use))
        out.append(PromptOptions(use=use, tokens=len(prompt), created=created, created_state=created_state))
        total += len(prompt)
        for rid in samples.get(tid, [tid]):  # each sample's whole sequence, computed until it finished
            seq, f = finish.get(rid, (prompt + [0], INF))
            ts = token_steps.get(rid)
            at = compute_steps(len(prompt), ts) if ts else (lambda d: f)
            s = seq[:-1]  # the last sampled token is never fed back
            node = root
            for i in range(0, len(s) - len(s) % p, p):
                node = node[2].setdefault(tuple(s[i:i + p]), [-1, -1, {}])
                node[0] = max(node[0], f)
                node[1] = max(node[1], at(i + p))
    return out, total


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Lower convex hull of (gain, cost) points sorted by gain, starting at (0, 0)."""
    hull: list[tuple[float, float]] = []
    for pt in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (pt[0] - x1) >= (pt[1] - y1) * (x2 - x1):  # hull[-1] is on or above the chord
                hull.pop()
            else:
                break
        hull.append(pt)
    return hull


@dataclass
class StateCurve:
    """The LP lower bound on state-holding steps as a function of hit tokens: a convex, piecewise
    linear curve through (gains[j], costs[j]); `max_gain` is the most any policy can hit at all."""
    gains: list[float]
    costs: list[float]

    @property
    def max_gain(self) -> float:
        return self.gains[-1]

    def at(self, target: float) -> float:
        """Least holding steps for `target` hit tokens (INF past max_gain)."""
        if target <= 0:
            return 0.0
        if target > self.max_gain + 1e-9:
            return INF
        j = bisect.bisect_left(self.gains, target)
        if j == 0:
            return self.costs[0]
        g0, g1, c0, c1 = self.gains[j - 1], self.gains[j], self.costs[j - 1], self.costs[j]
        return c0 + (c1 - c0) * (target - g0) / (g1 - g0) if g1 > g0 else c1

    def tangents(self, n: int = 200) -> list[list[float]]:
        """At most ~n points (gain, cost, slope) of the curve, the slope a subgradient there (the one to
        the right, the last point's to the left): each line lies under the whole convex curve, so
        `tangent_bound` over them is still a valid lower bound, exact at the points kept."""
        last = len(self.gains) - 1
        if last == 0:
            return [[0.0, 0.0, 0.0]]
        idx = sorted(set(np.linspace(0, last, min(n, last + 1)).round().astype(int).tolist()))
        out = []
        for j in idx:
            k0, k1 = (j, j + 1) if j < last else (j - 1, j)
            slope = (self.costs[k1] - self.costs[k0]) / (self.gains[k1] - self.gains[k0])
            out.append([self.gains[j], self.costs[j], slope])
        return out


def tangent_bound(tangents: list[list[float]], target: float) -> float:
    """Lower bound on the convex curve at `target` from its points and subgradients (StateCurve.tangents);
    INF past the last point (more than any policy can hit)."""
    if target <= 0:
        return 0.0
    if not tangents or target > tangents[-1][0] + 1e-9:
        return INF
    return max(0.0, max(c + s * (target - g) for g, c, s in tangents))


def min_state_curve(options: list[PromptOptions], page_size: int) -> StateCurve:
    """(a): the LP relaxation's least total state-holding steps per target of hit tokens (module doc)."""
    segments = []  # (cost per token, gain, cost)
    for o in options:
        pts = [(0.0, 0.0)] + [((k + 1) * page_size, float(o.use - c)) for k, c in enumerate(o.created_state)]
        hull = _lower_hull(pts)
        for (g0, c0), (g1, c1) in zip(hull, hull[1:]):
            segments.append(((c1 - c0) / (g1 - g0), g1 - g0, c1 - c0))
    segments.sort(key=lambda s: s[0])
    gains, costs, g, c = [0.0], [0.0], 0.0, 0.0
    for _, dg, dc in segments:
        g, c = g + dg, c + dc
        gains.append(g)
        costs.append(c)
    return StateCurve(gains, costs)


def min_state_bytes(options: list[PromptOptions], page_size: int, target_tokens: float, steps: int,
                    slot_bytes: int) -> float:
    """Least mean checkpoint bytes (over `steps` samples, the report's clock) for `target_tokens`."""
    return min_state_curve(options, page_size).at(target_tokens) * slot_bytes / max(1, steps)


@dataclass(frozen=True)
class Resource:
    """A capacity every step: `capacity` >= kv_weight x KV pages held + state_weight x states held."""
    capacity: float
    kv_weight: float
    state_weight: float


def split_resources(pages: int, slots: int) -> list[Resource]:
    return [Resource(pages, 1.0, 0.0), Resource(slots, 0.0, 1.0)]


def unified_resources(arena_bytes: float, page_bytes: float, slot_bytes: float) -> list[Resource]:
    return [Resource(arena_bytes, page_bytes, slot_bytes)]


class _Pairs:
    """Flat arrays over every (prompt, depth) pair for vectorized pricing."""

    def __init__(self, options: list[PromptOptions], page_size: int, shrink: int = 1):
        keep = [o for o in options if o.created]
        self.n = len(keep)
        lens = np.array([len(o.created) for o in keep], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if self.n else np.zeros(0, np.int64)
        self.prompt = np.repeat(np.arange(self.n), lens)
        self.use = np.repeat(np.array([o.use for o in keep], dtype=np.int64), lens)
        # held during steps created+1 .. use-1 for sure (made in step `created`, restored at the start of `use`)
        self.created = np.minimum(np.array([c for o in keep for c in o.created], dtype=np.int64) + shrink, self.use)
        self.created_state = np.minimum(np.array([c for o in keep for c in o.created_state], dtype=np.int64) + shrink,
                                        self.use)
        self.gain = (np.concatenate([np.arange(1, k + 1) for k in lens]) * page_size).astype(np.float64) \
            if self.n else np.zeros(0)

    def seg_cumsum(self, x: np.ndarray) -> np.ndarray:
        c = np.cumsum(x)
        before = np.concatenate([[0.0], c])[self.starts]
        return c - np.repeat(before, np.diff(np.append(self.starts, len(x))))


def _lagrangian(pairs: _Pairs, resources: list[Resource], prices: list[np.ndarray], caps: list[np.ndarray]):
    """Value of the Lagrangian at `prices` (one array per resource over steps) and the chosen depths."""
    kv = np.zeros(len(pairs.created))
    st = np.zeros(len(pairs.created))
    dual = 0.0
    for r, lam, cap in zip(resources, prices, caps):
        pref = np.concatenate([[0.0], np.cumsum(lam)])
        # price of holding one unit over [created, use)
        kv += r.kv_weight * (pref[pairs.use] - pref[pairs.created])
        st += r.state_weight * (pref[pairs.use] - pref[pairs.created_state])
        dual += float(lam @ cap)
    val = pairs.gain - pairs.seg_cumsum(kv) - st
    if pairs.n == 0:
        return dual, np.zeros(0, np.int64)
    best = np.maximum.reduceat(val, pairs.starts)
    best = np.maximum(best, 0.0)
    # the chosen depth per prompt: the first pair reaching its prompt's best (0 pages if best is 0)
    hit = (val >= np.repeat(best, np.diff(np.append(pairs.starts, len(val)))) - 1e-12) & (val > 0)
    depth = np.zeros(pairs.n, np.int64)
    k_in = np.arange(len(val)) - np.repeat(pairs.starts, np.diff(np.append(pairs.starts, len(val)))) + 1
    first = np.full(pairs.n, np.iinfo(np.int64).max)
    np.minimum.at(first, pairs.prompt[hit], k_in[hit])
    depth[first != np.iinfo(np.int64).max] = first[first != np.iinfo(np.int64).max]
    return dual + float(best.sum()), depth


def _usage(pairs: _Pairs, depth: np.ndarray, steps: int, resource: Resource) -> np.ndarray:
    """Units of `resource` the chosen depths hold in each step."""
    k_in = np.arange(len(pairs.created)) - np.repeat(pairs.starts, np.diff(np.append(pairs.starts,
                                                                                len(pairs.created)))) + 1
    d = depth[pairs.prompt]
    diff = np.zeros(steps + 1)
    for sel, w, made in ((k_in <= d, resource.kv_weight, pairs.created),
                         (k_in == d, resource.state_weight, pairs.created_state)):
        if w:
            np.add.at(diff, np.minimum(made[sel], steps), w)
            np.add.at(diff, np.minimum(pairs.use[sel], steps), -w)
    return np.cumsum(diff)[:steps]


def running_usage(events: list[tuple], token_steps: dict[str, list[int]], page_size: int, steps: int):
    """Per step, what the requests that got a token in it held for sure: the distinct whole KV pages of
    their prompts (requests sharing a prefix share its pages) and one working state each. Returns
    (pages, states), arrays over steps. A request computing in a step has its whole context's KV and
    its working state in memory then; a retracted one gets no token, so it is not counted."""
    prompts = {rid: seq for kind, rid, seq in events if kind == "submit"}
    root: dict = {}
    ids: dict[str, list[int]] = {}  # rid -> page-node ids of its prompt, root first
    parent: list[int] = [-1]
    for rid in token_steps:
        prompt = prompts.get(rid.split("#")[0], [])
        node, path = root, []
        for i in range(0, len(prompt) - len(prompt) % page_size, page_size):
            key = tuple(prompt[i:i + page_size])
            if key not in node:
                node[key] = ({}, len(parent))
                parent.append(path[-1] if path else -1)
            node, nid = node[key]
            path.append(nid)
        ids[rid] = path
    by_step: dict[int, list[str]] = {}
    for rid, ss in token_steps.items():
        for t in ss:
            if 0 <= t < steps:
                by_step.setdefault(t, []).append(rid)
    pages, states, seen = np.zeros(steps), np.zeros(steps), {}
    for t, rids in by_step.items():
        key = frozenset(rids)
        if key not in seen:
            union: set[int] = set()
            for rid in rids:
                union.update(ids[rid])
            seen[key] = len(union)
        pages[t], states[t] = seen[key], len(rids)
    return pages, states


def hit_upper_bound(options: list[PromptOptions], page_size: int, steps: int, resources: list[Resource],
                    iterations: int = 300, running: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """(b): an upper bound on the hit tokens any policy gets within `resources` (module doc), next
    to `running` (per-step KV pages and working states of running requests, `running_usage`: they are
    never the pages a hold interval needs, see the module doc). Returns {"hit_tokens": the bound,
    "ceiling": hits with no capacity limit, "iterations": run}."""
    pairs = _Pairs(options, page_size)
    ceiling = float(sum(len(o.created) * page_size for o in options))
    if pairs.n == 0 or steps <= 0:
        return {"hit_tokens": 0.0 if pairs.n == 0 else ceiling, "ceiling": ceiling, "iterations": 0,
                "running_over_capacity": False}
    steps = max(steps, int(pairs.use.max()) + 1)
    run_kv, run_st = running if running is not None else (np.zeros(0), np.zeros(0))
    caps, over = [], False  # over: running requests alone exceed a capacity (an accounting error)
    for r in resources:
        held = np.zeros(steps)
        held[:len(run_kv)] += r.kv_weight * run_kv[:steps]
        held[:len(run_st)] += r.state_weight * run_st[:steps]
        caps.append(np.maximum(r.capacity - held, 0.0))
        over = over or bool(np.any(held > r.capacity + 1e-9))
    # start: a constant price per resource, the best of a geometric scan (the time-aggregated bound)
    best_ub, prices = ceiling, [np.zeros(steps) for _ in resources]
    for scale in np.geomspace(1e-6, 1e2, 25):
        trial = [np.full(steps, scale / max(r.kv_weight + r.state_weight, 1e-30)) for r in resources]
        ub, _ = _lagrangian(pairs, resources, trial, caps)
        if ub < best_ub:
            best_ub, prices = ub, trial
    # step scale: the price at which holding a typical page for its typical span costs what it gains
    spans = (pairs.use - pairs.created)[pairs.use > pairs.created]
    natural = page_size / float(np.median(spans)) if len(spans) else 1.0
    step0 = max(float(np.max(np.concatenate(prices))), natural)
    for it in range(iterations):
        ub, depth = _lagrangian(pairs, resources, prices, caps)
        best_ub = min(best_ub, ub)
        eta = step0 * 0.5 / (1 + it / 20)
        moved = False
        for j, r in enumerate(resources):
            g = caps[j] - _usage(pairs, depth, steps, r)  # subgradient of the dual in this step's price
            scale = np.max(np.abs(g))
            if scale > 0:
                prices[j] = np.maximum(0.0, prices[j] - eta * g / scale)
                moved = True
        if not moved:
            break
    ub, _ = _lagrangian(pairs, resources, prices, caps)
    return {"hit_tokens": min(best_ub, ub, ceiling), "ceiling": ceiling, "iterations": iterations,
            "running_over_capacity": over}
