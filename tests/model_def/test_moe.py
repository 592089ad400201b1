"""MoE reference math: SiTU-GLU (spec §4.3), routing vs transformers' KimiLinearTopkRouter (§2.4),
the two expert-compute forms, and the Stable LatentMoE block (§4.2) written out from its parameters."""
import pytest
import torch
import torch.nn.functional as F

import k3compile
from k3compile.model_def.ops.moe_math import glu_act, moe_experts_gather, moe_experts_loop, route


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------ SiTU

def situ_glu_oracle(g, u, beta, beta_lin):
    g, u = g.double(), u.double()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * beta_lin * torch.tanh(u / beta_lin)


def test_situ_glu_formula():
    g, u = torch.randn(64, 16, generator=gen(0)) * 6, torch.randn(64, 16, generator=gen(1)) * 30
    out = glu_act(g, u, "situ", 4.0, 25.0)
    assert out.dtype == g.dtype
    torch.testing.assert_close(out.double(), situ_glu_oracle(g, u, 4.0, 25.0), atol=1e-5, rtol=1e-5)


def test_situ_glu_caps_at_beta_times_linear_beta():
    g, u = torch.randn(4096, generator=gen(2)) * 1e3, torch.randn(4096, generator=gen(3)) * 1e3
    out = glu_act(g, u, "situ", 4.0, 25.0)
    assert torch.isfinite(out).all()
    assert out.abs().max() <= 4.0 * 25.0  # < β·β' mathematically; fp32 tanh/sigmoid saturate to equality
    assert out.abs().max() > 90  # the cap is approached, so the bound above is a real check


def test_situ_tends_to_silu_for_large_beta():
    g, u = torch.randn(256, generator=gen(4)), torch.randn(256, generator=gen(5))
    torch.testing.assert_close(glu_act(g, u, "situ", 1e4, 1e4), F.silu(g) * u, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(glu_act(g, u, "silu", 4.0, 25.0), F.silu(g) * u)


def test_glu_act_rejects_unknown_activation():
    with pytest.raises(ValueError, match="gelu"):
        glu_act(torch.zeros(2), torch.zeros(2), "gelu", 4.0, 25.0)


# --------------------------------------------------------------------------------- expert compute

@pytest.mark.parametrize("act", ["silu", "situ"])
def test_moe_experts_gather_equals_loop(act):
    n, d, e, inter, k = 13, 12, 6, 8, 3
    g_ = gen(6)
    x = torch.randn(n, d, generator=g_)
    w13, w2 = torch.randn(e, 2 * inter, d, generator=g_), torch.randn(e, d, inter, generator=g_)
    ids = torch.stack([torch.randperm(e, generator=g_)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g_)
    loop = moe_experts_loop(x, ids, weights, w13, w2, act, 4.0, 25.0)
    torch.testing.assert_close(moe_experts_gather(x, ids, weights, w13, w2, act, 4.0, 25.0), loop,
                               atol=1e-4, rtol=1e-5)
    # and both equal the per-(token, choice) sum written out
    ref = torch.zeros(n, d, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            h = w13[ids[t, j]].double() @ x[t].double()
            gate, up = h[:inter], h[inter:]
            a = F.silu(gate) * up if act == "silu" else situ_glu_oracle(gate, up, 4.0, 25.0)
            ref[t] += weights[t, j].double() * (w2[ids[t, j]].double() @ a)
    torch.testing.assert_close(loop.double(), ref, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------------- routing

def _hf_router(e, top_k, groups, topk_group, renorm, scaling, d=16):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    cfg = KimiLinearConfig(hidden_size=d, num_experts=e, num_experts_per_token=top_k, num_expert_group=groups,
                           topk_group=topk_group, moe_renormalize=renorm, routed_scaling_factor=scaling)
    router = KimiLinearTopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 1, generator=gen(e + top_k))
        router.e_score_correction_bias.normal_(0, 0.3, generator=gen(groups + 100))
    return router


@pytest.mark.parametrize("e,top_k,groups,topk_group,renorm,scaling", [
    (8, 2, 1, 1, True, 2.446),
    (8, 1, 1, 1, True, 1.0),  # top-1: transformers still renormalizes (weight = scaling)
    (16, 4, 4, 2, True, 1.0),  # group limiting: 2 of 4 groups
    (16, 3, 8, 3, False, 2.5),
    (12, 2, 3, 1, True, 1.0),  # one group kept: both picks come from the best group
    (16, 6, 4, 4, True, 1.0),  # all groups kept == no limiting
])
def test_route_equals_transformers_router(e, top_k, groups, topk_group, renorm, scaling):
    router = _hf_router(e, top_k, groups, topk_group, renorm, scaling)
    x = torch.randn(40, 16, generator=gen(7))
    with torch.no_grad():
        _, w_ref, ids_ref = router(x)
    logits = x @ router.weight.T
    w, ids = route(logits, router.e_score_correction_bias, top_k, renorm, scaling, groups, topk_group)
    # transformers' top-k is unsorted: compare as {expert: weight} per token
    order_ref, order = ids_ref.sort(-1), ids.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))


def test_group_limiting_keeps_only_the_best_groups():
    """Independent check of the rule: groups ranked by the sum of their top-2 biased scores."""
    e, groups, topk_group, top_k = 16, 4, 2, 4
    logits = torch.randn(50, e, generator=gen(8)) * 2
    bias = torch.randn(e, generator=gen(9)) * 0.2
    _, ids = route(logits, bias, top_k, True, 1.0, groups, topk_group)
    biased = (logits.sigmoid() + bias).view(50, groups, -1)
    for t in range(50):
        rank = sorted(range(groups), key=lambda j: -biased[t, j].topk(2).values.sum().item())
        allowed = {j * (e // groups) + i for j in rank[:topk_group] for i in range(e // groups)}
        assert set(ids[t].tolist()) <= allowed
        best = sorted(allowed, key=lambda i: -biased.view(50, e)[t, i].item())[:top_k]
        assert set(ids[t].tolist()) == set(best)


def test_route_selects_on_biased_but_weighs_unbiased():
    logits = torch.tensor([[3.0, 0.0, -1.0, 1.0]])
    bias = torch.tensor([-10.0, 0.0, 10.0, 0.0])  # bias demotes expert 0 and promotes expert 2
    w, ids = route(logits, bias, 2, False, 1.0)
    assert sorted(ids[0].tolist()) == [2, 3]  # biased: [-9.05, 0.5, 10.27, 0.73]; unbiased would pick 0, 3
    torch.testing.assert_close(w[0], logits[0, ids[0]].sigmoid())


# ------------------------------------------------------------------------------- Stable LatentMoE

@pytest.fixture(scope="module")
def k3_tiny():
    return k3compile.load_model("k3-tiny", seed=11)


def test_latent_moe_equals_explicit_computation(k3_tiny):
    """Route on full-width x; z = down(x); u = Σ π_e E_e(z); y = up(RMSNorm(u)) + shared(x) (spec §4.2)."""
    cfg = k3_tiny.config
    moe = k3_tiny.model.layers[1].block_sparse_moe
    x = torch.randn(10, cfg.hidden_size, generator=gen(12))
    with torch.no_grad():
        ours = moe(x).double()
    P = {n: p.detach().double() for n, p in moe.named_parameters()}
    bias = moe.gate.e_score_correction_bias.double()
    inter, beta, beta_lin = cfg.moe_intermediate_size, cfg.situ_beta, cfg.situ_linear_beta

    def glu(gate_w, up_w, down_w, v):
        return down_w @ situ_glu_oracle(gate_w @ v, up_w @ v, beta, beta_lin)

    xd = x.double()
    for t in range(x.shape[0]):
        scores = torch.sigmoid(P["gate.weight"] @ xd[t])
        chosen = (scores + bias).topk(cfg.num_experts_per_token).indices
        pi = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
        z = P["routed_expert_down_proj.weight"] @ xd[t]
        assert z.shape == (cfg.latent_size,)
        u = torch.zeros(cfg.latent_size, dtype=torch.float64)
        for p_e, e in zip(pi, chosen.tolist()):
            w13, w2 = P["experts.w13"][e], P["experts.w2"][e]
            u += p_e * glu(w13[:inter], w13[inter:], w2, z)
        u_hat = u / torch.sqrt(u.pow(2).mean() + cfg.rms_norm_eps) * P["routed_expert_norm.weight"]
        shared = glu(P["shared_experts.gate_proj.weight"], P["shared_experts.up_proj.weight"],
                     P["shared_experts.down_proj.weight"], xd[t])
        y = P["routed_expert_up_proj.weight"] @ u_hat + shared
        torch.testing.assert_close(ours[t], y, atol=1e-5, rtol=1e-4)
    # two shared experts fused into one MLP of width 2 x moe_intermediate_size
    assert P["shared_experts.gate_proj.weight"].shape == (2 * inter, cfg.hidden_size)


def test_latent_norm_is_on_the_aggregate(k3_tiny):
    """Scaling the routed aggregate u must not change the output: RMSNorm sits after Σ π_e E_e(z)."""
    moe = k3_tiny.model.layers[2].block_sparse_moe
    x = torch.randn(6, k3_tiny.config.hidden_size, generator=gen(13))
    eps, w2 = moe.routed_expert_norm.eps, moe.experts.w2.detach().clone()
    moe.routed_expert_norm.eps = 1e-20  # random-init u is tiny; keep eps from masking the invariance
    try:
        with torch.no_grad():
            base = moe(x)
            moe.experts.w2.mul_(7.0)
            scaled = moe(x)
    finally:
        moe.routed_expert_norm.eps = eps
        with torch.no_grad():
            moe.experts.w2.copy_(w2)
    torch.testing.assert_close(scaled, base, atol=1e-5, rtol=1e-4)
