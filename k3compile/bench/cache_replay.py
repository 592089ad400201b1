"""Replaying a request trace (bench/cache_traces.py) through LLMEngine in simulated time, the
KV-only bound on the same requests, and the stand-in forward for long sweeps. Shared by
`bench cache` and `bench cache-pressure`.

Simulated time: every engine step costs `step_ms + token_ms * tokens computed in it` (a relative
cost model, not a measurement); an idle engine jumps to the next arrival. A child request arrives
`think` seconds after its parent finished, with the parent's prompt + answer + its own tokens (a
`standalone` child: its own tokens only).

Forward `model` runs the model (greedy). Forward `cost` keeps everything else of the engine path --
the scheduler's admission, chunking, snapshots, retractions; the radix cache; the request table;
the memory pools and their state copies -- and replaces only the model's forward and sampling by
`StandInRunner`: the snapshot copies still run, and the next token is a fixed function of the
tokens so far. Cache decisions depend on token ids, positions and memory, never on the values a
forward writes, so hits, bytes and evictions are those of a model whose greedy answers are these
tokens; it is ~100x cheaper on CPU, which is what makes traces of hundreds of requests affordable.
"""
from __future__ import annotations

import heapq
import statistics

FORWARDS = ("model", "cost")


def stand_in_token(tokens: list[int], vocab: int = 256, length: int | None = None) -> int:
    """The stand-in model's greedy next token: a fixed mix of the context's length and last tokens
    (the same context gives the same token under every policy, like a real greedy model). `length`:
    the context's length when `tokens` is only its tail (at least the last 4 tokens)."""
    h = (len(tokens) if length is None else length) * 0x9E3779B1
    for t in tokens[-4:]:
        h = ((h ^ t) * 0x01000193) & 0xFFFFFFFF
    return h % vocab


def _next_token(req) -> int:
    n = req.num_tokens  # the tail only: building prompt + output per step is O(context)
    return stand_in_token([req.token_at(q) for q in range(max(0, n - 4), n)], length=n)


class StandInRunner:
    """Drop-in for ModelRunner on the non-overlap path: runs the batch's snapshot copies (the real
    state moves), no forward; samples `stand_in_token` for every row that samples."""

    _worker = None  # no overlap thread (LLMEngine.__del__ looks for one)

    def __init__(self, memory):
        self.memory = memory

    def run(self, batch):
        """What ModelRunner.run returns (runtime/model_runner.InFlight): the batch and its sampled ids."""
        from k3compile.runtime.model_runner import InFlight

        for working, snap in batch.snapshot_copies:
            self.memory.copy_slot(working, snap)
        job = InFlight(batch)
        job.fallback = self.sample(batch, None)[0]
        return job

    @staticmethod
    def sample(batch, logits):
        from k3compile.runtime.batch_sampling import BatchSample

        tokens = [_next_token(r.req) if r.samples and not r.req.finished and r.req.params.max_new_tokens > 0
                  else None for r in batch.rows]
        # n > 1: the row that gives a leader its first token gives its followers theirs (the same
        # context, so the same stand-in token); the scheduler then forks them from the leader's state
        forks = {i: [(tok, None)] * len(r.req.followers) for i, (r, tok) in enumerate(zip(batch.rows, tokens))
                 if tok is not None and r.req.followers and r.end == r.req.prefill_target}
        return BatchSample(tokens, [None] * len(tokens), forks), {}

    def close(self) -> None:
        pass


BYTE_RATIOS = ("tiny", "k3", "k3-mini")


def byte_ratio_spec(base, ratio: str, page_size: int):
    """`base` (a CacheSpec) with its KDA heads scaled so one state slot weighs as many KV pages as
    in `ratio`'s real model: "k3" (K3 at TP 8: a slot ~ 127 pages of 16 tokens), "k3-mini"
    (k3-mini-6b on one GPU: ~155 pages), "tiny" (base as it is: ~4 pages). What a checkpoint costs
    in KV is what the eviction trades, so the replay keeps the real model's ratio at a small size."""
    from dataclasses import replace

    if ratio not in BYTE_RATIOS:
        raise ValueError(f"byte ratio must be one of {', '.join(BYTE_RATIOS)}, got {ratio!r}")
    if ratio == "tiny":
        return base
    from k3compile.runtime.memory.capacity_sim import k3_spec

    real = k3_spec(8, "k3") if ratio == "k3" else k3_spec(1, "k3-mini-6b")
    target = real.slot_bytes / real.page_bytes(page_size) * base.page_bytes(page_size)
    per_head = base.n_kda * base.kda_head_k * base.kda_head_v * base.state_dtype.itemsize
    return replace(base, kda_heads=max(1, round((target - base.conv_bytes_per_slot) / per_head)))


STAND_IN_CONTEXT = 1 << 15


class StandInModel:
    """What the engine needs of a model when `StandInRunner` replaces the forward: a config, a
    device and the cache's byte sizes. Its step is never called."""

    device = "cpu"

    def __init__(self, preset: str = "k3-tiny", ratio: str = "tiny", page_size: int = 16):
        from dataclasses import replace

        import torch

        from k3compile.model_def.cache import CacheSpec
        from k3compile.model_def.config import get_preset

        # Never runs a forward, so no position limit: long agent contexts replay at k3-tiny's byte sizes.
        self.config = replace(get_preset(preset), max_position_embeddings=STAND_IN_CONTEXT)
        self._spec = byte_ratio_spec(CacheSpec.from_config(self.config, dtype=torch.float32), ratio, page_size)

    def cache_spec(self, dtype=None, tp_size: int = 1):
        return self._spec

    def step_tensors(self, mode, *args):
        raise RuntimeError("the stand-in model has no forward: replace the engine's runner (use_forward 'cost')")


def use_forward(engine, forward: str):
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
    if forward == "cost":
        if engine.args.overlap:
            raise ValueError("the cost-model forward replays the non-overlap engine loop only")
        engine.runner.close()
        engine.runner = StandInRunner(engine.memory)
    return engine


def fork_ids(tid: str, n: int) -> tuple[str, ...]:
    """The ids of a request's samples 2..n (the server names them `rid-i`; `#` keeps them apart from
    the trace's own `.`-separated ids)."""
    return tuple(f"{tid}#{i}" for i in range(1, n))


def replay(engine, roots, step_ms: float, token_ms: float) -> dict:
    """Drive the engine through the trace in simulated time. A request with n > 1 samples is
    submitted as the server submits one (`add_request(..., fork_rids=...)`: one prefill, the state
    forked n ways); its children arrive after its last sample finished (the client's call returns
    then). Hit accounting is per prompt: `prompts` maps each submitted prompt's id (the first
    sample's) to its length, and only those count in the hit rate and the KV-only bound's events
    (one "submit" per prompt); the forked samples compute no prompt and hit nothing of their own.
    Every sample's output and finish event is kept; TTFT is per prompt (the first sample's)."""
    from k3compile.runtime.sampling import SamplingParams

    pending, order = [], 0
    for r in roots:
        heapq.heappush(pending, (r.arrival, order, r.req, []))
        order += 1
    live, events, outputs, cached, tags, prompts = {}, [], {}, {}, {}, {}
    event_steps = []  # per event: the engine step a submit was eligible for / a finish came out of
    token_steps: dict[str, list[int]] = {}  # per request: the engine steps that gave it a token (it ran)
    leader_of, samples_left = {}, {}
    arrival, arrival_step, first_time, first_step = {}, {}, {}, {}
    ckpt_bytes, now, step = [], 0.0, 0
    lives: dict[int, list] = {}  # checkpoint serial -> [engine step of its store, of each hit ...]

    def on_checkpoint(event: str, serial: int) -> None:  # `step`: the engine.step() call now running
        if event == "store":
            lives[serial] = [step]
        elif event == "hit":
            lives[serial].append(step)

    engine.cache.add_checkpoint_listener(on_checkpoint)
    m = engine.metrics()
    done = m["prefill_tokens"] + m["generated_tokens"]
    while pending or engine.has_unfinished():
        if not engine.has_unfinished() and pending[0][0] > now:
            now = pending[0][0]  # idle: jump to the next arrival
        while pending and pending[0][0] <= now:
            t, _, req, ctx = heapq.heappop(pending)
            prompt = list(req.user) if getattr(req, "standalone", False) else ctx + req.user
            forks = fork_ids(req.tid, getattr(req, "n", 1))
            engine.add_request(req.tid, prompt, SamplingParams(max_new_tokens=req.max_new_tokens, ignore_eos=True),
                               fork_rids=forks)
            for rid in (req.tid, *forks):
                live[rid], leader_of[rid] = (req, prompt, []), req.tid
            samples_left[req.tid], prompts[req.tid] = 1 + len(forks), len(prompt)
            arrival[req.tid], arrival_step[req.tid], tags[req.tid] = t, step, req.tags
            events.append(("submit", req.tid, prompt))
            event_steps.append(step)
        outs = engine.step()
        m = engine.metrics()
        work = m["prefill_tokens"] + m["generated_tokens"]
        now += (step_ms + token_ms * (work - done)) / 1000.0
        done = work
        step += 1
        ckpt_bytes.append(m["checkpoint_bytes"])
        for o in outs:
            req, prompt, out = live[o.rid]
            if o.new_token_ids and o.rid in arrival and o.rid not in first_time:
                first_time[o.rid], first_step[o.rid] = now, step - arrival_step[o.rid]  # steps it waited
            out.extend(o.new_token_ids)
            if o.new_token_ids:
                token_steps.setdefault(o.rid, []).append(step - 1)
            if o.finished:
                del live[o.rid]
                outputs[o.rid], cached[o.rid] = out, o.cached_tokens
                events.append(("finish", o.rid, prompt + out))
                event_steps.append(step - 1)
                lead = leader_of.pop(o.rid)
                samples_left[lead] -= 1
                if samples_left[lead] == 0:  # the call returns: its children may go
                    del samples_left[lead]
                    for child in req.children:
                        heapq.heappush(pending, (now + child.think, order, child, prompt + outputs[lead]))
                        order += 1
    ttft = sorted(first_time[r] - arrival[r] for r in first_time)
    return {"events": events, "outputs": outputs, "cached": cached, "tags": tags, "prompts": prompts, "ttft": ttft,
            "ttft_steps": list(first_step.values()), "checkpoint_bytes": ckpt_bytes, "steps": step, "sim_seconds": now,
            "checkpoint_lives": lives, "event_steps": event_steps,
            "token_steps": token_steps}


def oracle_held(lives: dict[int, list], steps: int) -> float:
    """Mean number of checkpoints an all-knowing policy holds over the replay's `steps` samples to
    get the same hits: each state that a lookup restored from, from the step that stored it to
    its last hit, nothing else. On the replay's clock (`checkpoint_bytes` is sampled after every
    engine step): a state stored in step s and last hit in step h is in the samples after steps
    s .. h-1 (the restore copy runs in step h), so x slot bytes it is the same mean as the
    `checkpoint_bytes_mean` column. It keeps the policy's trajectory (the same requests hit at the
    same steps), so it is what those hits cost at the least, not a policy of its own."""
    return sum(life[-1] - life[0] for life in lives.values() if len(life) > 1) / max(1, steps)


def summarize_replay(engine, r: dict, page_size: int) -> dict:
    """One row of a cache benchmark: hits vs the KV-only bound, checkpoint bytes, TTFT, repeats/stems hit."""
    m, st = engine.metrics(), engine.cache.stats()
    bound = kv_only_bound(r["events"], page_size)
    lru = kv_only_lru(r["events"], page_size, m["pages_total"])
    tagged = lambda tag: [rid for rid, t in r["tags"].items() if tag in t]  # noqa: E731
    hits = lambda rids: sum(1 for rid in rids if r["cached"].get(rid, 0) > 0)  # noqa: E731
    ttft = r["ttft"]
    # per prompt (a request with n samples: one prompt, one prefill), like the bound's events
    prompt_tokens = sum(r["prompts"].values())
    hit_tokens = sum(r["cached"][rid] for rid in r["prompts"])
    hit_rate = hit_tokens / prompt_tokens if prompt_tokens else 0.0
    return {
        "policy": engine.policy.name, "requests": len(r["outputs"]), "prompts": len(r["prompts"]),
        "slots_total": m["slots_total"], "pages_total": m["pages_total"], "max_running": m["max_running"],
        "slot_bytes": engine.memory.spec.slot_bytes,
        "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens, "hit_rate": hit_rate,
        "forked_requests": m["forked_requests"],
        "kv_only_bound": bound["hit_rate"],
        "fraction_of_bound": hit_rate / bound["hit_rate"] if bound["hit_rate"] else 0.0,
        "kv_only_lru_equal_pages": lru["hit_rate"],
        "prefill_tokens_computed": m["prefill_tokens"], "retractions": m["retractions"],
        "checkpoint_bytes_mean": sum(r["checkpoint_bytes"]) / max(1, len(r["checkpoint_bytes"])),
        "checkpoint_bytes_peak": st.peak_checkpoint_bytes, "checkpoints_stored": st.checkpoints_stored,
        "checkpoint_bytes_written": st.checkpoints_stored * engine.memory.spec.slot_bytes,
        "checkpoints_evicted": st.checkpoints_evicted, "checkpoints_rejected": st.checkpoints_rejected,
        "checkpoints_hit": sum(1 for life in r["checkpoint_lives"].values() if len(life) > 1),
        "oracle_bytes_mean": oracle_held(r["checkpoint_lives"], len(r["checkpoint_bytes"])) * engine.memory.spec.slot_bytes,
        "pages_evicted": st.pages_evicted,
        **feasibility_bounds(engine, r, page_size, hit_tokens, bound["hit_tokens"]),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else 0.0,
        "ttft_mean_steps": statistics.fmean(r["ttft_steps"]) if r["ttft_steps"] else 0.0,
        "repeats": len(tagged("repeat")), "repeats_hit": hits(tagged("repeat")),
        "stems": len(tagged("stem")), "stems_hit": hits(tagged("stem")),
        "engine_steps": r["steps"], "sim_seconds": r["sim_seconds"],
        "_outputs": r["outputs"], "_cached": r["cached"],
    }


def feasibility_bounds(engine, r: dict, page_size: int, hit_tokens: int, bound_hit_tokens: float) -> dict:
    """bench/cache_bounds.py on this replay's request order and step clock: the least mean
    checkpoint bytes ANY policy needs for 90% of the KV-only bound (`min_bytes_90`; the curve's
    points in `min_bytes_curve` give other targets, in state-holding steps), and an upper bound on
    the hit tokens any policy reaches with this budget's pages and slots (split pools) or arena
    bytes (unified; the whole budget, optimistic) next to this replay's running requests (the
    prompt pages and working state of every request that got a token in a step). `bounds_consistent`: this row's own hits are
    within both (its hit tokens under the budget bound; the least bytes for them under its oracle)."""
    from .cache_bounds import (hit_options, hit_upper_bound, min_state_curve, running_usage, split_resources,
                               unified_resources)
    from .cache_pressure import GOAL_OF_BOUND

    m, spec = engine.metrics(), engine.memory.spec
    steps = max(1, len(r["checkpoint_bytes"]))
    options, _ = hit_options(r["events"], r["event_steps"], page_size, r["token_steps"])
    curve = min_state_curve(options, page_size)
    resources = (unified_resources(engine.args.memory_bytes, spec.page_bytes(page_size), spec.slot_bytes)
                 if m["unified_memory"] else split_resources(m["pages_total"], m["slots_total"]))
    running = running_usage(r["events"], r["token_steps"], page_size, steps)
    ub = hit_upper_bound(options, page_size, steps, resources, running=running)
    oracle_steps = oracle_held(r["checkpoint_lives"], steps) * steps
    return {"min_bytes_90": curve.at(GOAL_OF_BOUND * bound_hit_tokens) * spec.slot_bytes / steps,
            "min_bytes_curve": curve.tangents(), "hit_ub_tokens": ub["hit_tokens"],
            "hit_ceiling_tokens": ub["ceiling"],
            "bounds_consistent": bool(hit_tokens <= ub["hit_tokens"] + 1e-6 and not ub["running_over_capacity"]
                                      and curve.at(hit_tokens) <= oracle_steps + 1e-6)}


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
    """What a pure-attention radix cache (KV per page, no state, unlimited memory) could hit on the
    same requests: replay ("submit", tid, prompt) / ("finish", tid, prompt + output) events in
    order. A request's hit is the longest page-aligned prefix of its prompt less the last token
    that an earlier prompt (as if its prefill were instant: optimistic, so an upper bound) or an
    earlier finished prompt + output had."""
    trie, hit, total = PageTrie(page_size), 0, 0
    for kind, _, seq in events:
        if kind == "submit":
            hit += trie.match(seq[:-1])
            total += len(seq)
            trie.insert(seq)
        else:
            trie.insert(seq[:-1])  # the last generated token was never fed back: it has no KV
    return {"hit_tokens": hit, "prompt_tokens": total, "hit_rate": hit / total if total else 0.0}


class _LRUPage:
    __slots__ = ("key", "parent", "children", "stamp")

    def __init__(self, key, parent):
        self.key, self.parent, self.children, self.stamp = key, parent, {}, 0


def kv_only_lru(events: list[tuple], page_size: int, capacity_pages: int) -> dict:
    """A pure-attention radix cache (KV per page, no state) with LRU leaf eviction, holding at most
    `capacity_pages` pages: the KV-only reference at the same KV memory as the hybrid engine's page
    pool. Same events and hit rule as `kv_only_bound`. Optimistic: the pages of running requests
    are cache entries too (never pinned, never counted twice), and a prompt's KV is there the
    moment it is submitted."""
    import itertools

    root, p, clock, size = _LRUPage((), None), page_size, itertools.count(1), 0
    heap: list = []  # (stamp, id, node) of leaves, validated on pop

    def walk(tokens, create: bool):
        nonlocal size
        node, n, t = root, 0, next(clock)
        for i in range(0, len(tokens) - len(tokens) % p, p):
            key = tuple(tokens[i:i + p])
            child = node.children.get(key)
            if child is None:
                if not create:
                    break
                child = node.children[key] = _LRUPage(key, node)
                size += 1
            child.stamp = t
            node, n = child, n + p
        if node is not root and not node.children:
            heapq.heappush(heap, (node.stamp, id(node), node))
        return n

    def evict():
        nonlocal size
        while size > capacity_pages and heap:
            stamp, _, node = heapq.heappop(heap)
            if node.children or node.stamp != stamp or node.parent is None or \
                    node.parent.children.get(node.key) is not node:
                continue  # stale entry: refreshed, no longer a leaf, or gone
            del node.parent.children[node.key]
            size -= 1
            parent, node.parent = node.parent, None
            if parent is not root and not parent.children:
                heapq.heappush(heap, (parent.stamp, id(parent), parent))

    hit = total = 0
    for kind, _, seq in events:
        if kind == "submit":
            hit += walk(seq[:-1], create=False)
            total += len(seq)
            walk(seq, create=True)
        else:
            walk(seq[:-1], create=True)
        evict()
    return {"hit_tokens": hit, "prompt_tokens": total, "hit_rate": hit / total if total else 0.0}
