"""P1 horizontal GEMM merge: exact matches per layer kind, what each group holds, weights, numerics."""
import pytest
import torch

from k3compile.passes.pipeline import PipelineConfig
from k3compile.passes.registry import PassConfigError

from .helpers import (BF16_TOL, FP32_TOL, MODELS, MODES, assert_same_step, eager_step, graph, inputs_for,
                      layer_counts, model, op_counts, other_batch, run_graph, run_pass)

aten = torch.ops.aten
P1 = "p01_gemm_merge"


def _group_sizes(cfg, dtype) -> dict:
    """GEMMs merged per layer kind, from the config."""
    mla = 2 + (1 if cfg.mla_output_gate else 0)  # q_a (or q) + kv_a (+ output gate)
    moe = (1 if dtype == torch.float32 else 0) + (1 if cfg.latent_size else 0) + (2 if cfg.num_shared_experts else 0)
    return {"kda": 6, "mla": mla, "moe": moe, "dense": 2}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", MODES)
def test_counts_nodes_launches_fp32(name, mode):
    gm = graph(name, mode)
    cfg = model(name).config
    n = layer_counts(cfg)
    sizes = _group_sizes(cfg, torch.float32)
    mm0, nodes0 = op_counts(gm)[aten.mm.default], len(gm.graph.nodes)

    matches = run_pass(gm, P1)

    assert matches == n["kda"] + n["mla"] + n["moe"] + n["dense"]
    merged_away = sum(n[kind] * (sizes[kind] - 1) for kind in sizes)
    assert op_counts(gm)[aten.mm.default] == mm0 - merged_away
    # per group of k: -k mm, -k t, -k get_attr; +1 get_attr, t, mm, split and k getitems
    assert len(gm.graph.nodes) == nodes0 + sum(n[kind] * (4 - 2 * sizes[kind]) for kind in sizes)
    assert op_counts(gm)[aten.split_with_sizes.default] == matches


def _is_router(mm) -> bool:
    """mm(x.float(), t(W_gate.float())): the fp32 router GEMM of a bf16 model."""
    cast = mm.args[1].args[0]
    return cast.target == aten._to_copy.default and cast.args[0].target.endswith("_gate_weight")


@pytest.mark.parametrize("name,mode", [("k3-tiny", "decode"), ("kimi-linear-tiny", "prefill")])
def test_bf16_router_stays_separate_but_moe_front_still_merges(name, mode):
    gm = graph(name, mode, torch.bfloat16)
    cfg = model(name, torch.bfloat16).config
    n = layer_counts(cfg)
    assert run_pass(gm, P1) == n["kda"] + n["mla"] + n["moe"] + n["dense"]
    groups = gm.meta["k3"]["merged_weights"]
    assert not any("gate_weight" in part["source"] for parts in groups.values() for part in parts)
    router_mms = [m for m in gm.graph.nodes if m.target == aten.mm.default and _is_router(m)]
    assert len(router_mms) == n["moe"]
    assert all(m.meta["val"].dtype == torch.float32 for m in router_mms)


def test_groups_hold_the_expected_projections():
    gm = graph("k3-tiny", "decode")
    run_pass(gm, P1)
    groups = {k: [p["source"].removeprefix(k.split("__")[0] + "_") for p in v]
              for k, v in gm.meta["k3"]["merged_weights"].items()}
    assert groups["w_model_layers_0_self_attn__q_proj__k_proj__v_proj__f_a_proj__b_proj__g_proj"] == [
        "q_proj_weight", "k_proj_weight", "v_proj_weight", "f_a_proj_weight", "b_proj_weight", "g_proj_weight"]
    assert groups["w_model_layers_3_self_attn__q_a_proj__kv_a_proj_with_mqa__g_proj"] == [
        "q_a_proj_weight", "kv_a_proj_with_mqa_weight", "g_proj_weight"]
    assert groups["w_model_layers_1_block_sparse_moe__gate__routed_expert_down_proj__shared_experts_gate_proj"
                  "__shared_experts_up_proj"] == ["gate_weight", "routed_expert_down_proj_weight",
                                                  "shared_experts_gate_proj_weight", "shared_experts_up_proj_weight"]
    assert groups["w_model_layers_0_mlp__gate_proj__up_proj"] == ["gate_proj_weight", "up_proj_weight"]

    kimi = graph("kimi-linear-tiny", "prefill")
    run_pass(kimi, P1)
    names = list(kimi.meta["k3"]["merged_weights"])
    assert "w_model_layers_0_self_attn__q_proj__k_proj__v_proj__f_a_proj__b_proj__g_a_proj" in names
    assert "w_model_layers_3_self_attn__q_proj__kv_a_proj_with_mqa" in names  # no q-LoRA, no output gate
    assert "w_model_layers_1_block_sparse_moe__gate__shared_experts_gate_proj__shared_experts_up_proj" in names


def test_merged_weights_are_the_concatenation_and_originals_are_gone():
    m = model("k3-tiny")
    gm = graph("k3-tiny", "decode")
    run_pass(gm, P1)
    params = {"w_" + k.replace(".", "_"): v for k, v in m.named_parameters()}
    for merged, parts in gm.meta["k3"]["merged_weights"].items():
        w = getattr(gm, merged)
        for part in parts:
            lo, hi = part["rows"]
            assert torch.equal(w[lo:hi], params[part["source"]])
            assert not hasattr(gm, part["source"]), f"{part['source']} should have been removed"
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert set(gm.meta["k3"]["merged_weights"]) <= used


@pytest.mark.parametrize("name,mode,dtype", [("k3-tiny", "decode", torch.float32),
                                             ("kimi-linear-tiny", "prefill", torch.float32),
                                             ("k3-tiny", "decode", torch.bfloat16)])
def test_numerics_vs_unpassed_graph_and_eager_model(name, mode, dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    before, gm = graph(name, mode, dtype), graph(name, mode, dtype)
    run_pass(gm, P1)
    x = inputs_for(name, mode, dtype)
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")
    assert_same_step(got, eager_step(model(name, dtype), mode, x), tol, "vs eager model")


def test_stays_symbolic_other_batch_size():
    m = model("kimi-linear-tiny")
    gm = graph("kimi-linear-tiny", "decode")
    run_pass(gm, P1)
    x = other_batch(m, "decode")
    assert_same_step(run_graph(gm, x), eager_step(m, "decode", x), FP32_TOL, "5-request decode")


def test_nothing_to_match_returns_zero_and_changes_nothing():
    gm = graph("kimi-linear-tiny", "decode")
    run_pass(gm, P1)
    code = gm.code
    assert run_pass(gm, P1) == 0  # every group is already one GEMM
    assert gm.code == code
    fresh = graph("kimi-linear-tiny", "decode")
    code = fresh.code
    assert run_pass(fresh, P1, min_group=7) == 0  # no layer has 7 GEMMs on one input
    assert fresh.code == code


def test_min_group_option():
    gm = graph("k3-tiny", "prefill")
    n = layer_counts(model("k3-tiny").config)
    assert run_pass(gm, P1, min_group=4) == n["kda"] + n["moe"]  # only groups of 6 and 4 remain eligible
    with pytest.raises(PassConfigError, match="min_group"):
        cfg = PipelineConfig.default()
        cfg.set_option(P1, "min_group", "1")
        cfg.validate()
