"""The step contract reproduces the full forward: prefill + decode, chunked prefill, ragged batches."""
import pytest
import torch

import k3compile
from tests.model_def.helpers import Sessions

PRESETS = ["k3-tiny", "kimi-linear-tiny"]
TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    return k3compile.load_model(request.param, seed=3)


def tokens(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_then_decode_matches_forward(model):
    ids = tokens(40, 1)
    full = model(torch.tensor([ids]))[0]
    s = Sessions(model, 1, 48)
    out = s.step("prefill", [0], [ids[:25]], logits="all")
    torch.testing.assert_close(out, full[:25], **TOL)
    for t in range(25, 40):
        out = s.step("decode", [0], [[ids[t]]])
        torch.testing.assert_close(out[0], full[t], **TOL)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_equals_one_shot(model, chunk):
    ids = tokens(53, 2)
    full = model(torch.tensor([ids]))[0]
    s = Sessions(model, 1, 64)
    outs = [s.step("prefill", [0], [ids[i:i + chunk]], logits="all") for i in range(0, len(ids), chunk)]
    torch.testing.assert_close(torch.cat(outs), full, **TOL)


def test_ragged_batched_decode_equals_each_alone(model):
    lens = [5, 17, 1, 33]
    prompts = [tokens(n, 10 + i) for i, n in enumerate(lens)]
    follow = [tokens(6, 20 + i) for i in range(len(lens))]
    together = Sessions(model, len(lens), 48)
    # ragged prefill of all four in one batch, then 6 batched decode steps
    first = together.step("prefill", [0, 1, 2, 3], prompts)
    steps = [together.step("decode", [0, 1, 2, 3], [[f[t]] for f in follow]) for t in range(6)]
    for r in range(len(lens)):
        alone = Sessions(model, 1, 48)
        torch.testing.assert_close(alone.step("prefill", [0], [prompts[r]])[0], first[r], **TOL)
        for t in range(6):
            torch.testing.assert_close(alone.step("decode", [0], [[follow[r][t]]])[0], steps[t][r], **TOL)


def test_mixed_prefix_prefill_batch(model):
    """One prefill batch where one request continues a cached prefix and another starts fresh."""
    a, b = tokens(30, 5), tokens(12, 6)
    s = Sessions(model, 2, 48)
    s.step("prefill", [0], [a[:20]])
    out = s.step("prefill", [0, 1], [a[20:], b], logits="all")
    torch.testing.assert_close(out[:10], model(torch.tensor([a]))[0, 20:], **TOL)
    torch.testing.assert_close(out[10:], model(torch.tensor([b]))[0], **TOL)


def test_fresh_request_ignores_stale_slot_contents(model):
    """A request with no prefix must start from zero state even if its slot holds an old request's state."""
    s = Sessions(model, 1, 48)
    s.step("prefill", [0], [tokens(20, 7)])
    s.lens[0] = 0  # reuse slot and pages for a new request without clearing them
    ids = tokens(9, 8)
    torch.testing.assert_close(s.step("prefill", [0], [ids], logits="all"), model(torch.tensor([ids]))[0], **TOL)
