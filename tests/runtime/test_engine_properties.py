"""Random interleavings of add / abort / step through the whole engine (real k3-tiny model), over
random configurations (overlap, unified memory, page size, cache policy, tight memory that forces
retraction). After every step every page and slot has exactly one owner and the tree's invariants
hold; at the end memory is back to "only the tree", and every request that was not aborted
produced exactly the reference tokens."""
import random

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st, target

from k3compile.runtime.sampling import SamplingParams

from .engine_helpers import check_accounting, check_idle, make_engine, reference_generate, tokens

MAX_NEW = 10


@pytest.fixture(scope="module")
def pool(model):
    """Prompts sharing stems (so the cache hits and forks), with their reference outputs."""
    rng = random.Random(31)
    a, b = tokens(rng, 40), tokens(rng, 70)
    prompts = [a + tokens(rng, 3), a + tokens(rng, 25), a[:20] + tokens(rng, 9), b, b + tokens(rng, 11),
               tokens(rng, 2), tokens(rng, 33)]
    return prompts, [reference_generate(model, p, MAX_NEW) for p in prompts]


CONFIG = st.fixed_dictionaries({
    "overlap": st.booleans(),
    "enable_unified_memory": st.booleans(),
    "page_size": st.sampled_from([1, 16]),
    "cache_policy": st.sampled_from(["sparse", "every_chunk", "end"]),
    "enable_prefix_cache": st.booleans(),
    "tight": st.booleans(),
})
ADD = st.tuples(st.just("add"), st.lists(st.integers(0, 6), min_size=1, max_size=3), st.integers(1, MAX_NEW))
STEP = st.tuples(st.just("step"), st.integers(1, 6))
ACTION = st.one_of(ADD, STEP, ADD, STEP, st.tuples(st.just("abort"), st.integers(0, 30)))


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=CONFIG, actions=st.lists(ACTION, min_size=1, max_size=24))
def test_random_add_abort_step(model, pool, cfg, actions):
    prompts, refs = pool
    tight = cfg.pop("tight")
    mem = dict(memory_bytes=120_000, state_fraction=0.55, max_running=3) if tight else dict(memory_bytes=2_000_000)
    if cfg["enable_unified_memory"] and tight:  # one arena: a request alone must still fit 4 slots + 90 tokens
        mem = dict(memory_bytes=160_000, max_running=3)
    if tight:  # admit on prompt pages alone so decode growth runs into retraction
        mem["decode_reserve_ratio"] = 0.0
    engine = make_engine(model, chunk_size=16, track_interval=16, max_batch_tokens=48, **mem, **cfg)
    added, aborted, got = [], set(), {}

    def step():
        for o in engine.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason == ("abort" if o.rid in aborted else "length")
                got[o.rid + "/done"] = True
        check_accounting(engine)

    for act in actions:
        if act[0] == "add":
            for i in act[1]:
                rid = f"r{len(added)}"
                engine.add_request(rid, prompts[i], SamplingParams(max_new_tokens=act[2], ignore_eos=True))
                added.append((rid, i, act[2]))
        elif act[0] == "abort" and added:
            rid = added[act[1] % len(added)][0]
            if not got.get(rid + "/done"):
                aborted.add(rid)
            engine.abort(rid)
        else:
            for _ in range(act[1] if act[0] == "step" else 0):
                step()
    for _ in range(500):
        if not engine.has_unfinished():
            break
        step()
    check_idle(engine)
    m = engine.metrics()  # steer generation toward the interesting interleavings
    target(float(m["retractions"]), label="retractions")
    target(float(m["cache_hit_tokens"]), label="cache hit tokens")
    event(f"retracted: {m['retractions'] > 0}")
    event(f"cache hit: {m['cache_hit_tokens'] > 0}")
    for rid, i, n in added:
        assert got.get(rid + "/done"), f"{rid} never reported finished"
        if rid not in aborted:
            assert got.get(rid, []) == refs[i][:n], f"{rid} (prompt {i}) differs from the reference"
    engine.close()
