"""P7 AttnRes + RMSNorm: one k3.attn_res_norm per pre-norm that follows a residual add (2 per layer,
counting the final norm, on both K3-style and plain-residual configs), numerics vs the unpassed graph
and the eager model (pools included), the folded query, and refusals."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.model_def.layers.attn_res import attn_res_read
from k3compile.passes.kernels import attn_res_norm  # noqa: F401  (torch.ops.k3.attn_res_norm)

from .helpers import (BF16_TOL, FP32_TOL, MODELS, MODES, assert_same_step, eager_step, graph, inputs_for, layer_counts,
                      model, op_counts, run_graph, run_pass)

aten = torch.ops.aten
P7 = "p07_attn_res_norm"
FUSED = torch.ops.k3.attn_res_norm.default


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target == FUSED]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", MODES)
def test_one_fused_norm_per_residual_prenorm(name, mode):
    cfg = model(name).config
    n = layer_counts(cfg)
    gm = graph(name, mode)
    before = op_counts(gm)
    assert run_pass(gm, P7) == 2 * n["layers"] + 1
    after = op_counts(gm)
    fused = _fused(gm)
    assert len(fused) == 2 * n["layers"] + 1
    # layer 0's first norm reads the embedding itself (no residual add): delta None
    first = fused[0]
    assert first.args[1].target == aten.embedding.default and first.args[2] is None and first.args[0] == []
    # what remains: the MLA/MoE inner norms; no softmax, no stack
    assert after[aten._softmax.default] == after[aten.stack.default] == 0
    assert (after[aten.rsqrt.default]
            == before[aten.rsqrt.default] - 2 * n["layers"] - 1 - before[aten._softmax.default])
    if cfg.attn_res_block_size is None:
        assert before[aten._softmax.default] == 0 and all(f.args[0] == [] and f.args[3] is None for f in fused)
    else:
        block = cfg.attn_res_block_size
        # bank size of each read, in graph order: attn read of layer i (i > 0), mlp read of layer i, final read
        want = [0]  # the first norm
        for i in range(n["layers"]):
            if i > 0:
                want.append((i - 1) // block + 1)
            want.append(i // block + 1)
        want.append((n["layers"] - 1) // block + 1)
        assert [len(f.args[0]) for f in fused] == want
        for f in fused[1:]:  # γ ⊙ w folded into one fp32 buffer per read (the first norm reads nothing)
            q = f.args[3]
            assert q.op == "get_attr" and getattr(gm, q.target).dtype == torch.float32
        assert not any("res_proj" in k or "res_norm" in k for k in gm.state_dict())
    assert all(f.args[6] == cfg.rms_norm_eps and (not f.args[0] or f.args[5] == cfg.rms_norm_eps) for f in fused)
    assert all(f.args[7] is True for f in fused)  # PDL on by default (the kernel checks the GPU)
    code = gm.code
    assert run_pass(gm, P7) == 0 and gm.code == code
    gm = graph(name, mode)
    assert run_pass(gm, P7, first_norm=False) == 2 * n["layers"]


@pytest.mark.parametrize("name,mode,dtype", [("k3-tiny", "decode", torch.float32),
                                             ("kimi-linear-tiny", "prefill", torch.float32),
                                             ("k3-tiny", "prefill", torch.bfloat16),
                                             ("kimi-linear-tiny", "decode", torch.bfloat16)])
def test_numerics_vs_unpassed_graph_and_eager(name, mode, dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    before, gm = graph(name, mode, dtype), graph(name, mode, dtype)
    assert run_pass(gm, P7) == 2 * layer_counts(model(name).config)["layers"] + 1
    x = inputs_for(name, mode, dtype)
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")
    assert_same_step(got, eager_step(model(name, dtype), mode, x), tol, "vs eager model")


def test_unfolded_query_still_matches_and_computes_the_same():
    before, gm = graph("k3-tiny", "decode"), graph("k3-tiny", "decode")
    assert run_pass(gm, P7, fold_query=False) == 2 * layer_counts(model("k3-tiny").config)["layers"] + 1
    assert all(f.args[3].op == "call_function" for f in _fused(gm) if f.args[0])
    x = inputs_for("k3-tiny", "decode", seed=3)
    assert_same_step(run_graph(gm, x), run_graph(before, x), FP32_TOL, "unfolded query")


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="symbolic")(*args)


def _norm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def _read_then_norm(bank0, x, delta, proj, gamma, w, leak: bool):
    p = x + delta
    mix = attn_res_read([bank0, p], proj, gamma, 1e-5)
    h = _norm(mix, w)
    return (h, p, mix.sum()) if leak else (h, p)


def test_intermediates_read_elsewhere_block_the_match():
    d = 16
    weights = (torch.randn(1, d), torch.randn(d), torch.randn(d))
    args = (torch.randn(3, d), torch.randn(3, d), torch.randn(3, d)) + weights
    leaky = _trace(lambda *a: _read_then_norm(*a, leak=True), *args)
    code = leaky.code
    assert run_pass(leaky, P7) == 0 and leaky.code == code
    clean = _trace(lambda *a: _read_then_norm(*a, leak=False), *args)
    ref = _trace(lambda *a: _read_then_norm(*a, leak=False), *args)
    assert run_pass(clean, P7) == 1  # the query is computed from graph inputs here: passed unfolded
    for n in (3, 7):
        xs = (torch.randn(n, d), torch.randn(n, d), torch.randn(n, d)) + weights
        for a, b in zip(clean(*xs), ref(*xs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_norm_without_a_residual_add_is_left_alone():
    d = 16
    gm = _trace(lambda x, y, w: _norm(x * y, w), torch.randn(2, d), torch.randn(2, d), torch.randn(d))
    assert run_pass(gm, P7) == 0


@pytest.mark.parametrize("name", MODELS)
def test_fp32_casts_of_h_come_from_the_kernel(name):
    """bf16 decode: each MoE layer's router casts h to fp32; P7 emits attn_res_norm_f32 there (one per
    MoE layer) and the casts are gone; fp32_copy=False keeps them; fp32 graphs have no such cast."""
    from k3compile.passes.manager import snapshot
    F32 = torch.ops.k3.attn_res_norm_f32.default
    moe = layer_counts(model(name).config)["moe"]
    base = graph(name, "decode", torch.bfloat16)
    gm, kept = snapshot(base), snapshot(base)
    casts0 = op_counts(base)[aten._to_copy.default]
    assert run_pass(gm, P7) == run_pass(kept, P7, fp32_copy=False)
    assert op_counts(gm)[F32] == moe and op_counts(kept)[F32] == 0
    assert op_counts(kept)[aten._to_copy.default] - op_counts(gm)[aten._to_copy.default] == moe
    assert op_counts(kept)[aten._to_copy.default] < casts0  # (P7 takes other casts in either way)
    x = inputs_for(name, "decode", torch.bfloat16)
    assert_same_step(run_graph(gm, x), run_graph(kept, x), BF16_TOL, "fp32 copy from the kernel")
    fp32 = graph(name, "decode")
    run_pass(fp32, P7)
    assert op_counts(fp32)[F32] == 0


@pytest.mark.parametrize("name", MODELS)
def test_block_boundary_zeros_fold_into_the_kernel(name):
    """K3: the residual add after each block boundary reads zeros_like(p); P7 passes delta as x with no
    delta (ceil(L / block) nodes) and the fill is gone; fold_zeros=False keeps it; same numerics."""
    from k3compile.passes.manager import snapshot
    cfg = model(name).config
    block = cfg.attn_res_block_size
    want = 0 if block is None else -(-cfg.num_hidden_layers // block)
    base = graph(name, "decode", torch.bfloat16)
    gm, kept = snapshot(base), snapshot(base)
    zeros0 = op_counts(base)[aten.zeros_like.default]
    assert zeros0 >= want
    assert run_pass(gm, P7) == run_pass(kept, P7, fold_zeros=False)
    calls = [n for n in gm.graph.nodes if n.target in (FUSED, torch.ops.k3.attn_res_norm_f32.default)]
    assert sum(n.args[2] is None for n in calls[1:]) == want  # calls[0]: the first norm (delta None too)
    assert op_counts(gm)[aten.zeros_like.default] == zeros0 - want
    assert op_counts(kept)[aten.zeros_like.default] == zeros0
    x = inputs_for(name, "decode", torch.bfloat16)
    assert_same_step(run_graph(gm, x), run_graph(kept, x), BF16_TOL, "zeros_like folded")
