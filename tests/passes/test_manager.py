"""Pass manager: the whole P1-P5 pipeline on both models, the report, order/enable/options from
flags and files, graph dumps, and verification catching a broken pass by name."""
import argparse
import json
import operator

import pytest
import torch

from k3compile.passes.launches import count_launches, node_launches
from k3compile.passes.manager import PassError, PassManager, PipelineReport
from k3compile.passes.pipeline import (PipelineConfig, add_pass_arguments, pipeline_from_args,
                                       pipeline_from_flags)
from k3compile.passes.registry import PassConfig, PassConfigError, register_pass, registered_passes, unregister_pass
from k3compile.passes.verify import PassVerificationError, step_inputs

from .helpers import (FP32_TOL, assert_same_step, attn_res_reads_with_weights, eager_step, graph, layer_counts,
                      model, other_batch, run_graph)

aten = torch.ops.aten
FIRST4 = ["p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing"]
# the default pipeline: every pass file in passes/, in name order, less those off by default (test below)
BUILTIN = PipelineConfig.default().enabled_passes()
assert set(BUILTIN) < set(registered_passes())


def _expected(cfg, dtype, mode) -> dict:
    n = layer_counts(cfg)
    folded = 0 if dtype == torch.float32 else 3 * n["kda"] + n["moe"] + 2 * attn_res_reads_with_weights(cfg)
    return {"p01_gemm_merge": n["kda"] + n["mla"] + n["moe"] + n["dense"], "p02_noop_views": 2 * n["mla"],
            "p03_casts_copies_dce": n["moe"] + folded, "p04_fused_routing": n["moe"],
            "p05_fused_kda_decode": n["kda"] if mode == "decode" else 0,
            "p06_fused_moe_decode": n["moe"] if mode == "decode" else 0,
            "p07_attn_res_norm": 2 * n["layers"] + 1,
            # absorb_q=fold: + W_UK; gate_out: + the output gate (K3); q_norm_gemv moves nothing here (P8 left cuBLAS)
            "p15_mla_decode": 4 * n["mla"] + (n["mla"] if cfg.mla_output_gate else 0) if mode == "decode" else 0,
            "p07_norm_route": n["moe"] if mode == "decode" and dtype != torch.float32 else 0,
            "p16_kda_verify_inputs": 0}  # verify graphs only


@pytest.mark.parametrize("name,mode,dtype", [("k3-tiny", "decode", torch.float32),
                                             ("kimi-linear-tiny", "prefill", torch.float32),
                                             ("k3-tiny", "decode", torch.bfloat16)])
def test_full_pipeline_with_verify(name, mode, dtype, tmp_path):
    m = model(name, dtype)
    gm = graph(name, mode, dtype)
    nodes0, launches0 = len(gm.graph.nodes), count_launches(gm)
    report = PassManager(verify=True, dump_dir=str(tmp_path)).run(gm, step_inputs(m, mode))

    assert [p.name for p in report.passes] == BUILTIN
    want = _expected(m.config, dtype, mode)  # P8 and P11 counts are asserted in their own test files
    assert {k: v for k, v in report.matches().items() if k in want} == want
    assert report.nodes_before == nodes0 and report.launches_before == launches0
    for prev, cur in zip(report.passes, report.passes[1:]):
        assert prev.nodes_after == cur.nodes_before and prev.launches_after == cur.launches_before
    assert report.passes[-1].nodes_after == report.nodes_after == len(gm.graph.nodes)
    assert report.launches_after == count_launches(gm) < launches0
    assert all(p.max_rel_err is not None and p.seconds >= 0 for p in report.passes)
    assert report.passes[1].launches_after == report.passes[1].launches_before  # views launch nothing
    # JSON round trip (engine.json) and the human table
    again = PipelineReport.from_dict(json.loads(report.to_json()))
    assert again == report
    text = report.render()
    assert all(p in text for p in BUILTIN) and f"{nodes0} -> {report.nodes_after}" in text
    assert gm.meta["k3"]["passes"] == report.to_dict()
    # dumps: before the first pass, then NN_<pass>.py after each
    files = sorted(p.name for p in tmp_path.iterdir())
    order = PipelineConfig.default().order  # dumps are numbered by the pass's place in the order
    assert files == ["00_captured.py"] + [f"{order.index(p) + 1:02d}_{p}.py" for p in BUILTIN]
    assert "fused_route" in (tmp_path / "04_p04_fused_routing.py").read_text()
    assert "fused_route" not in (tmp_path / "03_p03_casts_copies_dce.py").read_text()


def test_post_pass_graph_stays_symbolic_and_matches_eager():
    m = model("k3-tiny")
    for mode in ("decode", "prefill"):
        gm = graph("k3-tiny", mode)
        PassManager().run(gm)
        x = other_batch(m, mode)  # 5 requests; the graph was captured with 3
        assert_same_step(run_graph(gm, x), eager_step(m, mode, x), FP32_TOL, f"{mode}, other batch size")


def test_launch_rule():
    gm = graph("kimi-linear-tiny", "decode")
    by_target = {}
    for n in gm.graph.nodes:
        by_target.setdefault(n.target, node_launches(n))
    for free in (aten.view.default, aten.t.default, aten.slice.Tensor, aten.permute.default, aten.sym_size.int,
                 aten._unsafe_view.default, operator.getitem, aten.squeeze.dim, aten.unsqueeze.default):
        assert by_target[free] == 0, free
    for paid in (aten.mm.default, aten.sigmoid.default, aten.clone.default, aten.cat.default, aten.topk.default,
                 torch.ops.k3.kv_write.default, torch.ops.k3.kda_decode.default):
        assert by_target[paid] == 1, paid


# ----------------------------------------------------------------------------- pipeline config

def test_default_pipeline_is_every_pass_in_name_order():
    cfg = PipelineConfig.default()
    assert cfg.order[:4] == FIRST4 and cfg.order == sorted(cfg.order)
    off = ("p07_moe_out_norm", "p08_small_m_norm_gemv", "p08_small_m_route_gemv", "p18_short_conv_merge")  # not measured
    assert cfg.enabled_passes() == [p for p in cfg.order if p not in off]
    assert list(registered_passes()) == cfg.order


def test_flags_order_enable_disable_options():
    cfg = pipeline_from_flags(passes="p02,p01_gemm_merge")
    assert cfg.order == ["p02_noop_views", "p01_gemm_merge"]
    cfg = pipeline_from_flags(disable=["p04", "p03_casts_copies_dce"])
    assert cfg.enabled_passes() == [p for p in BUILTIN if p not in ("p03_casts_copies_dce", "p04_fused_routing")]
    cfg = pipeline_from_flags(passes="p01,p04", enable=["p02"])
    assert cfg.order == ["p01_gemm_merge", "p02_noop_views", "p04_fused_routing"]
    cfg = pipeline_from_flags(pass_opts=["p01_gemm_merge.min_group=3", "p02.collapse_chains=false",
                                         "p03.dce=no", "p04.enabled=false"])
    assert cfg.config("p01_gemm_merge").min_group == 3
    assert cfg.config("p02_noop_views").collapse_chains is False
    assert cfg.config("p03_casts_copies_dce").dce is False
    assert "p04_fused_routing" not in cfg.enabled_passes()
    assert pipeline_from_flags(passes="none").order == []
    assert pipeline_from_flags(passes="all").order[:4] == FIRST4


@pytest.mark.parametrize("kwargs,message", [
    ({"passes": "p01,p77"}, "unknown pass 'p77'"),
    ({"disable": ["gemm"]}, "unknown pass 'gemm'"),
    ({"pass_opts": ["p01_gemm_merge.min_grop=2"]}, "no option 'min_grop'"),
    ({"pass_opts": ["p01_gemm_merge.min_group=two"]}, "expected an integer"),
    ({"pass_opts": ["p02.collapse_chains=maybe"]}, "expected true/false"),
    ({"pass_opts": ["p01_gemm_merge"]}, "expected PASS.OPTION=VALUE"),
    ({"pass_opts": ["p01.min_group=1"]}, "min_group must be >= 2"),
    ({"passes": "p01,p01"}, "appears twice"),
])
def test_flag_errors_name_the_problem(kwargs, message):
    with pytest.raises(PassConfigError, match=message):
        pipeline_from_flags(**kwargs)


def test_config_files_toml_and_json(tmp_path):
    toml = tmp_path / "passes.toml"
    toml.write_text('order = ["p01", "p03_casts_copies_dce"]\n\n[passes.p01_gemm_merge]\nmin_group = 4\n\n'
                    '[passes.p03]\nenabled = false\n')
    cfg = pipeline_from_flags(config_file=str(toml))
    assert cfg.order == ["p01_gemm_merge", "p03_casts_copies_dce"]
    assert cfg.config("p01_gemm_merge").min_group == 4 and cfg.enabled_passes() == ["p01_gemm_merge"]
    # flags override the file
    cfg = pipeline_from_flags(config_file=str(toml), pass_opts=["p01.min_group=2"], enable=["p03"])
    assert cfg.config("p01_gemm_merge").min_group == 2 and cfg.enabled_passes() == cfg.order
    # to_dict/from_dict and a JSON file of the same shape
    js = tmp_path / "passes.json"
    js.write_text(json.dumps(cfg.to_dict()))
    assert PipelineConfig.from_file(str(js)).to_dict() == cfg.to_dict()
    bad = tmp_path / "bad.toml"
    bad.write_text("[passes.p01_gemm_merge]\nmin_group = 'x'\n")
    with pytest.raises(PassConfigError, match="bad.toml: p01_gemm_merge.min_group: expected an integer"):
        pipeline_from_flags(config_file=str(bad))
    bad.write_text("pases = []\n")
    with pytest.raises(PassConfigError, match="unknown key"):
        pipeline_from_flags(config_file=str(bad))
    with pytest.raises(PassConfigError, match=".toml or .json"):
        pipeline_from_flags(config_file=str(_touch(tmp_path / "passes.yaml")))
    with pytest.raises(FileNotFoundError):
        pipeline_from_flags(config_file=str(tmp_path / "missing.toml"))


def _touch(path):
    path.write_text("")
    return path


def test_argparse_helpers():
    parser = argparse.ArgumentParser()
    add_pass_arguments(parser)
    args = parser.parse_args(["--passes", "p01,p02,p04", "--disable-pass", "p02", "--pass-opt", "p01.min_group=3"])
    cfg = pipeline_from_args(args)
    assert cfg.enabled_passes() == ["p01_gemm_merge", "p04_fused_routing"]
    assert cfg.config("p01_gemm_merge").min_group == 3


def test_manager_runs_only_enabled_passes_in_order():
    gm = graph("kimi-linear-tiny", "decode")
    report = PassManager(pipeline_from_flags(passes="p04,p01,p02", disable=["p02"])).run(gm)
    assert [p.name for p in report.passes] == ["p04_fused_routing", "p01_gemm_merge"]
    assert report.skipped == ["p02_noop_views"]
    assert report.verified is False and all(p.max_rel_err is None for p in report.passes)


# ----------------------------------------------------------------------------- broken passes

@pytest.fixture
def test_pass():
    """Register throwaway passes for one test."""
    names = []

    def add(name, fn):
        register_pass(name, PassConfig)(fn)
        names.append(name)
    yield add
    for name in names:
        unregister_pass(name)


def _corrupt_eps(gm, config) -> int:
    """Changes RMSNorm's epsilon in the first norm: a plausible-looking, wrong rewrite."""
    for node in gm.graph.nodes:
        if node.target == aten.add.Tensor and node.args[1] == 1e-5:
            node.args = (node.args[0], 1.0)
            return 1
    return 0


def test_verify_catches_a_broken_pass_and_names_it(test_pass):
    test_pass("p99_corrupt_eps", _corrupt_eps)
    m = model("kimi-linear-tiny")
    gm = graph("kimi-linear-tiny", "decode")
    with pytest.raises(PassVerificationError, match=r"pass p99_corrupt_eps changed the step's results: .*logits"):
        PassManager(pipeline_from_flags(passes="p01,p99_corrupt_eps"), verify=True).run(gm, step_inputs(m, "decode"))
    # without verify the same pass goes through silently: that is what --verify is for
    PassManager(pipeline_from_flags(passes="p99_corrupt_eps")).run(graph("kimi-linear-tiny", "decode"))


def test_code_is_regenerated_only_after_a_pass_changed_the_graph(test_pass, monkeypatch):
    """The manager skips gm.recompile() after a pass that left the graph as it was; an in-place argument edit
    (RMSNorm's epsilon) after such passes still reaches the code the next pass and the verifier run."""
    test_pass("p97_nothing", lambda gm, config: 0)
    test_pass("p98_nothing", lambda gm, config: 0)
    test_pass("p99_corrupt_eps", _corrupt_eps)
    gm = graph("kimi-linear-tiny", "decode")
    recompiles = []
    recompile = torch.fx.GraphModule.recompile
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: recompiles.append(1) or recompile(self))
    PassManager(pipeline_from_flags(passes="p97,p98")).run(gm)
    assert len(recompiles) == 1  # the run's first pass: the code may predate the manager
    m = model("kimi-linear-tiny")
    with pytest.raises(PassVerificationError, match=r"pass p99_corrupt_eps changed the step's results: .*logits"):
        PassManager(pipeline_from_flags(passes="p97,p98,p99_corrupt_eps"), verify=True).run(gm,
                                                                                              step_inputs(m, "decode"))
    assert ", 1.0)" in gm.code


def test_malformed_results_are_pass_errors(test_pass):
    def returns_none(gm, config):
        return None

    def breaks_graph(gm, config):
        node = next(n for n in gm.graph.nodes if n.target == aten.mm.default)
        node.args = (node.args[0], next(n for n in gm.graph.nodes if n.op == "output").prev)  # use before def
        return 1

    def raises(gm, config):
        raise KeyError("boom")

    test_pass("p97_returns_none", returns_none)
    test_pass("p98_breaks_graph", breaks_graph)
    test_pass("p96_raises", raises)
    with pytest.raises(PassError, match="p97_returns_none must return its match count"):
        PassManager(pipeline_from_flags(passes="p97")).run(graph("kimi-linear-tiny", "decode"))
    with pytest.raises(PassError, match="p98_breaks_graph left a malformed graph"):
        PassManager(pipeline_from_flags(passes="p98")).run(graph("kimi-linear-tiny", "decode"))
    with pytest.raises(PassError, match="p96_raises failed: KeyError"):
        PassManager(pipeline_from_flags(passes="p96")).run(graph("kimi-linear-tiny", "decode"))


def test_verify_needs_example_inputs():
    with pytest.raises(ValueError, match="example_inputs"):
        PassManager(verify=True).run(graph("kimi-linear-tiny", "decode"))
