"""The overlap scheduler and mixed prefill+decode batches change when things run, never what comes
out: greedy token streams are identical with overlap on/off and mixed batches on/off, through stop
tokens, aborts, retractions under tight memory and cache inserts. And with mixed batches, running
streams keep producing a token every step while a long prompt prefills."""
import random

import pytest

from k3compile.runtime.sampling import SamplingParams

from .engine_helpers import GREEDY, check_idle, make_engine, tokens

CONFIGS = [dict(overlap=o, mixed_batches=m) for o in (False, True) for m in (False, True)]


def drive(engine, items, abort_at=None):
    """Add (rid, prompt, params, arrival_step) items as their step comes; abort_at {rid: step}.
    Returns {rid: (tokens, finish_reason)} and the number of steps."""
    out, step, pending = {}, 0, sorted(items, key=lambda it: it[3])
    abort_at = dict(abort_at or {})
    while pending or engine.has_unfinished():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
            out[rid] = ([], None)
        for rid, at in list(abort_at.items()):
            if at == step:
                engine.abort(rid)
                del abort_at[rid]
        for o in engine.step():
            toks, _ = out[o.rid]
            toks.extend(o.new_token_ids)
            out[o.rid] = (toks, o.finish_reason if o.finished else None)
        step += 1
        assert step < 2000
    return out, step


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(11)
    shared = tokens(rng, 70)
    items = []
    for i, n in enumerate((3, 40, 70, 17, 5, 33)):
        prompt = (shared[: 20 + i] if i % 3 == 0 else []) + tokens(rng, n)
        items.append((f"r{i}", prompt, SamplingParams(max_new_tokens=5 + 2 * i, ignore_eos=True), i % 3))
    return items


def with_stops(items, first):
    """The same requests, each stopping at a token its unstopped run produces midway."""
    out = []
    for rid, prompt, params, at in items:
        toks = first[rid][0]
        stop = toks[len(toks) // 2]
        out.append((rid, prompt, SamplingParams(max_new_tokens=params.max_new_tokens, stop_token_ids=(stop,),
                                                ignore_eos=True), at))
    return out


def test_greedy_streams_identical_overlap_and_mixed(model, workload):
    base, _ = drive(make_engine(model, **CONFIGS[0], chunk_size=32, max_batch_tokens=48), workload)
    stopped = with_stops(workload, base)
    aborts = {"r2": 6, "r4": 3}
    ref_stop = ref_abort = None
    for cfg in CONFIGS:
        engine = make_engine(model, **cfg, chunk_size=32, max_batch_tokens=48)
        got, _ = drive(engine, workload)
        assert got == base, cfg
        got_stop, _ = drive(engine, stopped)
        for rid, (toks, reason) in got_stop.items():   # stops where the stop token first appears
            assert reason == ("stop" if len(toks) < len(base[rid][0]) or toks[-1] in
                              stopped[int(rid[1:])][2].stop_token_ids else "length")
            assert toks == base[rid][0][: len(toks)]
        ref_stop = ref_stop or got_stop
        assert got_stop == ref_stop, cfg
        check_idle(engine)
        engine.close()
        # aborts at fixed steps: step timing differs between configs, so only prefixes must agree
        engine = make_engine(model, **cfg, chunk_size=32, max_batch_tokens=48)
        got_abort, _ = drive(engine, workload, aborts)
        for rid, (toks, reason) in got_abort.items():
            assert toks == base[rid][0][: len(toks)], (cfg, rid)
            assert reason == ("abort" if rid in aborts and len(toks) < len(base[rid][0]) else reason)
        check_idle(engine)
        engine.close()


def test_identical_under_retractions(model, cfg=CONFIGS[3]):
    """Tight unified memory retracts requests (recomputed from their tokens): outputs unchanged."""
    tight = dict(enable_unified_memory=True, memory_bytes=200_000, max_running=4, page_size=16, chunk_size=32,
                 track_interval=32, decode_reserve_ratio=0.0)
    rng = random.Random(2)
    items = [(f"t{i}", tokens(rng, n), SamplingParams(max_new_tokens=40, ignore_eos=True), i // 2)
             for i, n in enumerate((20, 35, 12, 40, 28))]
    base, _ = drive(make_engine(model, overlap=False, mixed_batches=False, **tight), items)
    engine = make_engine(model, **cfg, **tight)
    got, _ = drive(engine, items)
    assert got == base
    assert engine.scheduler.retractions > 0, "the memory must be tight enough to retract"
    check_idle(engine)
    engine.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_running_streams_keep_producing_while_a_long_prompt_prefills(model, overlap):
    rng = random.Random(5)
    engine = make_engine(model, overlap=overlap, chunk_size=16, max_batch_tokens=20, page_size=16)
    long_params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"s{i}", tokens(rng, 8), SamplingParams(max_new_tokens=60, ignore_eos=True))
    got = {"s0": 0, "s1": 0}
    while got["s0"] < 2 or got["s1"] < 2:  # both streams are decoding
        for o in engine.step():
            got[o.rid] += len(o.new_token_ids)
    engine.add_request("long", tokens(rng, 200), long_params)
    prefill_steps, gaps = 0, []
    while True:
        outs = {o.rid: o for o in engine.step()}
        if "long" in outs:
            break
        prefill_steps += 1
        gaps.append(sum(1 for r in ("s0", "s1") if r not in outs))
    assert prefill_steps >= 200 // 18 - 1   # the prompt took many steps (16-token chunks, 2 budget tokens to decode)
    assert sum(gaps) <= 2, f"streams stalled in {sum(gaps)} of {prefill_steps} steps while the prompt prefilled"
    while engine.has_unfinished():
        engine.step()
    engine.close()


@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_forks_agree_with_overlap(model, mixed):
    """n > 1 forks the leader's working state when its first token is processed; with overlap the
    leader's next batch must not advance that state first (all greedy samples equal the leader's)."""
    engine = make_engine(model, overlap=True, mixed_batches=mixed, chunk_size=16)
    engine.add_request("other", tokens(random.Random(8), 20), SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()
    engine.add_request("lead", tokens(random.Random(9), 30), SamplingParams(max_new_tokens=6, ignore_eos=True),
                       fork_rids=("f1", "f2"))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    assert out["f1"] == out["f2"] == out["lead"] and len(out["lead"]) == 6
    check_idle(engine)
    engine.close()
