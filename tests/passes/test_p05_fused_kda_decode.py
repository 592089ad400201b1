"""P5 fused KDA decode: one k3.fused_kda_decode per KDA layer in decode graphs (none in prefill), the
gate variant and constants read off the graph, numerics (pools included) vs the unpassed graph and
the eager model, refusals, the graph's JSON round trip."""
import functools
import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.capture import capture_step
from k3compile.engine.graph_io import graph_from_dict, graph_to_dict
from k3compile.model_def.init import init_random
from k3compile.model_def.layers.common import StepInputs
from k3compile.model_def.layers.kda import KDAMixer
from k3compile.model_def.loader import build_model
from k3compile.passes.kernels import kda_decode  # noqa: F401  (torch.ops.k3.fused_kda_decode)
from k3compile.passes.manager import PassManager, snapshot
from k3compile.passes.pipeline import PipelineConfig
from k3compile.passes.registry import PassConfigError

from .helpers import (BF16_TOL, FP32_TOL, MODELS, assert_same_step, eager_step, graph, inputs_for, model,
                      op_counts, other_batch, run_graph, run_pass)

P5 = "p05_fused_kda_decode"
FUSED = torch.ops.k3.fused_kda_decode.default
SHORT_CONV = torch.ops.k3.short_conv_decode.default
KDA = torch.ops.k3.kda_decode.default


def nodes_removed(cfg, dtype) -> int:
    """Nodes one KDA layer loses, for the one fused node it gains: 3 convs + 3 views + kda_decode, 7 of
    the decay gate, 1 of beta, 8 of the gated norm, f_b_proj's mm + t; Kimi Linear's low-rank output
    gate adds g_b_proj's mm + t + view; bf16 graphs add 5 fp32 casts (f, b, o, gate, and the one back)."""
    return 23 + 2 + (0 if cfg.kda_full_rank_gate else 3) + (5 if dtype == torch.bfloat16 else 0) - 1


@functools.lru_cache(maxsize=None)
def _upstream_cached(name: str, mode: str, dtype):
    gm = graph(name, mode, dtype)
    cfg = PipelineConfig.default()
    cfg.order = [n for n in cfg.order if n < P5]
    PassManager(cfg).run(gm, None)
    return gm


def _upstream(name: str, mode: str, dtype=torch.float32):
    """A private copy of the captured graph after P1-P4 (what P5 sees in the default pipeline)."""
    return snapshot(_upstream_cached(name, mode, dtype))


def _fused_nodes(gm):
    return [n for n in gm.graph.nodes if n.target == FUSED]


def test_p05_runs_after_p04_in_the_default_pipeline():
    order = PipelineConfig.default().order
    assert order.index(P5) == order.index("p04_fused_routing") + 1


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode,dtype", [("decode", torch.float32), ("decode", torch.bfloat16),
                                        ("prefill", torch.float32)])
def test_one_fused_op_per_kda_layer_in_decode_only(name, mode, dtype):
    cfg = model(name).config
    n_kda = len(cfg.kda_layers) if mode == "decode" else 0
    gm = _upstream(name, mode, dtype)
    before, nodes0 = op_counts(gm), len(gm.graph.nodes)
    assert run_pass(gm, P5) == n_kda
    after = op_counts(gm)
    assert after[FUSED] == n_kda
    if mode == "decode":
        assert before[SHORT_CONV] == 3 * n_kda and before[KDA] == n_kda
        assert after[SHORT_CONV] == 0 and after[KDA] == 0
    assert len(gm.graph.nodes) == nodes0 - nodes_removed(cfg, dtype) * n_kda
    fused = _fused_nodes(gm)
    # layer index, gate variant and eps as the config says; weights are the layer's own
    assert [n.args[14] for n in fused] == list(range(n_kda))
    assert all(n.args[16] == cfg.gate_lower_bound and n.args[17] == cfg.rms_norm_eps
               and n.args[20:] == (True, True, "s8", True) for n in fused)  # use_pdl, prefetch, launch, early
    for i, node in enumerate(fused):
        layer = cfg.kda_layers[i]
        a_log, norm_weight = node.args[8], node.args[11]
        assert a_log.op == "get_attr" and f"layers_{layer}_self_attn_A_log" in a_log.target
        assert norm_weight.op == "get_attr" and f"layers_{layer}_self_attn_o_norm_weight" in norm_weight.target
        assert [a.target for a in node.args[12:14]] == ["conv", "ssm"]
        f_b, g_b = node.args[18:20]  # the absorbed low-rank up-projections
        assert f_b.op == "get_attr" and f"layers_{layer}_self_attn_f_b_proj_weight" in f_b.target
        if cfg.kda_full_rank_gate:
            assert g_b is None
        else:
            assert g_b.op == "get_attr" and f"layers_{layer}_self_attn_g_b_proj_weight" in g_b.target
    code = gm.code
    assert run_pass(gm, P5) == 0
    assert gm.code == code


@pytest.mark.parametrize("name,dtype", [("k3-tiny", torch.float32), ("kimi-linear-tiny", torch.float32),
                                        ("k3-tiny", torch.bfloat16), ("kimi-linear-tiny", torch.bfloat16)])
def test_numerics_vs_unpassed_graph_and_eager(name, dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    before, gm = _upstream(name, "decode", dtype), _upstream(name, "decode", dtype)
    assert run_pass(gm, P5) == len(model(name).config.kda_layers)
    for x in (inputs_for(name, "decode", dtype), other_batch(model(name, dtype), "decode")):
        got = run_graph(gm, x)  # (outputs, inputs after): logits and every pool
        assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")
        assert_same_step(got, eager_step(model(name, dtype), "decode", x), tol, "vs eager model")


def test_options_use_pdl_and_no_low_rank_absorption():
    cfg = model("kimi-linear-tiny").config
    n_kda = len(cfg.kda_layers)
    gm = _upstream("kimi-linear-tiny", "decode")
    mm0 = op_counts(gm)[torch.ops.aten.mm.default]
    assert run_pass(gm, P5, use_pdl=False, absorb_low_rank=False, prefetch=False, launch="s8") == n_kda
    assert all(n.args[18:] == (None, None, False, False, "s8") for n in _fused_nodes(gm))
    cfg = PipelineConfig.default()
    cfg.set_option(P5, "launch", "wide")  # dropped after session 9's H200 run (model_def/ops/kda_launch.py)
    with pytest.raises(PassConfigError, match="p05_fused_kda_decode: launch must be one of s8, got 'wide'"):
        cfg.validate()
    assert op_counts(gm)[torch.ops.aten.mm.default] == mm0  # f_b_proj and g_b_proj stay GEMMs
    early = _upstream("kimi-linear-tiny", "decode")  # early_release: one more argument, only when set (and PDL on)
    assert run_pass(early, P5, early_release=False) == n_kda
    assert all(n.args[20:] == (True, True, "s8") for n in _fused_nodes(early))
    absorbed = _upstream("kimi-linear-tiny", "decode")
    run_pass(absorbed, P5)
    assert op_counts(absorbed)[torch.ops.aten.mm.default] == mm0 - 2 * n_kda
    x = inputs_for("kimi-linear-tiny", "decode")
    want = run_graph(_upstream("kimi-linear-tiny", "decode"), x)
    assert_same_step(run_graph(gm, x), want, FP32_TOL, "no PDL, no absorption, on CPU")
    assert_same_step(run_graph(absorbed, x), want, FP32_TOL, "absorbed low-rank GEMMs, on CPU")
    assert_same_step(run_graph(early, x), want, FP32_TOL, "no early release, on CPU")


def test_graph_json_round_trip_keeps_the_fused_op():
    # Kimi Linear: lower_bound is None in the schema's optional float
    gm = _upstream("kimi-linear-tiny", "decode")
    run_pass(gm, P5)
    keys = {n.target: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    text = json.dumps(graph_to_dict(gm, "decode", keys), allow_nan=False)
    weights = {k: getattr(gm, k) for k in keys}
    back = graph_from_dict(json.loads(text), weights, tuple(n.target for n in gm.graph.nodes if n.op == "placeholder"))
    assert [(n.args[16:18], n.args[20], n.args[22]) for n in back.graph.nodes if n.target == FUSED] == \
        [((None, 1e-5), True, "s8")] * 4  # (the launch layout is recorded in the engine)
    x = inputs_for("kimi-linear-tiny", "decode")
    got, want = run_graph(back, x), run_graph(gm, x)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------- refusals

def _mixer_graph():
    """make_fx of one KDAMixer decode step (k3-tiny shapes, separate projection GEMMs) and its inputs."""
    cfg = model("k3-tiny").config
    mixer = KDAMixer(cfg, pool_index=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    c = cfg.kda_dim

    def step(x, conv, ssm, slots):
        return mixer(x, StepInputs("decode", None, None, None, slots, None, ssm, conv, None))

    args = (torch.randn(3, cfg.hidden_size), torch.randn(4, 1, 3 * c, 3), torch.randn(4, 1, 2, 16, 16),
            torch.tensor([2, 0, 3]))
    with torch.no_grad():
        gm = make_fx(step, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)
    return gm, args


def test_a_bare_mixer_matches_and_matches_eager():
    gm, args = _mixer_graph()
    ref, _ = _mixer_graph()
    assert run_pass(gm, P5) == 1
    a, b = [t.clone() for t in args], [t.clone() for t in args]
    torch.testing.assert_close(gm(*a), ref(*b), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)  # conv windows: the same values moved
    torch.testing.assert_close(a[2], b[2], rtol=1e-5, atol=1e-6)  # states
    assert not torch.equal(a[2], args[2])


def _with_extra_user(gm, target, picker=lambda nodes: nodes[0]):
    """Add an output that reads a node of the pattern: the chain must then be left alone."""
    node = picker([n for n in gm.graph.nodes if n.target == target])
    out = next(n for n in gm.graph.nodes if n.op == "output")
    first = out.args[0]
    out.args = ((*(first if isinstance(first, (tuple, list)) else (first,)), node),)
    gm.recompile()
    return gm


@pytest.mark.parametrize("target", [torch.ops.aten.sigmoid.default, KDA, SHORT_CONV,
                                    torch.ops.aten.rsqrt.default, torch.ops.aten.exp.default])
def test_intermediates_read_elsewhere_block_the_match(target):
    gm, _ = _mixer_graph()
    gm = _with_extra_user(gm, target)
    code = gm.code
    assert run_pass(gm, P5) == 0
    assert gm.code == code


def test_other_conv_layout_does_not_match():
    gm, _ = _mixer_graph()
    conv = [n for n in gm.graph.nodes if n.target == SHORT_CONV]
    conv[1].args = conv[1].args[:4] + (conv[2].args[4],) + conv[1].args[5:]  # k stream at v's offset
    gm.recompile()
    assert run_pass(gm, P5) == 0


def test_other_softplus_threshold_does_not_match():
    gm = _upstream("kimi-linear-tiny", "decode")
    sp = [n for n in gm.graph.nodes if n.target == torch.ops.aten.softplus.default]
    sp[0].args = (sp[0].args[0], 1.0, 10.0)
    gm.recompile()
    assert run_pass(gm, P5) == len(model("kimi-linear-tiny").config.kda_layers) - 1


def test_model_with_one_kda_layer_and_capture_from_scratch():
    base = model("kimi-linear-tiny").config
    m = build_model(base.replace(name="one-kda", num_hidden_layers=2, layer_types=("kda", "mla")))
    init_random(m, 0)
    gm = capture_step(m, "decode")
    ref = snapshot(gm)
    assert run_pass(gm, P5) == 1  # straight after capture, without P1-P4
    from k3compile.passes.verify import randomized_inputs, step_inputs
    x = randomized_inputs(step_inputs(m, "decode"), 5)
    assert_same_step(run_graph(gm, x), run_graph(ref, x), FP32_TOL, "fresh capture")
