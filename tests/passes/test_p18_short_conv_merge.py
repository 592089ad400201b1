"""P18 short-conv merge: after P1 each KDA layer's q/k/v prefill short convs become one k3.short_conv_prefill over a
column slice of P1's GEMM (no cat); exact counts on both tiny models, 0 in decode and on graphs whose inputs come
after the first conv (no P1); off by default; bit-identical steps vs the unpassed graph (outputs and pools) on CPU
and within tolerance of the eager model; fewer host ops per prefill forward."""
import pytest
import torch

import k3compile.model_def.ops.library  # noqa: F401  (registers torch.ops.k3.short_conv_prefill)
from k3compile.passes.manager import PassManager
from k3compile.passes.pipeline import PipelineConfig
from k3compile.passes.registry import PassConfigError, get_pass

from .helpers import (BF16_TOL, FP32_TOL, MODELS, assert_same_step, eager_step, graph, inputs_for, layer_counts, model,
                      op_counts, other_batch, run_graph, run_pass)

aten = torch.ops.aten
P18 = "p18_short_conv_merge"
SHORT_CONV = torch.ops.k3.short_conv_prefill.default


def _after_p1(name, mode, dtype=torch.float32):
    gm = graph(name, mode, dtype)
    run_pass(gm, "p01_gemm_merge")
    return gm


@pytest.mark.parametrize("name", MODELS)
def test_one_merge_per_kda_layer_after_p1(name):
    kda = layer_counts(model(name).config)["kda"]
    gm = _after_p1(name, "prefill", torch.bfloat16)
    before = op_counts(gm)
    assert before[SHORT_CONV] == 3 * kda
    assert run_pass(gm, P18, enabled=True) == kda
    after = op_counts(gm)
    assert after[SHORT_CONV] == kda
    assert after[aten.squeeze.dim] == before[aten.squeeze.dim] - 3 * kda   # the three weights' squeezes
    assert after[aten.cat.default] == before[aten.cat.default]   # the input is a slice of P1's GEMM, not a cat
    assert after[aten.slice.Tensor] == before[aten.slice.Tensor] + 4 * kda   # input slice + 3 output slices
    for node in gm.graph.nodes:
        if node.target == SHORT_CONV:
            assert node.args[4] == 0   # channel offset of the q block: the union starts there
            assert node.args[0].target == aten.slice.Tensor and node.args[0].args[0].target == aten.mm.default
            assert node.args[1].op == "get_attr"
    code = gm.code
    assert run_pass(gm, P18, enabled=True) == 0 and gm.code == code   # nothing left to merge


def test_no_match_in_decode_or_without_p1():
    for name in MODELS:
        gm = _after_p1(name, "decode")
        assert run_pass(gm, P18, enabled=True) == 0
        raw = graph(name, "prefill")   # k_proj's GEMM comes after q's conv: the group cannot move up
        code = raw.code
        assert run_pass(raw, P18, enabled=True) == 0 and raw.code == code


def test_off_by_default_and_min_group_checked():
    assert get_pass(P18).config_cls().enabled is False
    pipeline = PipelineConfig.default()
    gm = graph("k3-tiny", "prefill", torch.bfloat16)
    report = PassManager(pipeline).run(gm)
    assert P18 not in {r.name for r in report.passes}
    assert op_counts(gm)[SHORT_CONV] == 3 * layer_counts(model("k3-tiny").config)["kda"]
    with pytest.raises(PassConfigError, match="min_group must be >= 2"):
        run_pass(graph("k3-tiny", "prefill"), P18, enabled=True, min_group=1)


def test_in_the_default_pipeline_when_enabled():
    pipeline = PipelineConfig.default()
    pipeline.set_option(P18, "enabled", True)
    gm = graph("k3-tiny", "prefill", torch.bfloat16)
    report = PassManager(pipeline).run(gm)
    kda = layer_counts(model("k3-tiny").config)["kda"]
    assert {r.name: r.matches for r in report.passes}[P18] == kda
    assert op_counts(gm)[SHORT_CONV] == kda


@pytest.mark.parametrize("name,dtype", [("k3-tiny", torch.float32), ("k3-tiny", torch.bfloat16),
                                        ("kimi-linear-tiny", torch.bfloat16)])
def test_numerics_vs_unpassed_graph_and_eager(name, dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    before, gm = _after_p1(name, "prefill", dtype), _after_p1(name, "prefill", dtype)
    assert run_pass(gm, P18, enabled=True) == layer_counts(model(name).config)["kda"]
    for x in (inputs_for(name, "prefill", dtype), other_batch(model(name, dtype), "prefill")):
        got = run_graph(gm, x)
        assert_same_step(got, run_graph(before, x), 0.0, "vs unpassed graph")   # same per-channel math, conv pool too
        assert_same_step(got, eager_step(model(name, dtype), "prefill", x), tol, "vs eager model")


def test_fewer_host_ops_per_prefill_forward():
    """What the merge is for: the ATen ops a prefill step dispatches from the host (the short conv's packed code runs
    ~30 a call on any device), counted by the profiler on one step."""
    from torch.profiler import ProfilerActivity, profile

    def host_ops(gm, x):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_graph(gm, x)
        return sum(1 for e in prof.events() if e.name.startswith("aten::"))

    before, gm = _after_p1("k3-tiny", "prefill"), _after_p1("k3-tiny", "prefill")
    kda = layer_counts(model("k3-tiny").config)["kda"]
    assert run_pass(gm, P18, enabled=True) == kda
    x = inputs_for("k3-tiny", "prefill")
    saved = host_ops(before, x) - host_ops(gm, x)
    assert saved >= 2 * 10 * kda   # two short-conv calls of >= 10 ops each, per KDA layer
