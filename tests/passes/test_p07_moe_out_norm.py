"""p07_moe_out_norm: after P1-P7, one k3.fused_moe_decode_norm per MoE layer in K3-style (latent MoE) decode graphs,
none in Kimi-Linear graphs (no kernel C) or prefill; off by default; numerics exactly those of the graph before the
pass on CPU, close to the eager model; the op's checks and composition; the kernel under the interpreter; on CUDA at
k3-mini-6b's shape the fused kernel against the pair it replaces, eager and replayed from a CUDA graph."""
import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.model_def.config import get_preset
from k3compile.passes.kernels import arrivals, moe_decode
from k3compile.passes.kernels import attn_res_norm as arn
from k3compile.passes.kernels import moe_out_norm as mon
from k3compile.passes.pipeline import PipelineConfig
from k3compile.passes.registry import PassConfigError, get_pass

from .helpers import assert_as_before_and_close_to_eager, assert_pass_leaves_alone, layer_counts, model, op_counts, \
    run_pass
from .kernels.interpreted import run_interpreted
from .test_p07_norm_route import _after_p7  # P1-P7 run once per graph and session, shared with that file

P = "p07_moe_out_norm"
FUSED = torch.ops.k3.fused_moe_decode_norm.default
MOE = torch.ops.k3.fused_moe_decode.default
NORM = torch.ops.k3.attn_res_norm.default


def test_off_by_default():
    assert not PipelineConfig.default().config(P).enabled
    with pytest.raises(PassConfigError, match="num_warps must be 0"):
        get_pass(P).config_cls(num_warps=3).validate()
    with pytest.raises(PassConfigError, match="block_n must be 0"):
        get_pass(P).config_cls(block_n=12).validate()


def test_one_fused_node_per_latent_moe_layer_in_decode():
    name = "k3-tiny"
    moe = layer_counts(model(name).config)["moe"]
    gm = _after_p7(name, "decode")
    before = op_counts(gm)
    assert before[MOE] == moe
    assert run_pass(gm, P) == moe
    after = op_counts(gm)
    assert after[FUSED] == moe and after[MOE] == 0
    assert after[NORM] == before[NORM] - moe  # each MoE output fed one input norm (the last one the final norm)
    for node in [n for n in gm.graph.nodes if n.target == FUSED]:
        assert node.args[mon.NORM_ARGS + 14] is not None  # latent_up_w, after the norm's arguments
        assert node.args[7:9] == (0, 0)  # num_warps, block_n: kernel C's own launch
        assert {u.target for u in node.users} == {operator.getitem}
    assert_pass_leaves_alone(gm, P)


@pytest.mark.parametrize("name,mode", [("kimi-linear-tiny", "decode"), ("k3-tiny", "prefill"),
                                       ("kimi-linear-tiny", "prefill")])
def test_full_width_moe_and_prefill_are_left_alone(name, mode):
    gm = _after_p7(name, mode)
    assert_pass_leaves_alone(gm, P)


def test_launch_options_ride_on_the_node():
    gm = _after_p7("k3-tiny", "decode")
    assert run_pass(gm, P, num_warps=8, block_n=16) == layer_counts(model("k3-tiny").config)["moe"]
    assert {n.args[7:9] for n in gm.graph.nodes if n.target == FUSED} == {(8, 16)}


def test_numerics_equal_the_graph_before_and_close_to_eager():
    name = "k3-tiny"
    before = _after_p7(name, "decode")
    gm = _after_p7(name, "decode")
    assert run_pass(gm, P) == layer_counts(model(name).config)["moe"]
    assert_as_before_and_close_to_eager(gm, before, name)  # on CPU the op runs the same references


def _args(gen, n=3, d=48, lat=32, e=8, k=2, s=24, bank_rows=2, residual=True, dtype=torch.bfloat16):
    """(norm args, MoE args) of a small latent MoE, the op's order."""
    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    moe = (randn(n, lat), ids, torch.rand(n, k, generator=gen), randn(e, 64, lat, scale=lat ** -0.5),
           randn(e, lat, lat, scale=lat ** -0.5), None, None, randn(n, s), randn(n, s), randn(d, s, scale=s ** -0.5),
           "situ", 4.0, 25.0, 16, randn(d, lat, scale=lat ** -0.5), 1 + 0.1 * randn(lat), 1e-5)
    norm = ([randn(n, d) for _ in range(bank_rows)], randn(n, d) if residual else None,
            torch.randn(d, generator=gen) if bank_rows else None, 1 + 0.1 * randn(d), 1e-6, 1e-5, True, 0, 0)
    return norm, moe


@pytest.mark.parametrize("residual", [True, False])
def test_op_is_the_composition_and_one_node(residual):
    norm, moe = _args(torch.Generator().manual_seed(0), residual=residual)
    h, p = FUSED(*norm, *moe)
    y = MOE(*moe)
    x, delta = (norm[1], y) if residual else (y, None)
    h7, p7 = NORM(norm[0], x, delta, *norm[2:7])
    assert torch.equal(h, h7) and torch.equal(p, p7)
    torch.library.opcheck(FUSED, (*norm, *moe))
    gm = make_fx(lambda *a: FUSED(*a), tracing_mode="symbolic")(*norm, *moe)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert calls == [FUSED]


@pytest.mark.parametrize("change,message", [
    (lambda norm, moe: moe.__setitem__(14, None), "latent_up_w is None"),
    (lambda norm, moe: norm.__setitem__(1, torch.zeros(2, 48, dtype=torch.bfloat16)), "delta must match x"),
    (lambda norm, moe: norm.__setitem__(3, torch.ones(40, dtype=torch.bfloat16)), "norm_weight must be"),
    (lambda norm, moe: norm.__setitem__(2, None), "non-empty bank needs query"),
])
def test_bad_arguments_raise_clear_errors(change, message):
    norm, moe = (list(a) for a in _args(torch.Generator().manual_seed(1)))
    change(norm, moe)
    with pytest.raises(ValueError, match=message):
        FUSED(*norm, *moe)


def test_triton_kernel_under_interpreter_matches_references():
    run_interpreted("interpret_moe_out_norm.py")


# ----------------------------------------------------------------------------- CUDA, k3-mini-6b's shape

def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _mini_problem(n, seed, bank_rows, residual):
    """k3-mini-6b's latent MoE (E=96, top-8, I=512 on the 1024 latent, up to D=2048, shared width 1024) and an
    AttnRes norm with `bank_rows` rows after it, bf16 on the GPU: (norm args, MoE args)."""
    cfg = get_preset("k3-mini-6b")
    d, lat, i = cfg.hidden_size, cfg.latent_size, cfg.moe_intermediate_size
    s, e, k = i * cfg.num_shared_experts, cfg.num_experts, cfg.num_experts_per_token
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    ids, wts = moe_decode.random_routing(n, e, k, "cuda", seed)
    moe = (randn(n, lat), ids, wts, randn(e, 2 * i, lat, scale=lat ** -0.5), randn(e, lat, i, scale=i ** -0.5),
           None, None, randn(n, s), randn(n, s), randn(d, s, scale=s ** -0.5), "situ", 4.0, 25.0, 1 << 30,
           randn(d, lat, scale=lat ** -0.5), 1 + 0.1 * randn(lat), 1e-5, True)
    norm = ([randn(n, d) for _ in range(bank_rows)], randn(n, d) if residual else None,
            torch.randn(d, generator=gen, device="cuda") if bank_rows else None, 1 + 0.1 * randn(d), 1e-6, 1e-5, True)
    return norm, moe


def _pair(norm, moe, *options):
    y = MOE(*moe, *options)
    x, delta = (norm[1], y) if norm[1] is not None else (y, None)
    return NORM(norm[0], x, delta, *norm[2:7])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,bank_rows,residual", [(1, 8, True), (1, 3, False), (8, 8, True)])
def test_cuda_fused_kernel_matches_the_pair_at_the_k3_mini_shape(n, bank_rows, residual):
    """The fused kernel (PDL on; kernel C's own launch, 8 warps, 8 columns a program; with P6's latent_prewait + early
    releases) against the
    pair it replaces (P6's op, then P7's): p bit for bit, h within 1e-2, and within 1e-2 of the fp32 references."""
    norm, moe = _mini_problem(n, 900 + n + bank_rows, bank_rows, residual)
    h_pair, p_pair = _pair(norm, moe)
    f32 = [v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in moe]
    y_ref = moe_decode.fused_moe_reference(*f32[:13], *f32[14:17])
    bank32, res32 = [r.float() for r in norm[0]], norm[1].float() if residual else None
    x, delta = (res32, y_ref) if residual else (y_ref, None)
    h_ref, _ = arn.attn_res_norm_reference(bank32, x, delta, norm[2], norm[3].float(), norm[4], norm[5])
    options = (None, None, False, False, None, False)  # shared_w13 .. flag_deps
    off, on = (False, False, False), (True, True, True)
    for warps, block_n, releases in ((0, 0, off), (8, 0, off), (0, 8, off), (0, 0, on), (0, 8, on)):
        h, p = FUSED(*norm, warps, block_n, *moe, *options, *releases)
        torch.cuda.synchronize()
        what = (warps, block_n, releases)
        assert torch.equal(p, p_pair), what
        assert _rel(h, h_pair) < 1e-2 and _rel(h, h_ref) < 1e-2, (what, _rel(h, h_pair), _rel(h, h_ref))
    assert not arrivals.current(torch.device("cuda"), mon.ARRIVALS_OWNER).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_kernel_replays_from_a_cuda_graph_behind_other_kernels():
    """Captured behind another kernel and followed by one (PDL on), replayed on new inputs three times: each replay's
    h and p equal the pair's on the same inputs (the counters were zero at every replay)."""
    norm, moe = _mini_problem(1, 950, 8, True)
    scratch = torch.empty(1 << 22, device="cuda")

    def step():
        scratch.mul_(0.5)
        h, p = FUSED(*norm, 0, 8, *moe)
        return h * 1.0, p * 1.0  # the kernels after the op

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2, 3):
        fresh, fresh_moe = _mini_problem(1, 950 + seed, 8, True)
        for dst, src in zip([*norm[0], norm[1]], [*fresh[0], fresh[1]]):
            dst.copy_(src)
        moe[0].copy_(fresh_moe[0])
        moe[1].copy_(fresh_moe[1])
        graph.replay()
        torch.cuda.synchronize()
        h_pair, p_pair = _pair(norm, moe)
        assert torch.equal(out[1], p_pair) and _rel(out[0], h_pair) < 1e-2, seed
