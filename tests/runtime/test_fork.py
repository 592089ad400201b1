"""n > 1 on forked state: one request's prefill, then its KDA state (and conv windows) copied into
each follower's working slot, the tree's KV pages shared, the unaligned tail copied. Greedy forks
must equal separate requests token for token; accounting stays exact through finishes, aborts
(a leader aborted before the fork hands its followers on) and the overlap scheduler."""
import random

import pytest

from k3compile.runtime.sampling import SamplingParams

from .engine_helpers import check_accounting, check_idle, make_engine, tokens

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


def run(engine, watch=None):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
        check_accounting(engine)
        if watch:
            watch(engine)
    return outs


@pytest.mark.parametrize("kw", [{}, {"enable_unified_memory": True}, {"overlap": True},
                                {"enable_prefix_cache": False}], ids=["split", "unified", "overlap", "no-cache"])
def test_greedy_forks_equal_separate_requests_with_one_prefill(model, kw):
    prompt = tokens(random.Random(1), 45)   # not page-aligned: the tail page is copied per fork
    engine = make_engine(model, page_size=16, chunk_size=32, **kw)
    alone = engine.generate([prompt], PARAMS)[0]
    before = engine.metrics()["prefill_tokens"]
    engine.add_request("a", prompt, PARAMS, fork_rids=("b", "c", "d"))
    shared_pages = []

    def watch(e):
        live = list(e.table.requests())
        if len(live) == 4:   # all forks running: they read the same tree node's pages
            shared_pages.append(len({id(r.lock.node) for r in live}) == 1 and live[0].prefix_len)

    outs = run(engine, watch)
    assert outs == {rid: alone for rid in "abcd"}
    m = engine.metrics()
    assert m["forked_requests"] == 3
    # one prefill: with the cache it even starts from the first run's checkpoint
    assert m["prefill_tokens"] - before <= len(prompt)
    if kw.get("enable_prefix_cache", True):
        assert shared_pages and all(shared_pages)   # forks share the prefix pages through the tree
    check_idle(engine)


def test_seeded_forks_draw_their_own_tokens_reproducibly(model):
    prompt = tokens(random.Random(2), 20)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    outs = []
    for _ in range(2):
        engine = make_engine(model, page_size=16, chunk_size=32)
        engine.add_request("a", prompt, params, fork_rids=("b", "c"))
        outs.append(run(engine))
        check_idle(engine)
    assert outs[0] == outs[1] and len({tuple(v) for v in outs[0].values()}) == 3
    # the follower with seed + i + 1 draws what a lone request with that seed draws
    engine = make_engine(model, page_size=16, chunk_size=32)
    from dataclasses import replace
    assert engine.generate([prompt], replace(params, seed=6))[0] == outs[0]["b"]


def test_abort_before_the_fork_hands_the_followers_on(model):
    prompt = tokens(random.Random(3), 70)
    alone = make_engine(model, page_size=16, chunk_size=32).generate([prompt], PARAMS)[0]
    engine = make_engine(model, page_size=16, chunk_size=32)   # 70 tokens: three prefill chunks
    engine.add_request("a", prompt, PARAMS, fork_rids=("b", "c"))
    assert engine.step() == []   # first chunk of a's prefill
    engine.abort("a")
    engine.abort("c")   # a follower still waiting for its fork
    outs = run(engine)
    assert outs["b"] == alone and outs.get("a", []) == [] and outs.get("c", []) == []
    check_idle(engine)


def test_prompt_logprobs_with_max_tokens_zero_score_without_generating(model):
    prompt = tokens(random.Random(4), 40)
    engine = make_engine(model, page_size=16, chunk_size=16)   # scored across three chunks
    engine.generate([prompt], PARAMS)   # the prompt is cached now: scoring must still compute it all
    engine.add_request("s", prompt, SamplingParams(max_new_tokens=0, prompt_logprobs=2))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    (o,) = outs
    assert o.finished and o.finish_reason == "length" and o.new_token_ids == []
    plp = o.prompt_logprobs
    assert plp[0] is None and [e.token for e in plp[1:]] == prompt[1:] and all(len(e.top) == 2 for e in plp[1:])
    import torch

    from .engine_helpers import one_request_cache
    from k3compile.model_def.batch import ForwardBatch
    cache, table, page, dev = one_request_cache(model, len(prompt))
    with torch.no_grad():
        ref = model.step(ForwardBatch.build("prefill", [prompt], [0], [table], [1], page, logits="all"),
                         cache).double().log_softmax(-1)
    want = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert [e.logprob for e in plp[1:]] == pytest.approx(want, abs=1e-4)
    check_idle(engine)
