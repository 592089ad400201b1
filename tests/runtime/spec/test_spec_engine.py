"""Speculative decoding in the engine: greedy output is the non-speculative output token for token
(up to fp32 near-ties: the verify step's GEMM shapes differ from decode's), with prefix-cache hits +
KDA restore, overlap on, page_size 1 and 16, unified memory, both draft-window kinds; max_tokens and
stop tokens cut exactly where decoding cuts; streaming hands out every committed token once."""
import random

import pytest

from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams
from k3compile.runtime.spec.controlled import ControlledAcceptanceProposer
from k3compile.runtime.spec.ngram import NgramProposer
from tests.runtime.engine_helpers import assert_greedy_equal_up_to_ties, check_idle, reference_generate, tokens

TIE = 1e-4  # fp32: verify and decode logits differ by rounding only
NEW = 14


@pytest.fixture(scope="module")
def workload(model):
    rng = random.Random(3)
    system = tokens(rng, 40)
    prompts = [system + tokens(rng, 5), tokens(rng, 3), system + tokens(rng, 12), tokens(rng, 21)]
    refs = [reference_generate(model, p, NEW) for p in prompts]
    return prompts, refs


def _engine(model, proposer, **kw):
    kw.setdefault("memory_bytes", 1 << 22)
    return LLMEngine(EngineArgs(**kw), model=model, proposer=proposer)


CONFIGS = [
    dict(page_size=16, chunk_size=32),
    dict(page_size=1, chunk_size=16, overlap=True),
    # verify batches padded to (batch, tokens) buckets with sink rows: the CUDA-graph path, without capture
    dict(page_size=16, chunk_size=32, overlap=True, enable_unified_memory=True, pad_decode_batches=True),
    dict(page_size=4, chunk_size=16, spec_window="snapshot"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_greedy_output_equals_decoding(model, workload, cfg):
    prompts, refs = workload
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    oracle = ControlledAcceptanceProposer({tuple(p): r for p, r in zip(prompts, refs)}, p=0.8,
                                          vocab_size=model.config.vocab_size, gamma=3)
    engine = _engine(model, oracle, **cfg)
    got = engine.generate(prompts, params)  # concurrent
    got_seq = [engine.generate([p], params)[0] for p in prompts[:1] + prompts[2:3]]  # cache hits on `system`
    assert_greedy_equal_up_to_ties(model, prompts, got, refs, TIE)
    assert_greedy_equal_up_to_ties(model, [prompts[0], prompts[2]], got_seq, [refs[0], refs[2]], TIE)
    s = engine.spec.stats
    assert s.accepted > 0 and s.accept_length > 1.5, s  # speculation really happened
    assert engine.scheduler.cache_hit_tokens > 0
    check_idle(engine)


def test_ngram_proposer_in_the_engine(model, workload):
    prompts, refs = workload
    engine = _engine(model, NgramProposer(gamma=4), page_size=16, chunk_size=32)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert_greedy_equal_up_to_ties(model, prompts, got, refs, TIE)
    check_idle(engine)


def test_max_tokens_and_stop_tokens_cut_exactly(model, workload):
    prompts, refs = workload
    oracle = ControlledAcceptanceProposer({tuple(p): r for p, r in zip(prompts, refs)}, p=1.0,
                                          vocab_size=model.config.vocab_size, gamma=4)
    engine = _engine(model, oracle, page_size=16, chunk_size=32)
    for n in (1, 2, 5):  # all drafts right: a verify would overshoot max_new_tokens if not cut
        assert engine.generate([prompts[0]], SamplingParams(max_new_tokens=n, ignore_eos=True))[0] == refs[0][:n]
    stop = refs[1][6]
    cut = refs[1][: refs[1].index(stop) + 1]
    out = engine.generate([prompts[1]], SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop_token_ids=(stop,)))
    assert out[0] == cut
    check_idle(engine)


def test_streaming_emits_each_committed_token_once(model, workload):
    prompts, refs = workload
    oracle = ControlledAcceptanceProposer({tuple(prompts[3]): refs[3]}, p=1.0, vocab_size=model.config.vocab_size,
                                          gamma=4)
    engine = _engine(model, oracle, page_size=16, chunk_size=32)
    engine.add_request("r", prompts[3], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    chunks = []
    while engine.has_unfinished():
        chunks += [o.new_token_ids for o in engine.step() if o.rid == "r"]
    assert [t for c in chunks for t in c] == refs[3]
    assert max(len(c) for c in chunks) > 1  # several tokens committed by one step arrive together


def test_penalized_requests_do_not_speculate_and_still_run(model, workload):
    """Penalties change the distribution with every committed token: those rows verify their anchor alone
    (sampled rows without them speculate: test_spec_sampling.py)."""
    prompts, _ = workload
    engine = _engine(model, NgramProposer(gamma=3), page_size=16, chunk_size=32)
    out = engine.generate(prompts[:2], SamplingParams(max_new_tokens=6, temperature=0.8, seed=1, ignore_eos=True,
                                                      presence_penalty=0.5))
    assert [len(o) for o in out] == [6, 6] and engine.spec.stats.rows == 0


def test_forced_acceptance_lets_the_coin_decide(model, workload):
    """Benchmark mode (controlled.py, forced): p = 1 commits every draft even when the target disagrees
    (drafts here are never the target's: no references), p = 0 commits none, so the output is decoding's."""
    prompts, refs = workload
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    vocab = model.config.vocab_size
    all_in = _engine(model, ControlledAcceptanceProposer({}, p=1.0, vocab_size=vocab, gamma=3, forced=True),
                     page_size=16, chunk_size=32)
    out = all_in.generate(prompts[:2], params)
    s = all_in.spec.stats
    assert s.accepted == s.verified and s.accept_length > 3, s
    for o in out:  # a verify commits its 3 drafts: the anchor + 1 (mod V), 3 times, then the target's token
        assert len(o) == NEW and any(o[i + 1: i + 4] == [(o[i] + 1) % vocab] * 3 for i in range(NEW - 3)), o
    check_idle(all_in)
    none_in = _engine(model, ControlledAcceptanceProposer({}, p=0.0, vocab_size=vocab, gamma=3, forced=True),
                      page_size=16, chunk_size=32)
    got = none_in.generate(prompts, params)
    assert none_in.spec.stats.accepted == 0 and none_in.spec.stats.verified > 0
    assert_greedy_equal_up_to_ties(model, prompts, got, refs, TIE)
    check_idle(none_in)


def test_trim_planner_falls_back_to_decode_steps(model, workload, tmp_path):
    """A profile whose decode step beats every verify plan: the engine runs plain decode steps (no verify) and
    the output is decoding's."""
    from k3compile.runtime.spec.cost_profile import CostProfile
    batches, toks = [1, 2, 4, 8], [1, 2, 3, 4]
    prof = CostProfile("cpu", "k3-tiny", batches, toks, [[10.0 + t for t in toks] for _ in batches],
                       {"decode_ms": [1.0] * len(batches)})
    prof.save(str(tmp_path / "p.json"))
    prompts, refs = workload
    oracle = ControlledAcceptanceProposer({tuple(p): r for p, r in zip(prompts, refs)}, p=0.8,
                                          vocab_size=model.config.vocab_size, gamma=3)
    engine = _engine(model, oracle, page_size=16, chunk_size=32, spec_plan="trim", spec_profile=str(tmp_path / "p.json"))
    got = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert_greedy_equal_up_to_ties(model, prompts, got, refs, TIE)
    s = engine.spec.stats
    assert s.decode_steps >= NEW - 1 and s.verified == 0 and s.steps == 0, s
    check_idle(engine)
