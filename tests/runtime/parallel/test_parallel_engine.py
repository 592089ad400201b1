"""LLMEngine on the ranks of a parallel model (one process per rank, gloo): greedy tokens identical to the
single-process engine, through chunked prefill (prompts longer than a chunk), a prefix-cache hit,
mixed batches, and both memory layouts (the unified arena's compaction moves replayed on every rank)."""
import pytest

from k3compile.runtime.engine import EngineArgs, LLMEngine
from k3compile.runtime.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 41, 9, 300, 11, 12, 13, 77, 2, 19, 400, 6, 6, 1], [260, 4, 33, 12, 90]]
AGAIN = [PROMPTS[0][:16] + [55, 56, 57]]  # shares 16 tokens (two checkpoint intervals) with the first prompt
PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True)
# small pages and chunks: the 20-token prompt prefills in three chunks, the cache checkpoints every 8 tokens
KW = dict(memory_bytes=8 << 20, page_size=4, chunk_size=8, track_interval=8, rank_timeout_s=60)


def run(args):
    engine = LLMEngine(args)
    try:
        first = engine.generate(PROMPTS, PARAMS)
        again = engine.generate(AGAIN, PARAMS)
        return first, again, engine.metrics()["cache_hit_tokens"], forked(engine)
    finally:
        engine.close()


def forked(engine):
    """n = 2: the follower continues from a copy of the leader's state slot and its own KV page (the prompt's
    partial last page), both replayed on every rank. (On k3-tiny that page barely moves the logits: the
    replay of page copies is pinned down by test_rank_pages.)"""
    params = PARAMS
    engine.add_request("lead", PROMPTS[1] + [9] * 6, params, fork_rids=("follow",))  # 11: a partial own page
    out = {"lead": [], "follow": []}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.rid].extend(o.new_token_ids)
    return out


@pytest.fixture(scope="module")
def reference():
    return run(EngineArgs(model="k3-tiny", **KW))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("topology,unified", [("tp2", False), ("dcp2", True)])
def test_greedy_tokens_match_single_process(reference, topology, unified):
    ref_first, ref_again, ref_hits, ref_forked = reference
    first, again, hits, fork = run(EngineArgs(model="k3-tiny", topology=topology, enable_unified_memory=unified, **KW))
    assert first == ref_first and again == ref_again and fork == ref_forked
    assert hits == ref_hits == 16


@pytest.mark.timeout(300)
def test_tp2_dcp2_of_a_four_head_checkpoint(tmp_path):
    from k3compile.model_def.checkpoint import save_checkpoint
    from tests.model_def.parallel.helpers import whole_model, wide_config

    path = str(tmp_path / "k3-tiny-4heads")
    save_checkpoint(whole_model(wide_config("k3-tiny", heads=4)), path)
    kw = dict(KW, page_size=4)  # under DCP2 a page of 4 tokens is 2 rows on each rank
    want = run(EngineArgs(model=path, **kw))
    assert run(EngineArgs(model=path, topology="tp2-dcp2", **kw)) == want


def test_bad_parallel_settings_are_clear_errors():
    with pytest.raises(ValueError, match="speculative decoding is not supported on a parallel engine"):
        LLMEngine(EngineArgs(model="k3-tiny", topology="tp2", speculative="ngram", **KW))
    with pytest.raises(ValueError, match="2 KDA heads are not divisible by 4 ranks"):
        LLMEngine(EngineArgs(model="k3-tiny", topology="tp4", **KW))
