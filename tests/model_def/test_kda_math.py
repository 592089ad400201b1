"""KDA reference math: chunked == recurrent == an independent naive oracle == transformers' fallback;
the gates against transformers' own forget gates; the k3:: decode / short-conv ops against the math.

The oracle follows fla's `naive_recurrent_kda` contract (spec §1.1, §1.4): it takes q and k already
L2-normalized (q also scaled by K^-1/2) and an already-activated log-decay g, and is written in the
explicit matrix form S_t = (I - β k k^T) Diag(α) S_{t-1} + β k v^T, o_t = S_t^T q, in float64.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from k3compile.model_def.ops import library  # noqa: F401  (registers torch.ops.k3.*)
from k3compile.model_def.ops.kda_math import kda_chunked, kda_gate, kda_recurrent, short_conv

H, K, V = 2, 8, 12
STATE_TOL = dict(atol=2e-5, rtol=1e-4)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def unit(x):
    """fla's l2norm: epsilon 1e-6 inside the square root."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def naive_kda(q, k, v, g, beta, s0):
    """Matrix-form oracle per head, float64. q, k pre-normalized; g is the log-decay [T, H, K]."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, s0))
    s = s.clone()
    T, nh, kd = k.shape
    eye = torch.eye(kd, dtype=torch.float64)
    out = torch.zeros(T, nh, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        for h in range(nh):
            kt = k[t, h].unsqueeze(1)  # column vector [K, 1]
            transition = (eye - beta[t, h] * kt @ kt.T) @ torch.diag(g[t, h].exp())
            s[h] = transition @ s[h] + beta[t, h] * kt @ v[t, h].unsqueeze(0)
            out[t, h] = s[h].T @ q[t, h]
    return out, s


def raw_inputs(T, seed, gate="softplus", heads=H):
    """Random raw q, k, v, forget-projection, beta, and a non-zero initial state."""
    g_ = gen(seed)
    q, k = torch.randn(T, heads, K, generator=g_), torch.randn(T, heads, K, generator=g_)
    v = torch.randn(T, heads, V, generator=g_)
    f = torch.randn(T, heads * K, generator=g_) * 2
    dt_bias = torch.randn(heads * K, generator=g_) * 0.5
    if gate == "softplus":  # A in [1, 16] as fla initializes it: strong decays on some channels
        a_log = torch.empty(heads).uniform_(1, 16, generator=g_).log()
        g = kda_gate(f, a_log, dt_bias, K, None)
    else:
        a_log = torch.randn(heads, generator=g_) * 0.3
        g = kda_gate(f, a_log, dt_bias, K, -5.0)
    beta = torch.rand(T, heads, generator=g_)
    s0 = torch.randn(heads, K, V, generator=g_) * 0.5
    return q, k, v, g, beta, s0


# ------------------------------------------------------------------------------- recurrence forms

@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_equals_naive_oracle(gate, form):
    q, k, v, g, beta, s0 = raw_inputs(21, 1, gate)
    if form == "recurrent":
        out, s1 = kda_recurrent(q, k, v, g, beta, s0)
    else:
        out, s1 = kda_chunked(q, k, v, g, beta, s0, chunk_size=8)
    ref_out, ref_s = naive_kda(unit(q) * K ** -0.5, unit(k), v, g, beta, s0)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1.double(), ref_s, atol=1e-5, rtol=1e-5)


def test_recurrent_does_not_modify_initial_state():
    q, k, v, g, beta, s0 = raw_inputs(5, 2)
    before = s0.clone()
    kda_recurrent(q, k, v, g, beta, s0)
    kda_chunked(q, k, v, g, beta, s0, chunk_size=4)
    assert torch.equal(s0, before)


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("T,chunk", [(37, 16), (37, 64), (70, 64), (70, 32), (9, 4), (16, 16), (1, 8)])
def test_chunked_equals_recurrent(gate, T, chunk):
    q, k, v, g, beta, s0 = raw_inputs(T, 10 + T + chunk, gate)
    out_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    out_c, s_c = kda_chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    assert out_c.shape == (T, H, V) and s_c.shape == (H, K, V)
    torch.testing.assert_close(out_c, out_r, **STATE_TOL)
    torch.testing.assert_close(s_c, s_r, **STATE_TOL)


def test_chunked_survives_extreme_decay():
    """Decays of e^-200 per step: ratios must be formed as exp(G_r - G_s), never Γ_r / Γ_s."""
    q, k, v, _, beta, s0 = raw_inputs(40, 3)
    g = -torch.rand(40, H, K, generator=gen(4)) * 200
    out_c, s_c = kda_chunked(q, k, v, g, beta, s0, chunk_size=16)
    out_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    assert torch.isfinite(out_c).all() and torch.isfinite(s_c).all()
    torch.testing.assert_close(out_c, out_r, **STATE_TOL)
    torch.testing.assert_close(s_c, s_r, **STATE_TOL)


@pytest.mark.parametrize("T", [37, 70])
def test_chunked_equals_transformers_fallback(T):
    """transformers' `chunk_kimi_delta_attention` pure-torch path (fla is not installed here)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    q, k, v, g, beta, s0 = raw_inputs(T, 5, "softplus")
    ours, s_ours = kda_chunked(q, k, v, g, beta, s0, chunk_size=64)
    theirs, s_theirs = chunk_kimi_delta_attention(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                                  initial_state=s0[None].clone(), output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs[0], **STATE_TOL)
    torch.testing.assert_close(s_ours, s_theirs[0], **STATE_TOL)


# ------------------------------------------------------------------------------------------ gates

def _gate_params(seed, heads=H):
    g_ = gen(seed)
    return (torch.randn(3, 5, 32, generator=g_), torch.randn(K, 32, generator=g_) * 0.3,
            torch.randn(heads * K, K, generator=g_) * 0.5, torch.randn(heads * K, generator=g_),
            torch.randn(heads, generator=g_))


def test_lower_bound_gate_equals_glm5_next_forget_gate():
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate

    x, fa, fb, dt_bias, a_log = _gate_params(6)
    cfg = SimpleNamespace(linear_head_dim=K, linear_num_heads=H, hidden_size=32, linear_lower_bound=-5.0)
    theirs = Glm5NextTextForgetGate(cfg)
    with torch.no_grad():
        for p, val in ((theirs.f_a_proj.weight, fa), (theirs.f_b_proj.weight, fb), (theirs.dt_bias, dt_bias),
                       (theirs.A_log, a_log)):
            p.copy_(val)
        ref = theirs(x)
    ours = kda_gate(x @ fa.T @ fb.T, a_log, dt_bias, K, -5.0)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    assert (ours >= -5).all() and (ours <= 0).all()  # open interval, closed by fp32 saturation
    # and the spec's formula, written out: g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))
    f = (x @ fa.T @ fb.T + dt_bias).unflatten(-1, (H, K))
    torch.testing.assert_close(ours, -5.0 * torch.sigmoid(a_log.exp()[:, None] * f), atol=1e-6, rtol=1e-6)


def test_softplus_gate_equals_kimi_linear_forget_gate():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate

    x, fa, fb, dt_bias, a_log = _gate_params(7)
    x[0, 0] *= 40  # push some pre-activations past softplus' linear threshold (20)
    cfg = SimpleNamespace(linear_head_dim=K, linear_num_heads=H, hidden_size=32)
    theirs = KimiLinearForgetGate(cfg)
    with torch.no_grad():
        theirs.f_a_proj.weight.copy_(fa)
        theirs.f_b_proj.weight.copy_(fb)
        theirs.dt_bias.copy_(dt_bias)
        theirs.A_log.copy_(a_log.view(1, 1, H, 1))
        ref = theirs(x)
    ours = kda_gate(x @ fa.T @ fb.T, a_log, dt_bias, K, None)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-6)
    assert (ours <= 0).all()


# ------------------------------------------------------------------------------ k3:: decode ops

def test_kda_decode_op_equals_recurrent_per_slot():
    """Vectorized decode over a batch of slots == kda_recurrent one token at a time, per request."""
    n_slots, n_layers, layer, T = 5, 2, 1, 4
    slots = torch.tensor([3, 0, 4])
    pool = torch.randn(n_slots, n_layers, H, K, V, generator=gen(8))
    untouched = pool.clone()
    states = {int(s): pool[s, layer].clone() for s in slots}
    for t in range(T):
        q, k, v, g, beta, _ = raw_inputs(len(slots), 100 + t, "lower_bound")  # one token per request
        out = torch.ops.k3.kda_decode(q, k, v, g, beta, pool, layer, slots)
        for b, s in enumerate(slots.tolist()):
            ref, states[s] = kda_recurrent(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1],
                                           states[s])
            torch.testing.assert_close(out[b], ref[0], **STATE_TOL)
            torch.testing.assert_close(pool[s, layer], states[s], **STATE_TOL)
    other = [s for s in range(n_slots) if s not in slots.tolist()]
    assert torch.equal(pool[other], untouched[other])
    assert torch.equal(pool[:, 0], untouched[:, 0])  # other layer of the hit slots too


def test_kda_prefill_op_equals_recurrent_ragged():
    """Ragged prefill: a fresh request ignores its slot's stale state; a continued one starts from it."""
    pool = torch.randn(4, 1, H, K, V, generator=gen(9))
    lens, prefixes, slots = [5, 70, 2], [0, 11, 3], torch.tensor([2, 0, 3])
    q, k, v, g, beta, _ = raw_inputs(sum(lens), 11, "softplus")
    cu = torch.tensor([0, 5, 75, 77], dtype=torch.int32)
    seq = torch.tensor([p + n for p, n in zip(prefixes, lens)], dtype=torch.int32)
    start = pool.clone()
    out = torch.ops.k3.kda_prefill(q, k, v, g, beta, pool, 0, slots, cu, seq)
    for i, s in enumerate(slots.tolist()):
        a, b = cu[i].item(), cu[i + 1].item()
        s0 = start[s, 0] if prefixes[i] else torch.zeros(H, K, V)
        ref, s1 = kda_recurrent(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s0)
        torch.testing.assert_close(out[a:b], ref, **STATE_TOL)
        torch.testing.assert_close(pool[s, 0], s1, **STATE_TOL)
    assert torch.equal(pool[1], start[1])


# --------------------------------------------------------------------------------------- short conv

def conv_oracle(x, weight, window):
    """Spec §1.1: y_t[c] = SiLU(Σ_j w[c, j] x_{t-W+1+j}[c]) with the window as the inputs before t=0."""
    full = torch.cat([window.t(), x], 0).double()
    W = weight.shape[1]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(W):
            y[t] += weight[:, j].double() * full[t + j]
    return F.silu(y)


def test_short_conv_equals_oracle_and_torch_conv1d():
    g_ = gen(12)
    x, w = torch.randn(9, 6, generator=g_), torch.randn(6, 4, generator=g_)
    window = torch.randn(6, 3, generator=g_)
    y, new_window = short_conv(x, w, window)
    torch.testing.assert_close(y.double(), conv_oracle(x, w, window), atol=1e-6, rtol=1e-6)
    assert torch.equal(new_window, x[-3:].t())
    # zero window == causal conv1d with left zero padding (what transformers' fallback does)
    y0, _ = short_conv(x, w, torch.zeros(6, 3))
    ref = F.silu(F.conv1d(x.t()[None], w[:, None], padding=3, groups=6)[0, :, :9].t())
    torch.testing.assert_close(y0, ref, atol=1e-6, rtol=1e-6)
    # a short chunk keeps part of the old window
    _, win2 = short_conv(x[:2], w, window)
    assert torch.equal(win2, torch.cat([window[:, 2:], x[:2].t()], 1))


def test_short_conv_decode_op_equals_short_conv():
    n_slots, n_layers, layer, c_total, offset, C, W = 4, 2, 1, 10, 3, 5, 4
    pool = torch.randn(n_slots, n_layers, c_total, W - 1, generator=gen(13))
    start = pool.clone()
    w = torch.randn(C, W, generator=gen(14))
    slots = torch.tensor([2, 0])
    windows = {s: pool[s, layer, offset:offset + C].clone() for s in slots.tolist()}
    for t in range(5):
        x = torch.randn(len(slots), C, generator=gen(20 + t))
        y = torch.ops.k3.short_conv_decode(x, w, pool, layer, offset, slots)
        for b, s in enumerate(slots.tolist()):
            ref, windows[s] = short_conv(x[b:b + 1], w, windows[s])
            torch.testing.assert_close(y[b], ref[0], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(pool[s, layer, offset:offset + C], windows[s])
    # channels outside [offset, offset + C), other layers and other slots are untouched
    mask = torch.ones_like(pool, dtype=torch.bool)
    mask[slots, layer, offset:offset + C] = False
    assert torch.equal(pool[mask], start[mask])


def test_short_conv_prefill_op_continues_windows():
    pool = torch.randn(3, 1, 8, 3, generator=gen(15))
    start = pool.clone()
    w = torch.randn(4, 4, generator=gen(16))
    x = torch.randn(7, 4, generator=gen(17))
    cu = torch.tensor([0, 2, 7], dtype=torch.int32)
    seq = torch.tensor([2, 9], dtype=torch.int32)  # request 0 fresh, request 1 continues a 4-token prefix
    slots = torch.tensor([1, 2])
    y = torch.ops.k3.short_conv_prefill(x, w, pool, 0, 4, slots, cu, seq)
    ref0, win0 = short_conv(x[:2], w, torch.zeros(4, 3))
    ref1, win1 = short_conv(x[2:], w, start[2, 0, 4:])
    torch.testing.assert_close(y, torch.cat([ref0, ref1]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool[1, 0, 4:], win0)
    torch.testing.assert_close(pool[2, 0, 4:], win1)
    assert torch.equal(pool[:, :, :4], start[:, :, :4]) and torch.equal(pool[0], start[0])
