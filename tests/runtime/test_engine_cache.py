"""The engine's prefix-cache paths with the real model: restore from a checkpoint, plant a checkpoint
at a branch point in the middle of a cached edge and restore from it, multi-turn reuse of decode
snapshots. Each test asserts that the path was taken (cached tokens, tree shape), that outputs equal
the reference, and -- the silent-failure guard (SGLang #31474) -- that every checkpoint holds the
state recomputed from its prefix and that a corrupted checkpoint does change the outputs."""
import random
import weakref

import pytest
import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.runtime.sampling import SamplingParams

from .engine_helpers import GREEDY, check_idle, make_engine, one_request_cache, reference_generate, tokens


def generate_one(engine, rid, prompt, params=GREEDY):
    """(output ids, cached_tokens) of one request run to completion."""
    engine.add_request(rid, prompt, params)
    out, cached = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.rid == rid:
                out.extend(o.new_token_ids)
                cached = o.cached_tokens
    return out, cached


_RECOMPUTED = weakref.WeakKeyDictionary()  # model -> {prefix: (ssm, conv)}: the configs share prompts and depths


def recomputed_state(model, prefix: list[int]):
    """KDA state after `prefix`, prefilled from scratch in one chunk into a fresh slot (once per model and
    prefix; callers only read it)."""
    memo = _RECOMPUTED.setdefault(model, {})
    if tuple(prefix) not in memo:
        memo[tuple(prefix)] = _recompute_state(model, prefix)
    return memo[tuple(prefix)]


@torch.no_grad()
def _recompute_state(model, prefix: list[int]):
    cache, table, page, dev = one_request_cache(model, len(prefix))
    model.step(ForwardBatch.build("prefill", [prefix], [0], [table], [1], page, device=dev), cache)
    return cache.ssm[1].clone(), cache.conv[1].clone()


def assert_checkpoints_hold_their_prefix_state(engine, model, rel_tol: float = 1e-5) -> int:
    """Every checkpoint's ssm and conv equal the state recomputed from its node's prefix, to fp32
    rounding relative to the tensor's scale (1e-5 on CPU): the chunk boundaries differ, so not bit-exact."""
    tensors, n = engine.memory.tensors, 0
    for node in engine.cache.nodes():
        if node.checkpoint is None:
            continue
        ssm, conv = recomputed_state(model, list(engine.cache.path_tokens(node)))
        for name, got, want in (("ssm", tensors.ssm[node.checkpoint], ssm), ("conv", tensors.conv[node.checkpoint], conv)):
            err, scale = (got - want).abs().max().item(), want.abs().max().item()
            assert err <= rel_tol * max(scale, 1e-3), (f"checkpoint at depth {node.depth}: {name} differs from the "
                                                    f"recomputed state (max |diff| {err:.3g}, max |value| {scale:.3g})")
        n += 1
    return n


def checkpoint_depths(engine) -> set[int]:
    return {nd.depth for nd in engine.cache.nodes() if nd.checkpoint is not None}


BRANCH_CONFIGS = [dict(page_size=16, chunk_size=64), dict(page_size=16, chunk_size=256, overlap=True),
                  dict(page_size=1, chunk_size=16, overlap=True, enable_unified_memory=True)]


@pytest.mark.parametrize("cfg", BRANCH_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_restore_and_branch_point(model, cfg):
    rng = random.Random(11)
    shared = tokens(rng, 130)
    a = shared + tokens(rng, 150)  # its checkpoints land at the prompt's tail (and end): one path, no fork state
    b, c, d = (shared + tokens(rng, 20 + 7 * i) for i in range(3))  # fork after 130 shared tokens
    engine = make_engine(model, **cfg)

    out_a, cached_a = generate_one(engine, "a", a)
    assert cached_a == 0 and out_a == reference_generate(model, a, GREEDY.max_new_tokens)
    g = engine.scheduler.cfg.checkpoint_interval
    # the prompt tail (last boundary before the last token) and, when the prompt ends on the grid,
    # the end-of-request state (the newest snapshot, donated at the finish)
    assert checkpoint_depths(engine) == {(len(a) - 1) // g * g} | ({len(a)} if len(a) % g == 0 else set())

    # b forks in the middle of the cached edge: KV matches the shared pages but no state is saved
    # there; it replays from the root, ends a chunk at the branch point, snapshots and donates there.
    fork = len(shared) // cfg["page_size"] * cfg["page_size"] // g * g
    out_b, cached_b = generate_one(engine, "b", b)
    assert cached_b == 0 and out_b == reference_generate(model, b, GREEDY.max_new_tokens)
    assert fork in checkpoint_depths(engine)

    # c (and d) fork at the same place and now restore directly from the branch checkpoint.
    for rid, p in (("c", c), ("d", d)):
        out, cached = generate_one(engine, rid, p)
        assert cached == fork, f"{rid} should restore from the branch-point checkpoint"
        assert out == reference_generate(model, p, GREEDY.max_new_tokens)
    check_idle(engine)
    assert assert_checkpoints_hold_their_prefix_state(engine, model) >= 2
    engine.close()


def test_restore_from_checkpoint_reads_the_checkpoint(model):
    """Negative control: corrupt the checkpoint a request will restore from and its output changes
    (so the parity above really depends on the restored state, not on recomputation)."""
    rng = random.Random(12)
    system = tokens(rng, 208)  # ends on a page boundary, where first's prompt-end checkpoint lands
    first, second = system + tokens(rng, 9), system + tokens(rng, 25)
    ref = reference_generate(model, second, GREEDY.max_new_tokens)

    for corrupt in (False, True):
        engine = make_engine(model, chunk_size=64)
        generate_one(engine, "first", first)
        depth = len(first) // 16 * 16  # first's prompt-end checkpoint
        node = next(nd for nd in engine.cache.nodes() if nd.depth == depth and nd.checkpoint is not None)
        if corrupt:
            engine.memory.tensors.ssm[node.checkpoint].mul_(-1.0)
        out, cached = generate_one(engine, "second", second)
        assert cached == depth
        assert (out == ref) is (not corrupt)
        if corrupt:
            with pytest.raises(AssertionError, match=f"depth {depth}"):
                assert_checkpoints_hold_their_prefix_state(engine, model)
        engine.close()


@pytest.mark.parametrize("policy", ["sparse", "every_chunk", "end"])
def test_multi_turn_reuses_decode_snapshots(model, policy):
    """Turn 2 = turn 1's prompt + answer + a new message: it restores from a state taken during
    turn 1's decode (track_interval 16), deeper than turn 1's prompt."""
    rng = random.Random(13)
    turn1 = tokens(rng, 40)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    engine = make_engine(model, page_size=16, chunk_size=16, track_interval=16, cache_policy=policy, overlap=True)
    ans1, _ = generate_one(engine, "t1", turn1, params)
    turn2 = turn1 + ans1 + tokens(rng, 10)
    ans2, cached = generate_one(engine, "t2", turn2, params)
    assert cached == (len(turn1) + len(ans1) - 1) // 16 * 16 == 64
    assert ans2 == reference_generate(model, turn2, params.max_new_tokens)
    check_idle(engine)
    assert_checkpoints_hold_their_prefix_state(engine, model)
    engine.close()


def test_every_checkpoint_matches_recomputation_after_mixed_workload(model):
    """Sessions with a shared system prompt, forks and concurrent ragged requests under the dense
    policy (most checkpoints) with overlap and unified memory; then the state integrity check."""
    rng = random.Random(14)
    system = tokens(rng, 90)
    engine = make_engine(model, page_size=16, chunk_size=32, track_interval=32, cache_policy="every_chunk",
                         overlap=True, enable_unified_memory=True, max_batch_tokens=96)
    first = [system + tokens(rng, n) for n in (5, 40, 77)] + [tokens(rng, 50)]
    outs = engine.generate(first, SamplingParams(max_new_tokens=20, ignore_eos=True))
    follow = [p + o + tokens(rng, 12) for p, o in zip(first, outs)] + [system[:40] + tokens(rng, 30)]
    engine.generate(follow, SamplingParams(max_new_tokens=8, ignore_eos=True))
    check_idle(engine)
    assert engine.metrics()["cache_hit_tokens"] > 0
    assert assert_checkpoints_hold_their_prefix_state(engine, model) >= 8
    engine.close()


HIT_CONFIGS = [dict(page_size=16), dict(page_size=1), dict(page_size=16, overlap=True)]  # engine's default chunk (256)


@pytest.mark.parametrize("policy", ["sparse", "valued"])
@pytest.mark.parametrize("cfg", HIT_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("length", [64, 77])
def test_exact_repeat_hits(model, cfg, policy, length):
    """A prompt sent twice: the second run restores from the state at the prompt's last checkpoint
    boundary before its last token (issue 15: it missed when the length was a multiple of the grid,
    and always at page size 1, because the checkpoint sat at the prompt's end, which matching of
    prompt[:-1] can never reach)."""
    prompt = tokens(random.Random(21 + length), length)
    engine = make_engine(model, cache_policy=policy, **cfg)
    first, cached_first = generate_one(engine, "a", prompt)
    again, cached_again = generate_one(engine, "b", prompt)
    g = engine.scheduler.cfg.checkpoint_interval
    assert cached_first == 0
    assert cached_again == (length - 1) // g * g > 0
    assert again == first == reference_generate(model, prompt, GREEDY.max_new_tokens)
    check_idle(engine)
    assert_checkpoints_hold_their_prefix_state(engine, model)
    engine.close()


@pytest.mark.parametrize("policy", ["sparse", "valued"])
@pytest.mark.parametrize("cfg", HIT_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_shared_stem_branch_point_survives_the_per_path_cap(model, cfg, policy):
    """Five requests, one after the other, over a shared 64-token stem: the second plants the branch
    point, every later one restores from it (issue 15: the per-path cap of 2 rejected it, or evicted
    it for the request's own later checkpoints, so all five hit 0)."""
    rng = random.Random(22)
    stem = tokens(rng, 64)
    # each request leaves two checkpoints on its own path: its prompt tail and the decode track
    # point at 256 (its 12 answer tokens cross it), so a third one on the path exceeds the cap
    prompts = [stem + tokens(rng, 186 + 3 * i) for i in range(5)]
    engine = make_engine(model, cache_policy=policy, **cfg)
    assert engine.policy.max_checkpoints_per_path == 2
    cached = []
    for i, p in enumerate(prompts):
        out, hit = generate_one(engine, f"r{i}", p)
        assert out == reference_generate(model, p, GREEDY.max_new_tokens)
        cached.append(hit)
    assert cached == [0, 0, 64, 64, 64]
    check_idle(engine)
    assert_checkpoints_hold_their_prefix_state(engine, model)
    engine.close()


def test_kv_only_leaves_and_recency_kv_eviction_keep_outputs(model):
    """`valued` with leaves that keep their KV after their state decays (`decay_kv`, ages of one lookup so that
    decays happen) and KV pressure by recency (`kv_weight=0`), on a budget that evicts: siblings over a shared stem
    and unrelated one-offs. Outputs equal the reference, KV-only leaves were there, the accounting and every
    checkpoint's state hold (issue 15, session 13: no correctness change)."""
    from k3compile.bench.cache import parse_policy

    policy = parse_policy("valued:decay_kv=1,kv_weight=0,ttl=1,max_age=1,short_ttl=1,short_max_age=1,stale=2,"
                          "short_stale=2")
    rng = random.Random(23)
    stem = tokens(rng, 64)
    prompts = [p for i in range(4) for p in (stem + tokens(rng, 40 + 7 * i), tokens(rng, 30 + i))]
    engine = make_engine(model, cache_policy=policy, page_size=16, chunk_size=32, track_interval=32,
                         memory_bytes=300_000, state_fraction=0.5)
    kv_only = 0
    for i, prompt in enumerate(prompts):
        out, _ = generate_one(engine, f"r{i}", prompt)
        assert out == reference_generate(model, prompt, GREEDY.max_new_tokens)
        kv_only += sum(1 for nd in engine.cache.nodes() if nd.kv_only and nd.is_leaf)
        check_idle(engine)
    assert kv_only > 0 and engine.metrics()["cache_hit_tokens"] > 0
    assert engine.cache.stats().pages_evicted > 0
    assert_checkpoints_hold_their_prefix_state(engine, model)
    engine.close()
