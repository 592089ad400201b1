"""Verify step + ReplaySSM commit (issue 13, item 4).

* op level: from the same per-token KDA inputs, kda_verify + the fold leaves a state torch.equal to
  k3::kda_decode run token by token (fp32 and bf16), for every accept length; the snapshot baseline
  too; conv windows equal to short_conv_decode's.
* model level: verify + commit of a prefix, then decoding on, gives the logits decoding alone gives
  (to fp32 rounding: verify's GEMMs have other shapes than decode's), and the verify logits match.
"""
import pytest
import torch

from k3compile.model_def.cache import CacheSpec, CacheTensors
from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec, commit_reference
from k3compile.model_def.loader import load_model
from k3compile.model_def.ops import kda_math
from tests.model_def.helpers import Sessions

H, K, L = 2, 16, 5
N_KDA, WIDTH = 2, 4


def _spec(dtype):
    return CacheSpec(n_kda=N_KDA, kda_heads=H, kda_head_k=K, kda_head_v=K, conv_channels=3 * H * K,
                     conv_window=WIDTH - 1, n_mla=1, kv_width=8, dtype=dtype)


def _inputs(b, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = (r(b, L, H, K).to(dtype) for _ in range(3))
    g = kda_math.kda_gate(r(b, L, H * K), torch.zeros(H), r(H * K), K, -5.0)
    beta = torch.sigmoid(r(b, L, H))
    x = r(b, L, 3 * H * K).to(dtype)
    return q, k, v, g, beta, x


def _cache(spec, b, seed):
    cache = CacheTensors.allocate(spec, b + 2, 1, 4)
    gen = torch.Generator().manual_seed(seed + 100)
    cache.ssm.copy_(torch.randn(cache.ssm.shape, generator=gen) * 0.3)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen).to(cache.conv.dtype))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["replay", "snapshot"])
def test_commit_is_bit_identical_to_decoding(dtype, kind):
    b = 4
    spec = _spec(dtype)
    q, k, v, g, beta, x = _inputs(b, dtype, 0)
    slots = torch.tensor([3, 1, 4, 2])  # not in batch order
    accept = [1, 5, 3, 0]
    dec = _cache(spec, b, 0)
    ver = _cache(spec, b, 0)
    w = torch.randn(3 * H * K, WIDTH)
    # decoding: token by token, each request only through its accepted positions
    for t in range(L):
        rows = [i for i in range(b) if accept[i] > t]
        if not rows:
            continue
        sl = slots[rows]
        for layer in range(N_KDA):
            torch.ops.k3.kda_decode(q[rows, t], k[rows, t], v[rows, t], g[rows, t], beta[rows, t], dec.ssm, layer, sl)
            torch.ops.k3.short_conv_decode(x[rows, t], w, dec.conv, layer, 0, sl)
    # verify all L positions (pools untouched), then commit
    window = DraftWindow.allocate(DraftWindowSpec(spec, L, kind), b)
    before = (ver.ssm.clone(), ver.conv.clone())
    flat = lambda t: t.flatten(0, 1)  # noqa: E731
    outs = []
    for layer in range(N_KDA):
        torch.ops.k3.short_conv_verify(flat(x), w, ver.conv, layer, 0, slots, window.x)
        if kind == "replay":
            o = torch.ops.k3.kda_verify(flat(q), flat(k), flat(v), flat(g), flat(beta), ver.ssm, layer, slots,
                                        window.k, window.v, window.g, window.beta)
        else:
            o = torch.ops.k3.kda_verify_snapshot(flat(q), flat(k), flat(v), flat(g), flat(beta), ver.ssm, layer,
                                                 slots, window.states)
        outs.append(o)
    assert torch.equal(ver.ssm, before[0]) and torch.equal(ver.conv, before[1]), "verify wrote the pools"
    commit_reference(ver, window, slots.tolist(), accept)
    assert torch.equal(ver.ssm, dec.ssm)
    assert torch.equal(ver.conv, dec.conv)


def test_verify_outputs_equal_decode_outputs():
    spec = _spec(torch.float32)
    q, k, v, g, beta, _ = _inputs(1, torch.float32, 1)
    dec, ver = _cache(spec, 1, 1), _cache(spec, 1, 1)
    slots = torch.tensor([1])
    want = torch.stack([torch.ops.k3.kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], dec.ssm, 0, slots)[0]
                        for t in range(L)])
    window = DraftWindow.allocate(DraftWindowSpec(spec, L), 1)
    got = torch.ops.k3.kda_verify(q[0], k[0], v[0], g[0], beta[0], ver.ssm, 0, slots, window.k, window.v, window.g,
                                  window.beta)
    assert torch.equal(got, want)


def test_window_bytes_match_the_spec_figures():
    # K3's KDA heads: K = V = 128, bf16 activations
    spec = CacheSpec(n_kda=1, kda_heads=1, kda_head_k=128, kda_head_v=128, conv_channels=3 * 128, conv_window=3,
                     n_mla=0, kv_width=576, dtype=torch.bfloat16)
    replay = DraftWindowSpec(spec, 8, "replay").bytes_per_position_per_head()
    snap = DraftWindowSpec(spec, 8, "snapshot").bytes_per_position_per_head()
    assert replay["state"] == 128 * 2 + 128 * 2 + 128 * 4 + 4  # ~1 KB per position per head
    assert snap["state"] == 128 * 128 * 4  # 64 KB
    assert DraftWindowSpec(spec, 8, "snapshot").bytes_per_request() > 20 * DraftWindowSpec(spec, 8).bytes_per_request()


@pytest.fixture(scope="module")
def tiny():
    return load_model("k3-tiny", seed=0)


@pytest.mark.parametrize("kind", ["replay", "snapshot"])
def test_model_verify_commit_then_decode_matches_decoding(tiny, kind):
    prompts = [[5, 9, 2, 7, 11, 3], [8, 1, 4]]
    drafts = [[21, 22, 23, 24], [31, 32, 33, 34]]
    accept = [3, 5]
    ref, spec_s = Sessions(tiny, 2, 32), Sessions(tiny, 2, 32)
    for s in (ref, spec_s):
        s.step("prefill", [0, 1], prompts)
    # reference: decode each request's accepted tokens one by one (logits kept), then one more step
    ref_logits = {0: [], 1: []}
    for t in range(max(accept)):
        reqs = [r for r in (0, 1) if accept[r] > t]
        out = ref.step("decode", reqs, [[drafts[r][t] if t < len(drafts[r]) else 40 + r] for r in reqs])
        for j, r in enumerate(reqs):
            ref_logits[r].append(out[j])
    # speculation: one verify of all 5 tokens per request, commit the accepted prefix
    toks = [d + [40 + r] for r, d in enumerate(drafts)]
    window = DraftWindow.allocate(DraftWindowSpec(tiny.cache_spec(), 5, kind), 2)
    from k3compile.model_def.batch import ForwardBatch
    batch = ForwardBatch.build(kind == "replay" and "verify" or "verify_snapshot", toks, spec_s.lens,
                               [spec_s.row(r) for r in (0, 1)], [1, 2], spec_s.page_size, logits="all")
    with torch.no_grad():
        logits = tiny.step(batch, spec_s.cache, window)
    commit_reference(spec_s.cache, window, [1, 2], accept)
    for r in (0, 1):
        got = logits[r * 5: r * 5 + accept[r]]
        torch.testing.assert_close(got, torch.stack(ref_logits[r]), rtol=1e-4, atol=1e-4)
        spec_s.lens[r] += accept[r]
    torch.testing.assert_close(spec_s.cache.ssm[1:3], ref.cache.ssm[1:3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(spec_s.cache.conv[1:3], ref.cache.conv[1:3], rtol=1e-5, atol=1e-5)
    nxt = [[50], [51]]
    torch.testing.assert_close(spec_s.step("decode", [0, 1], nxt), ref.step("decode", [0, 1], nxt),
                               rtol=1e-4, atol=1e-4)
