"""Memory behaviour of the engine: retraction under a tiny budget (outputs unchanged), abort at every
stage freeing everything, split pools vs unified arena giving identical tokens, the running limit,
and clear errors for bad requests."""
import random

import pytest

from k3compile.runtime.cache.state_slots import MAX_TRANSIENT_SLOTS
from k3compile.runtime.sampling import SamplingParams

from .engine_helpers import check_accounting, check_idle, make_engine, reference_generate, tokens

PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(model):
    rng = random.Random(21)
    system = tokens(rng, 48)
    ps = [system + tokens(rng, n) for n in (12, 30)] + [tokens(rng, n) for n in (50, 64)]
    return ps, [reference_generate(model, p, PARAMS.max_new_tokens) for p in ps]


# Split: 9 usable state slots but 18 pages of 16 tokens; unified: 200 KB for both kinds. Four
# requests of 100-150 tokens each cannot all grow at once.
# decode_reserve_ratio 0: admit on prompt pages alone, so decode growth must retract (the path under test)
TINY = dict(max_running=4, page_size=16, chunk_size=32, track_interval=32, decode_reserve_ratio=0.0)
SPLIT = dict(memory_bytes=300_000, state_fraction=0.7)
UNIFIED = dict(memory_bytes=200_000, enable_unified_memory=True)


@pytest.mark.parametrize("cfg", [SPLIT, dict(SPLIT, overlap=True), UNIFIED,
                                 dict(UNIFIED, overlap=True, cache_policy="every_chunk")],
                         ids=["split", "split,overlap", "unified", "unified,overlap,every_chunk"])
def test_retraction_under_tiny_budget(model, prompts, cfg):
    ps, refs = prompts
    engine = make_engine(model, **TINY, **cfg)
    assert engine.generate(ps, PARAMS) == refs
    assert engine.metrics()["retractions"] > 0
    if cfg.get("enable_unified_memory"):  # compaction moved blocks under the owners' feet
        moves = engine.memory.inner.compaction_stats()
        assert moves["page"]["moves"] + moves["slot"]["moves"] > 0
    check_idle(engine)
    engine.close()


def test_unified_and_split_memory_give_identical_tokens(model, prompts):
    ps, refs = prompts
    outs = []
    for unified in (False, True):
        engine = make_engine(model, chunk_size=32, enable_unified_memory=unified, overlap=unified)
        outs.append(engine.generate(ps, PARAMS))
        check_idle(engine)
        engine.close()
    assert outs[0] == outs[1] == refs


def step_until(engine, pred, reported, limit=200):
    for _ in range(limit):
        if pred():
            return
        for o in engine.step():
            reported.setdefault(o.rid, []).append(o)
        check_accounting(engine)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", ["waiting", "prefill", "decode"])
def test_abort_frees_everything(model, prompts, overlap, stage):
    ps, refs = prompts
    rng = random.Random(22)
    long_prompt = tokens(rng, 300)
    engine = make_engine(model, chunk_size=16, max_batch_tokens=16, overlap=overlap, max_running=1 if stage ==
                         "waiting" else None)
    engine.add_request("keep", ps[0], PARAMS)
    engine.add_request("victim", long_prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
    victim = engine._requests["victim"]
    reported = {}
    if stage == "prefill":
        step_until(engine, lambda: victim.num_computed >= 64, reported)
        assert victim.in_prefill
    elif stage == "decode":
        step_until(engine, lambda: len(victim.output_ids) >= 3, reported)
    before = len(reported.get("victim", []))
    engine.abort("victim")
    engine.abort("victim")  # idempotent
    engine.abort("no-such-request")
    while engine.has_unfinished():
        for o in engine.step():
            reported.setdefault(o.rid, []).append(o)
        check_accounting(engine)
    ends = [o for o in reported["victim"] if o.finished]
    assert len(ends) == 1 and ends[0].finish_reason == "abort"
    assert reported["victim"][before:] == ends and not ends[0].new_token_ids  # just the one final report
    assert sum((o.new_token_ids for o in reported["keep"]), []) == refs[0]
    check_idle(engine)
    engine.abort("victim")  # still a no-op after it was reported
    engine.close()


def test_running_limit_follows_the_state_pool(model):
    split = dict(enable_unified_memory=False)
    engine = make_engine(model, memory_bytes=4_000_000, **split)
    slots = engine.memory.inner.total_slots
    assert engine.scheduler.cfg.max_running == slots // MAX_TRANSIENT_SLOTS
    assert engine.metrics()["max_running"] == slots // MAX_TRANSIENT_SLOTS
    no_cache = make_engine(model, memory_bytes=4_000_000, enable_prefix_cache=False, **split)
    assert no_cache.scheduler.cfg.max_running == no_cache.memory.inner.total_slots
    # the running limit holds under load
    many = make_engine(model, memory_bytes=400_000, chunk_size=16, **split)
    limit = many.scheduler.cfg.max_running
    rng = random.Random(23)
    for i in range(limit + 3):
        many.add_request(f"r{i}", tokens(rng, 20), SamplingParams(max_new_tokens=3, ignore_eos=True))
    while many.has_unfinished():
        many.step()
        assert many.metrics()["running"] <= limit
        check_accounting(many)
    check_idle(many)


def test_bad_requests_are_refused_with_clear_errors(model):
    engine = make_engine(model, max_context=256)
    ok = SamplingParams(max_new_tokens=4)
    engine.add_request("a", [1, 2, 3], ok)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1, 2, 3], ok)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [], ok)
    with pytest.raises(ValueError, match="exceeds the context length 256"):
        engine.add_request("c", [1] * 250, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("d", [1, 512, 3], ok)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("e", [-1], ok)
    assert engine.generate([[4, 5]], ok) and not engine.has_unfinished()


@pytest.mark.parametrize("kw, msg", [
    (dict(chunk_size=24), "multiples of page_size"),
    (dict(page_size=0), "page_size must be a positive int"),
    (dict(cache_policy="most"), "unknown cache policy"),
    (dict(checkpoint_interval=48), "checkpoint_interval 48"),
    (dict(memory_bytes=50_000), "leave room for 0 tokens"),  # the unified arena (default)
    (dict(memory_bytes=50_000, enable_unified_memory=False), "too small"),
    (dict(enable_unified_memory=True, state_fraction=0.5), "state_fraction sizes split pools"),
    (dict(max_context=10**6), "does not fit the memory"),
    (dict(dtype="fp8"), "dtype must be one of"),
])
def test_bad_engine_args_are_refused(model, kw, msg):
    with pytest.raises(ValueError, match=msg):
        make_engine(model, **kw)


def test_rid_can_be_reused_as_soon_as_its_finish_is_reported(model, prompts):
    """With overlap, a request stopped by a token still rides in the batch built meanwhile (a zombie
    holding its memory); its rid is free for a new request the moment its finish is reported."""
    ps, refs = prompts
    engine = make_engine(model, overlap=True, chunk_size=32)
    stop = refs[0][5]
    params = SamplingParams(max_new_tokens=40, stop_token_ids=(stop,))
    expected = refs[0][: refs[0].index(stop) + 1]
    engine.add_request("b", ps[1], PARAMS)  # keeps batches going, so a's last row is not skipped
    for round_ in range(2):
        engine.add_request("a", ps[0], params)
        out, done = [], False
        while not done:
            for o in engine.step():
                if o.rid == "a":
                    out.extend(o.new_token_ids)
                    done = done or o.finished
            check_accounting(engine)
        assert out == expected, f"round {round_}"
        if round_ == 0:
            assert any(r.rid == "a" for r in engine.scheduler.running), "expected a zombie still holding memory"
    while engine.has_unfinished():
        engine.step()
    check_idle(engine)
