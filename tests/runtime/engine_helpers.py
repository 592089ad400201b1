"""Shared pieces of the engine tests: the single-request reference loop, workloads, accounting checks."""
from __future__ import annotations

import dataclasses
import random
import weakref

import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.runtime.cache.checks import check_cache
from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def one_request_cache(model, n_tokens: int, page: int = 16):
    """Pools for one request of up to n_tokens: (cache, its page table, page size, device); slot 1."""
    dev = next(model.parameters()).device
    n_pages = -(-n_tokens // page)
    cache = CacheTensors.allocate(model.cache_spec(), 2, n_pages + 1, page, device=dev)
    return cache, list(range(1, n_pages + 1)), page, dev


# (prompt, max_new_tokens) -> tokens, per model object: the engine tests compare many engine configs with the
# reference of the same prompts (the model fixture's weights never change under a test)
_REFERENCE = weakref.WeakKeyDictionary()


def reference_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The plain model.step loop: the whole prompt in one prefill, then one decode step per token
    (computed once per model, prompt and length)."""
    memo = _REFERENCE.setdefault(model, {})
    key = (tuple(prompt), max_new_tokens)
    if key not in memo:
        memo[key] = _reference_generate(model, prompt, max_new_tokens)
    return list(memo[key])


@torch.no_grad()
def _reference_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    cache, table, page, dev = one_request_cache(model, len(prompt) + max_new_tokens)
    slot = 1
    logits = model.step(ForwardBatch.build("prefill", [prompt], [0], [table], [slot], page, device=dev), cache)[0]
    out = []
    while True:
        out.append(int(logits.argmax()))
        if len(out) == max_new_tokens:
            return out
        pos = len(prompt) + len(out) - 1
        batch = ForwardBatch.build("decode", [[out[-1]]], [pos], [table], [slot], page, device=dev)
        logits = model.step(batch, cache)[0]


@torch.no_grad()
def reference_top2(model, prompt: list[int], out: list[int]) -> tuple[list[float], list[int]]:
    """(gap between the plain model's best and second-best logit, the second-best token) at each of `out`'s
    positions, from one prefill of prompt + out: how close each greedy choice was to a tie."""
    full = prompt + out
    cache, table, page, dev = one_request_cache(model, len(full))
    batch = ForwardBatch.build("prefill", [full], [0], [table], [1], page, device=dev)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(prompt) - 1, len(full) - 1, device=dev))
    top = model.step(batch, cache).float().topk(2, -1)
    return (top.values[:, 0] - top.values[:, 1]).tolist(), top.indices[:, 1].tolist()


def assert_greedy_equal_up_to_ties(model, prompts, got, refs, tie: float) -> None:
    """Each request's tokens equal the reference's until, at most, a position where the reference's top-2
    logits are within `tie` and the engine took the runner-up; after such a flip the continuations differ
    legitimately (vLLM's logprob-closeness check, with a tie margin instead of logprobs)."""
    for i, (prompt, g, r) in enumerate(zip(prompts, got, refs)):
        assert len(g) == len(r), f"request {i}: {len(g)} tokens, reference {len(r)}"
        j = next((k for k in range(len(r)) if g[k] != r[k]), None)
        if j is None:
            continue
        margins, runner_up = reference_top2(model, prompt, r[:j + 1])
        margin = margins[j]
        assert g[j] == runner_up[j] and margin <= tie, (
            f"request {i} leaves the reference at token {j} ({g[j]} != {r[j]}) where the reference's top-2 logits "
            f"are {margin:.3g} apart (tie margin {tie}; runner-up {runner_up[j]})")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def make_engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(**kw), model=model)


def run_sequential(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    """One request after the other (each can hit what the earlier ones left in the cache)."""
    return [engine.generate([p], params)[0] for p in prompts]


def check_accounting(engine: LLMEngine) -> None:
    """Every used slot and page belongs to exactly one owner: the tree, a running request, or a
    deferred free waiting for an in-flight batch; the tree's invariants hold."""
    cache, table, mem = engine.cache, engine.table, engine.memory
    check_cache(cache, table)
    req_slots = sum(len(r.slots.held()) for r in table.requests())
    req_pages = sum(len(r.own_pages) for r in table.requests())
    assert mem.num_used_slots() == cache.num_checkpoints() + req_slots + mem.num_deferred("slot")
    assert mem.num_used_pages() == cache.num_pages() + req_pages + mem.num_deferred("page")
    running = [r for r in engine.scheduler.running if r.handle is not None]
    assert {id(r) for r in running} == {id(r.rid) for r in table.requests()}  # the table is keyed by Request


def check_idle(engine: LLMEngine) -> None:
    """Nothing running: only the tree holds memory, nothing pinned or deferred."""
    assert not engine.has_unfinished()
    check_accounting(engine)
    assert len(engine.table) == 0 and engine.memory.num_pinned() == 0
    assert engine.memory.num_deferred("slot") == engine.memory.num_deferred("page") == 0
    assert engine.memory.num_used_slots() == engine.cache.num_checkpoints()
    assert engine.memory.num_used_pages() == engine.cache.num_pages()
