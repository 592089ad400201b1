"""Greedy outputs of the engine are token-identical to the plain single-request model.step loop,
whatever the engine does underneath: prefix cache on/off and its policies, overlap on/off, page
size 1 and 16, chunk sizes 16/64/256, restores from checkpoints, many ragged concurrent requests.
Every configuration also ends with the memory accounting back to "only the tree holds anything"."""
import random

import pytest

from k3compile.runtime.sampling import SamplingParams

from .engine_helpers import (GREEDY, assert_greedy_equal_up_to_ties, check_idle, make_engine, reference_generate,
                             reference_top2, run_sequential, tokens)


@pytest.fixture(scope="module")
def workload(model):
    """A shared system prompt with different suffixes (sequential: cache hits), then a batch of
    ragged concurrent requests, some sharing prefixes with each other and with the first part."""
    rng = random.Random(7)
    system = tokens(rng, 150)
    seq = [system + tokens(rng, 9), system + tokens(rng, 40), system[:70] + tokens(rng, 30), system + tokens(rng, 9)]
    conc = [tokens(rng, n) for n in (1, 5, 33, 120)] + [system + tokens(rng, 17), seq[1][:120] + tokens(rng, 3)]
    refs = {tuple(p): reference_generate(model, p, GREEDY.max_new_tokens) for p in seq + conc}
    return seq, conc, refs


CONFIGS = [
    dict(enable_prefix_cache=False, page_size=16, chunk_size=256),
    dict(enable_prefix_cache=False, overlap=True, page_size=1, chunk_size=64),
    dict(page_size=16, chunk_size=64),
    dict(page_size=16, chunk_size=64, overlap=True),
    dict(page_size=16, chunk_size=256, track_interval=64),
    dict(page_size=1, chunk_size=16, track_interval=16, cache_policy="every_chunk"),
    dict(page_size=1, chunk_size=16, overlap=True, max_batch_tokens=40),
    dict(page_size=16, chunk_size=16, overlap=True, track_interval=32, cache_policy="every_chunk"),
    dict(page_size=16, chunk_size=64, cache_policy="end", max_batch_tokens=100),
    # decode batches padded to the CUDA-graph buckets with sink rows (the GPU path, without capture)
    dict(page_size=16, chunk_size=32, overlap=True, enable_unified_memory=True, pad_decode_batches=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_greedy_matches_reference(model, workload, cfg):
    seq, conc, refs = workload
    engine = make_engine(model, **cfg)
    assert run_sequential(engine, seq) == [refs[tuple(p)] for p in seq]
    assert engine.generate(conc, GREEDY) == [refs[tuple(p)] for p in conc]
    check_idle(engine)
    m = engine.metrics()
    if engine.policy.enabled:
        assert m["cache_hit_tokens"] > 0, "the shared system prompt must be hit"
    else:
        assert m["cache_hit_tokens"] == 0 and m["checkpoints"] == 0
    assert m["prefill_tokens"] + m["cache_hit_tokens"] == m["prompt_tokens"]
    engine.close()


def test_sampling_is_reproducible_across_engine_configs(model):
    """Seeded sampling draws the same tokens with overlap/cache on or off (generator per request)."""
    rng = random.Random(3)
    prompts = [tokens(rng, n) for n in (20, 70, 130)]
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=10, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    outs = []
    for cfg in (dict(enable_prefix_cache=False), dict(overlap=True, chunk_size=64), dict(page_size=1, chunk_size=16)):
        engine = make_engine(model, **cfg)
        outs.append(engine.generate(prompts, params))
        engine.close()
    assert outs[0] == outs[1] == outs[2]
    assert len({tuple(o) for o in outs[0]}) == 3


def test_stop_conditions(model):
    rng = random.Random(5)
    prompt = tokens(rng, 40)
    ref = reference_generate(model, prompt, 8)
    engine = make_engine(model)
    # a stop token ends the request at its first occurrence (and is part of the output)
    stop = ref[3]
    first = ref.index(stop)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))[0]
    assert out == ref[: first + 1]
    # eos is a stop token unless ignore_eos
    engine2 = make_engine(model, chunk_size=64)
    engine2.eos_token_id = stop
    engine2.add_request("a", prompt, SamplingParams(max_new_tokens=8))
    engine2.add_request("b", prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    got = {}
    while engine2.has_unfinished():
        for o in engine2.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                got[o.rid + "_reason"] = o.finish_reason
    assert got["a"] == ref[: first + 1] and got["a_reason"] == "stop"
    assert got["b"] == ref and got["b_reason"] == "length"
    check_idle(engine2)


def test_tie_aware_comparison_only_forgives_a_runner_up_at_a_near_tie(model):
    """The GPU tests' tolerance for TF32 kernels (assert_greedy_equal_up_to_ties) must still fail on a
    real divergence: a different token where the reference was sure, or a token that was not the runner-up."""
    prompt = tokens(random.Random(3), 40)
    ref = reference_generate(model, prompt, GREEDY.max_new_tokens)
    margins, runner_up = reference_top2(model, prompt, ref)
    assert_greedy_equal_up_to_ties(model, [prompt], [ref], [ref], tie=0.0)  # identical: nothing to forgive
    j = min(range(len(ref)), key=lambda k: margins[k])  # the nearest tie: flip it to the runner-up
    flipped = ref[:j] + [runner_up[j]] + [(t + 1) % 256 for t in ref[j + 1:]]  # the rest may differ after a flip
    assert_greedy_equal_up_to_ties(model, [prompt], [flipped], [ref], tie=margins[j] * 1.01)
    with pytest.raises(AssertionError, match="apart"):  # the same flip with a tie margin below the gap
        assert_greedy_equal_up_to_ties(model, [prompt], [flipped], [ref], tie=margins[j] * 0.5)
    k = max(range(len(ref)), key=lambda k: margins[k])  # a sure choice: no tie margin this small forgives it
    with pytest.raises(AssertionError, match="apart"):
        assert_greedy_equal_up_to_ties(model, [prompt], [ref[:k] + [runner_up[k]] + ref[k + 1:]], [ref], tie=1e-2)
    wrong = next(t for t in range(256) if t not in (ref[j], runner_up[j]))
    with pytest.raises(AssertionError, match="apart"):  # not the runner-up, even at the near tie
        assert_greedy_equal_up_to_ties(model, [prompt], [ref[:j] + [wrong] + ref[j + 1:]], [ref], tie=1e3)
