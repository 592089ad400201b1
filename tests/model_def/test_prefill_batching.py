"""Prefill ops batch over requests: the packed/grouped ops equal the per-request reference math, and
the work they issue does not grow with the number of requests (no per-request loop, no host sync)."""
import torch
from torch.profiler import ProfilerActivity, profile

from k3compile.model_def.ops import attention_math, kda_math
from k3compile.model_def.ops.library import KDA_PREFILL_CHUNK


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# metadata-only ops (whether reshape is a view depends on strides, which depend on the batch's shape)
VIEWS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::as_strided",
         "aten::transpose", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::expand",
         "aten::t", "aten::unflatten", "aten::flatten", "aten::alias", "aten::detach", "aten::permute"}


def aten_ops(fn) -> dict[str, int]:
    """Top-level ATen calls that fn issues, views left out (what a device would launch; ops nested in them are
    ATen's own shape-dependent internals), by name, plus every host read of a tensor value."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out = {}
    for e in prof.events():
        nested = e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")
        if e.name.startswith("aten::") and e.name not in VIEWS and (not nested or e.name == "aten::_local_scalar_dense"):
            out[e.name] = out.get(e.name, 0) + 1
    return out


def cu_of(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


# ------------------------------------------------------------------------------------ short conv

def test_short_conv_prefill_matches_per_request_reference():
    C, W = 6, 4
    lens, prefixes = [1, 2, 7, 3, 1, 5], [0, 9, 0, 4, 1, 0]   # shorter than the window, fresh and continued
    slots = torch.tensor([5, 1, 3, 0, 2, 4])
    pool = torch.randn(6, 2, 10, W - 1, generator=gen(1))
    start = pool.clone()
    w = torch.randn(C, W, generator=gen(2))
    x = torch.randn(sum(lens), C, generator=gen(3))
    cu = cu_of(lens)
    seq = torch.tensor([p + n for p, n in zip(prefixes, lens)], dtype=torch.int32)
    y = torch.ops.k3.short_conv_prefill(x, w, pool, 1, 3, slots, cu, seq)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        win = start[slots[i], 1, 3:3 + C] if prefixes[i] else torch.zeros(C, W - 1)
        ref, new = kda_math.short_conv(x[s:e], w, win)
        assert rel_err(y[s:e], ref) < 1e-6
        torch.testing.assert_close(pool[slots[i], 1, 3:3 + C], new, rtol=0, atol=0)
    keep = torch.ones_like(pool, dtype=torch.bool)
    keep[slots, 1, 3:3 + C] = False
    assert torch.equal(pool[keep], start[keep])   # other layers and channels untouched


def test_short_conv_work_does_not_grow_with_requests():
    """Same op count for 1 request of 64 tokens and 64 requests of 1 token; no host read (.item / int())."""
    C, W = 8, 4
    w = torch.randn(C, W, generator=gen(4))

    def run(lens):
        b = len(lens)
        pool = torch.zeros(b, 1, C, W - 1)
        x = torch.randn(sum(lens), C, generator=gen(5))
        seq = torch.tensor(lens, dtype=torch.int32)
        return aten_ops(lambda: torch.ops.k3.short_conv_prefill(x, w, pool, 0, 0, torch.arange(b), cu_of(lens), seq))

    one, many = run([64]), run([1] * 64)
    assert one == many
    assert "aten::_local_scalar_dense" not in many and "aten::item" not in many


def test_a_steps_short_convs_share_one_layout():
    """Every short conv of a step (the q/k/v convs of each KDA layer) reads the same cu_seqlens / seq_lens: the
    index math is done by the first and reused (about half the op's host-dispatched ops: an eager prefill step is
    host-bound); results are those of the layout made afresh. A new batch, or the same tensors changed in place, get
    a new layout."""
    C, W = 6, 4
    lens, prefixes = [3, 1, 6], [0, 5, 2]
    slots = torch.tensor([2, 0, 1])
    w = torch.randn(C, W, generator=gen(8))
    x = torch.randn(sum(lens), C, generator=gen(9))
    cu, seq = cu_of(lens), torch.tensor([p + n for p, n in zip(prefixes, lens)], dtype=torch.int32)
    pool0 = torch.randn(3, 3, 2 * C, W - 1, generator=gen(10))

    def conv(pool, layer, off, cu_t, seq_t, xx=x):
        return torch.ops.k3.short_conv_prefill(xx, w, pool, layer, off, slots, cu_t, seq_t)

    fresh_pool = pool0.clone()   # each call with its own copies of cu / seq: a new layout every time
    want = [conv(fresh_pool, i % 3, (i % 2) * C, cu.clone(), seq.clone()) for i in range(4)]
    pool = pool0.clone()
    first = aten_ops(lambda: conv(pool, 0, 0, cu, seq))
    again = aten_ops(lambda: conv(pool, 1, C, cu, seq))
    assert sum(again.values()) <= sum(first.values()) - 15   # the layout's ops are not dispatched again
    got = [conv(pool, 2, 0, cu, seq), conv(pool, 0, C, cu, seq)]
    assert torch.equal(pool, fresh_pool)
    assert all(torch.equal(a, b) for a, b in zip(got, want[2:]))
    # in place: another batch of as many tokens in the same tensors (only the versions tell it apart)
    cu2, seq2 = cu_of([2, 4, 4]), torch.tensor([5, 9, 4], dtype=torch.int32)
    x2 = torch.randn(10, C, generator=gen(11))
    ref_pool = pool.clone()
    ref = conv(ref_pool, 1, 0, cu2.clone(), seq2.clone(), x2)
    conv(pool.clone(), 1, 0, cu, seq, x2)   # the layout of (cu, seq) as they are now is the cached one again
    cu.copy_(cu2)
    seq.copy_(seq2)
    assert torch.equal(conv(pool, 1, 0, cu, seq, x2), ref) and torch.equal(pool, ref_pool)


# ------------------------------------------------------------------------------------------- KDA

def _kda_inputs(n, H=2, K=8, V=8, seed=0):
    g = gen(seed)
    q, k = torch.randn(n, H, K, generator=g), torch.randn(n, H, K, generator=g)
    v = torch.randn(n, H, V, generator=g)
    gate = -torch.rand(n, H, K, generator=g) * 0.5
    beta = torch.rand(n, H, generator=g)
    return q, k, v, gate, beta


def test_kda_prefill_matches_per_request_reference():
    lens = [1, 70, 5, 64, 130, 3]           # one to three chunks: three batched groups
    prefixes = [0, 12, 3, 0, 0, 40]
    slots = torch.tensor([4, 0, 2, 5, 1, 3])
    q, k, v, g, beta = _kda_inputs(sum(lens))
    pool = torch.randn(6, 2, 2, 8, 8, generator=gen(7)) * 0.3
    start = pool.clone()
    cu = cu_of(lens)
    seq = torch.tensor([p + n for p, n in zip(prefixes, lens)], dtype=torch.int32)
    out = torch.ops.k3.kda_prefill(q, k, v, g, beta, pool, 1, slots, cu, seq)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        s0 = start[slots[i], 1] if prefixes[i] else torch.zeros(2, 8, 8)
        ref, s1 = kda_math.kda_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], s0, KDA_PREFILL_CHUNK)
        assert rel_err(out[s:e], ref) < 1e-5, i
        assert rel_err(pool[slots[i], 1], s1) < 1e-5, i
    assert torch.equal(pool[:, 0], start[:, 0])


def test_kda_prefill_work_does_not_grow_with_requests():
    """64 requests of 8 tokens (one chunk each) issue the ops of 1 request of 64 tokens (one chunk)."""
    def run(lens):
        b = len(lens)
        q, k, v, g, beta = _kda_inputs(sum(lens))
        pool = torch.zeros(b, 1, 2, 8, 8)
        seq = torch.tensor(lens, dtype=torch.int32)
        return aten_ops(lambda: torch.ops.k3.kda_prefill(q, k, v, g, beta, pool, 0, torch.arange(b), cu_of(lens), seq))

    assert run([64]) == run([8] * 64)


# ------------------------------------------------------------------------------------------- MLA

def _mla_case(lens, prefixes, page=4, seed=0):
    H, nope, rope, vd, r = 2, 8, 4, 6, 10
    g = gen(seed)
    w = torch.randn(H * (nope + vd), r, generator=g) * 0.3
    seq = [p + n for p, n in zip(prefixes, lens)]
    pages_each = [-(-s // page) for s in seq]
    width = max(pages_each) + 1
    kv = torch.randn(1 + sum(pages_each), 2, page, r + rope, generator=g)
    kv[0] = float("nan")   # the padding page: what a padded row reads must never reach an output
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    nxt = 1
    for i, n in enumerate(pages_each):
        table[i, :n] = torch.arange(nxt, nxt + n)
        nxt += n
    q = torch.randn(sum(lens), H, nope + rope, generator=g)
    return q, kv, w, table, seq, (r, nope)


def _mla_reference(q, kv, w, table, lens, seq, r, nope, scale):
    outs, s = [], 0
    for i, n in enumerate(lens):
        page = kv.shape[2]
        rows = kv[table[i, : -(-seq[i] // page)].long(), 1].flatten(0, 1)[: seq[i]]
        outs.append(attention_math.mla_expanded(q[s:s + n], rows, w, r, nope, scale, seq[i] - n))
        s += n
    return torch.cat(outs)


def test_mla_prefill_matches_per_request_reference():
    lens = [3, 1, 3, 5, 1, 3]               # three chunk lengths, contexts of different lengths in each
    prefixes = [0, 17, 9, 2, 0, 30]
    q, kv, w, table, seq, (r, nope) = _mla_case(lens, prefixes)
    cu = cu_of(lens)
    got = torch.ops.k3.mla_prefill(q, kv, 1, w, table, cu, torch.tensor(seq, dtype=torch.int32), 0.25, r, nope)
    ref = _mla_reference(q, kv, w, table, lens, seq, r, nope, 0.25)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-5
    sdpa = attention_math.mla_prefill_packed(q, kv[:, 1], w, table, cu.tolist(), seq, 0.25, r, nope,
                                             attend=attention_math.mla_expanded_sdpa_batch)
    assert rel_err(sdpa, ref) < 1e-5


def test_mla_prefill_attends_once_per_chunk_length(monkeypatch):
    """64 requests of equal length: one batched attention call; mixed lengths: one per distinct length, and a
    group split only where it would exceed the element budget."""
    calls = []

    def attend(q, *a):
        calls.append(q.shape[0])
        return attention_math.mla_expanded_batch(q, *a)

    def run(lens, prefixes):
        calls.clear()
        q, kv, w, table, seq, (r, nope) = _mla_case(lens, prefixes, seed=3)
        got = attention_math.mla_prefill_packed(q, kv[:, 1], w, table, cu_of(lens).tolist(), seq, 0.3, r, nope,
                                                attend=attend)
        assert rel_err(got, _mla_reference(q, kv, w, table, lens, seq, r, nope, 0.3)) < 1e-5
        return list(calls)

    assert run([4] * 64, [0] * 64) == [64]
    assert sorted(run([4, 1, 4, 1, 1, 6], [0, 8, 3, 2, 0, 1])) == [1, 2, 3]
    monkeypatch.setattr(attention_math, "MLA_GROUP_ELEMENTS", 1)   # every call holds one request
    assert run([4] * 5, [0, 3, 1, 2, 0]) == [1] * 5
