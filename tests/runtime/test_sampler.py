"""The batched sampler against plain per-row references: penalties, logit bias, token bitmasks,
temperature / top-k / top-p logprobs, greedy, and a batch mixing all of them."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.runtime.penalties import apply_logit_bias, apply_penalties, apply_token_bitmask
from k3compile.runtime.sampler import sample_rows
from k3compile.runtime.sampling import SamplingParams

V = 50


def naive_penalties(row, p: SamplingParams, prompt, output):
    row = row.clone().double()
    for t in range(V):
        c = output.count(t)
        if p.repetition_penalty != 1.0 and (c or t in prompt):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        row[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    for t, b in p.logit_bias:
        row[t] += b
    return row


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(-2, 2), st.floats(-2, 2), st.sampled_from([1.0, 0.5, 1.3]),
                          st.lists(st.integers(0, V - 1), max_size=12), st.lists(st.integers(0, V - 1), max_size=6),
                          st.lists(st.tuples(st.integers(0, V - 1), st.floats(-100, 100)), max_size=3)),
                min_size=1, max_size=5), st.integers(0, 2**31))
def test_batched_penalties_and_bias_equal_per_row(rows, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), V, generator=g) * 3
    params = [SamplingParams(presence_penalty=pr, frequency_penalty=fr, repetition_penalty=rp, logit_bias=tuple(lb))
              for pr, fr, rp, _, _, lb in rows]
    outs = [r[3] for r in rows]
    prompts = [r[4] for r in rows]
    x = logits.clone()
    apply_penalties(x, params, prompts, outs)
    apply_logit_bias(x, params)
    for i, p in enumerate(params):
        torch.testing.assert_close(x[i].double(), naive_penalties(logits[i], p, prompts[i], outs[i]), atol=1e-4, rtol=1e-5)


def test_bitmask_masks_exactly_the_zero_bits():
    logits = torch.zeros(3, 70)
    allowed = [{0, 31, 32, 69}, set(range(70)), {5}]
    mask = torch.zeros(2, 3, dtype=torch.int64)
    for r, ids in enumerate([allowed[0], allowed[2]]):
        for t in ids:
            mask[r, t // 32] |= 1 << (t % 32)
    mask = torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)   # the packed int32 words llguidance fills
    apply_token_bitmask(logits, [0, 2], mask)
    for r in range(3):
        assert {t for t in range(70) if logits[r, t] == 0} == allowed[r]


def reference_logprobs(row, p: SamplingParams):
    x = row.double() / p.temperature
    if p.top_k:
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
    probs = x.softmax(-1)
    if p.top_p < 1:
        s, order = probs.sort(descending=True)
        drop = s.cumsum(-1) - s >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x.log_softmax(-1)


def test_mixed_batch_logprobs_are_of_the_distribution_sampled_from():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g) * 2
    params = [SamplingParams(logprobs=3), SamplingParams(temperature=0.7, top_k=5, logprobs=4, seed=1),
              SamplingParams(temperature=1.3, top_p=0.6, logprobs=2), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_k=10, top_p=0.8, logprobs=0, seed=3)]
    gens = [p.generator() for p in params]
    toks, lps = sample_rows(logits, params, gens)
    assert toks[0] == int(logits[0].argmax()) and lps[3] is None
    ref0 = logits[0].double().log_softmax(-1)
    assert abs(lps[0].logprob - float(ref0.max())) < 1e-5
    for i in (1, 2, 4):
        ref = reference_logprobs(logits[i], params[i])
        assert torch.isfinite(ref[toks[i]]), "sampled a token the truncation removed"
        assert abs(lps[i].logprob - float(ref[toks[i]])) < 1e-5
        k = params[i].logprobs
        assert [t for t, _ in lps[i].top] == ref.topk(k).indices.tolist() if k else lps[i].top == []
    # seeded rows are reproducible, whatever else is in the batch
    again, _ = sample_rows(logits[[1]], [params[1]], [params[1].generator()])
    assert again[0] == toks[1]


def test_sampling_follows_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    p = SamplingParams(temperature=0.8, top_k=3)
    counts = torch.zeros(5)
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        t, _ = sample_rows(logits, [p], [g])
        counts[t[0]] += 1
    want = reference_logprobs(logits[0], p).exp()
    assert (counts / counts.sum() - want.float()).abs().max() < 0.04
    assert counts[2] == 0 and counts[3] == 0   # outside the top 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_matches_cpu():
    """The same mixed batch sampled from CUDA logits: penalties, bias and masks on the device give the
    CPU's logprobs; seeded rows draw the same tokens (their draw runs on the CPU generator)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g) * 2
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((3, 5.0),), logprobs=3),
              SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, logprobs=2, seed=1),
              SamplingParams(temperature=1.1, top_p=0.7, logprobs=1, seed=2), SamplingParams(logprobs=0)]
    outs, prompts = [[1, 1, 2], [4], [], [7, 7]], [[5], [4, 6], [], []]
    mask = torch.zeros((1, 2), dtype=torch.int32)
    mask[0, 0] = 0b1010101   # row 3 may only take tokens 0, 2, 4, 6
    res = []
    for dev in ("cpu", "cuda"):
        res.append(sample_rows(logits.to(dev), params, [p.generator() for p in params], prompts=prompts,
                               outputs=outs, mask_rows=[3], bitmask=mask.to(dev)))
    (tc, lc), (tg, lg) = res
    assert tc == tg and tc[3] in (0, 2, 4, 6)
    for a, b in zip(lc, lg):
        assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_and_batch_upload_never_wait_for_the_device():
    """What overlap relies on: launching a sampling pass (greedy, temperature, top-k/top-p, logprobs) and
    uploading a scheduled batch queue work without a single stream synchronization (CUDA's sync debug mode
    raises on any); the ids then arrive through the event, equal to the CPU's for the greedy rows."""
    from k3compile.model_def.batch import ForwardBatch
    from k3compile.runtime.sampler import sample_rows_async
    from k3compile.runtime.scheduler import _upload

    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, V, generator=g) * 2).cuda()
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.2, top_k=4),
              SamplingParams(logprobs=3), SamplingParams(temperature=0.5, logprobs=2), SamplingParams()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        draw = sample_rows_async(logits, params, [None] * len(params))
        fb = ForwardBatch.build("prefill", [[1, 2, 3], [4]], [0, 5], [[1], [2]], [1, 2], 16)
        _upload(fb, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens, lps, bad = draw.result()
    cpu, _ = sample_rows(logits.cpu(), params, [None] * len(params))
    assert [tokens[i] for i in (0, 3, 5)] == [cpu[i] for i in (0, 3, 5)] and not any(bad)
    assert lps[3].token == tokens[3] and len(lps[3].top) == 3 and lps[4] is not None and lps[0] is None
    assert fb.input_ids.is_cuda and fb.input_ids.tolist() == [1, 2, 3, 4]
