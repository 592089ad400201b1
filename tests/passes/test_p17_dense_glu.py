"""P17 dense GLU: each GLU activation chain (the dense MLP's, and in graphs without P6 each MoE layer's shared
expert) -> one k3.glu_act; exact counts on both tiny models in every mode, after the default pipeline one per dense
layer in decode; on by default for SiTU; numerics vs the unpassed graph (bit-identical on CPU) and the eager model."""
import pytest
import torch

from k3compile.passes.kernels import glu_act as _glu  # noqa: F401  (registers torch.ops.k3.glu_act)
from k3compile.passes.manager import PassManager
from k3compile.passes.pipeline import PipelineConfig, pipeline_from_flags
from k3compile.passes.registry import PassConfigError, get_pass

from .helpers import (BF16_TOL, FP32_TOL, MODELS, assert_same_step, eager_step, graph, inputs_for, layer_counts, model,
                      op_counts, other_batch, run_graph, run_pass)

aten = torch.ops.aten
P17 = "p17_dense_glu"
GLU_ACT = torch.ops.k3.glu_act.default


def _glu_mlps(cfg) -> int:
    """GLU MLPs of a captured graph: each dense layer's, and each MoE layer's shared expert(s) (one GLUMLP)."""
    n = layer_counts(cfg)
    return n["dense"] + (n["moe"] if cfg.num_shared_experts else 0)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("name", MODELS)
def test_one_rewrite_per_glu_mlp(name, mode):
    cfg = model(name).config
    gm = graph(name, mode, torch.bfloat16)
    before = op_counts(gm)
    n = _glu_mlps(cfg)
    assert run_pass(gm, P17, acts="situ,silu") == n
    after = op_counts(gm)
    assert after[GLU_ACT] == n
    if cfg.hidden_act == "situ":  # 12 ATen nodes a chain: 3 casts, 2 div, 2 tanh, 4 mul, 1 sigmoid
        assert after[aten.tanh.default] == before[aten.tanh.default] - 2 * n == 0
        assert after[aten.div.Tensor] == before[aten.div.Tensor] - 2 * n
        assert after[aten._to_copy.default] == before[aten._to_copy.default] - 3 * n
        assert after[aten.mul.Tensor] == before[aten.mul.Tensor] - 4 * n
        assert after[aten.sigmoid.default] == before[aten.sigmoid.default] - n
    else:
        assert after[aten.silu.default] == before[aten.silu.default] - n
        assert after[aten.mul.Tensor] == before[aten.mul.Tensor] - n
    for node in gm.graph.nodes:
        if node.target == GLU_ACT:
            assert node.args[2] == cfg.hidden_act
            if cfg.hidden_act == "situ":
                assert node.args[3:] == (cfg.situ_beta, cfg.situ_linear_beta)
    code = gm.code
    assert run_pass(gm, P17, acts="situ,silu") == 0 and gm.code == code


def test_acts_choose_the_activations():
    """The default fuses SiTU and SiLU chains (both measured on the device: K3 in h200_s12/call4, Kimi Linear's
    silu + mul in h200_s13/call1); `acts=situ` leaves Kimi Linear's silu + mul alone. An unknown activation is
    refused by name."""
    assert get_pass(P17).config_cls().act_set() == {"situ", "silu"}
    gm = graph("kimi-linear-tiny", "decode", torch.bfloat16)
    code = gm.code
    assert run_pass(gm, P17, acts="situ") == 0 and gm.code == code
    assert run_pass(gm, P17) == _glu_mlps(model("kimi-linear-tiny").config)
    pipeline = pipeline_from_flags(P17, pass_opts=[f"{P17}.acts=situ+silu"])  # a --variant string's spelling
    assert pipeline.config(P17).act_set() == {"situ", "silu"}
    with pytest.raises(PassConfigError, match="p17_dense_glu.acts: unknown activations"):
        run_pass(graph("k3-tiny", "decode", torch.bfloat16), P17, acts="gelu")


def test_on_by_default_and_one_per_dense_layer_after_the_pipeline():
    assert get_pass(P17).config_cls().enabled is True
    cfg = model("k3-tiny").config
    counts = {}
    for on in (False, True):
        pipeline = PipelineConfig.default()
        pipeline.set_option("p08_small_m_gemm", "choice", "gemv")
        if not on:
            pipeline.set_option(P17, "enabled", False)
        gm = graph("k3-tiny", "decode", torch.bfloat16)
        report = PassManager(pipeline).run(gm)
        counts[on] = op_counts(gm)
        matches = {r.name: r.matches for r in report.passes}
        assert matches.get(P17) == (layer_counts(cfg)["dense"] if on else None)  # off: not run at all
    assert counts[False][GLU_ACT] == 0
    assert counts[True][GLU_ACT] == layer_counts(cfg)["dense"]  # P6 took the shared experts' activations
    assert counts[True][aten.tanh.default] == 0 < counts[False][aten.tanh.default]


@pytest.mark.parametrize("name,dtype,mode", [("k3-tiny", torch.float32, "decode"),
                                             ("k3-tiny", torch.bfloat16, "decode"),
                                             ("kimi-linear-tiny", torch.bfloat16, "decode"),
                                             ("k3-tiny", torch.bfloat16, "prefill")])
def test_numerics_vs_unpassed_graph_and_eager(name, dtype, mode):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    before, gm = graph(name, mode, dtype), graph(name, mode, dtype)
    assert run_pass(gm, P17, acts="situ,silu") == _glu_mlps(model(name).config)
    for x in (inputs_for(name, mode, dtype), other_batch(model(name, dtype), mode)):
        got = run_graph(gm, x)
        assert_same_step(got, run_graph(before, x), 0.0, "vs unpassed graph")  # on CPU the op is glu_act itself
        assert_same_step(got, eager_step(model(name, dtype), mode, x), tol, "vs eager model")
