"""P6 fused MoE decode: one k3.fused_moe_decode per MoE layer in decode graphs after P1-P4 (shared
expert folded in where the MoE is full width), none in prefill, the crossover decided and recorded,
MXFP4 experts, the SiTU shared GLU, numerics vs the unpassed graph and the eager model."""
import functools
import operator

import pytest
import torch

from k3compile.capture import capture_step
from k3compile.model_def.init import init_random
from k3compile.model_def.loader import build_model
from k3compile.passes.kernels import moe_decode
from k3compile.passes.manager import PassManager, snapshot
from k3compile.passes.pipeline import PipelineConfig, pipeline_from_flags
from k3compile.passes.registry import PassConfigError
from k3compile.passes.verify import step_inputs

from .helpers import (BF16_TOL, FP32_TOL, MODELS, assert_same_step, eager_step, graph, graph_after, inputs_for,
                      layer_counts, model, op_counts, randomized_inputs, run_graph, run_pass)

aten = torch.ops.aten
P6 = "p06_fused_moe_decode"
BEFORE = ("p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing")
FUSED = torch.ops.k3.fused_moe_decode.default


# the three PDL release options and grouped_sorted (on by default) off: the op keeps the arguments it had before them
RELEASES_OFF = {"early_release": False, "down_early_release": False, "latent_prewait": False, "grouped_sorted": False}


def _after_p1_p4(gm):
    for name in BEFORE:
        run_pass(gm, name)
    return gm


def _fused_nodes(gm):
    return [n for n in gm.graph.nodes if n.target == FUSED]


@pytest.mark.parametrize("name", MODELS)
def test_one_fused_op_per_moe_layer_in_decode(name):
    cfg = model(name).config
    n = layer_counts(cfg)["moe"]
    gm = graph_after(name, "decode", passes=BEFORE)
    before = op_counts(gm)
    assert run_pass(gm, P6, shared_l2_prefetch=False, down_l2_prefetch=False,
                    **RELEASES_OFF) == n  # (the 19 arguments)
    after = op_counts(gm)
    assert after[FUSED] == n and after[torch.ops.k3.moe_experts.default] == 0
    latent = cfg.latent_size is not None
    for node in _fused_nodes(gm):
        (x, ids, wts, w13, w2, s13, s2, shared_in, shared_up, shared_w2, act, beta, linear_beta, crossover, up_w,
         norm_w, eps, use_pdl, shared_w13) = node.args
        assert use_pdl is True  # the config's default (a no-op where PDL is not available); use_pdl=False: off
        assert ids.args[0].target == torch.ops.k3.fused_route.default  # P4's outputs, consumed directly
        assert (act, beta, linear_beta) == (cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        assert s13 is None and s2 is None and crossover == moe_decode.CPU_CROSSOVER
        assert shared_w2.target.endswith("shared_experts_down_proj_weight")
        if latent:  # K3: the latent RMSNorm and up-projection went in too; the shared gate/up (on the hidden
            # state, not the op's latent x) stay columns of P1's merged GEMM
            assert up_w.target.endswith("routed_expert_up_proj_weight") and eps == cfg.rms_norm_eps
            assert norm_w.target.endswith("routed_expert_norm_weight")
            assert shared_up is not None and shared_w13 is None
        else:  # full width: the shared gate/up rows are the op's (kernel A's shared slot)
            assert up_w is None and norm_w is None
            assert shared_in is None and shared_up is None
            assert shared_w13.target.endswith("shared_experts_gate_up_proj_weight")
            assert tuple(gm.get_buffer(shared_w13.target).shape) == (2 * shared_w2.meta["val"].shape[1],
                                                                      x.meta["val"].shape[1])
    # per layer: the shared down GEMM, its t, the combining add and the GLU are gone (SiLU: silu + mul;
    # SiTU: 2 div, 2 tanh, 4 mul, sigmoid); latent: also the norm (pow, mean, add, rsqrt, 2 mul) and up GEMM;
    # full width: the merged GEMM's split and its 3 getitems (fp32: the router's logits stay, one plain GEMM)
    gone = {aten.mm.default: 1, aten.t.default: 1, aten.add.Tensor: 1}
    if not latent:
        gone.update({aten.split_with_sizes.default: 1, operator.getitem: 3})
    gone.update({aten.silu.default: 1, aten.mul.Tensor: 1} if cfg.hidden_act == "silu" else
                {aten.tanh.default: 2, aten.sigmoid.default: 1, aten.div.Tensor: 2, aten.mul.Tensor: 4})
    if latent:
        for op, k in {aten.mm.default: 1, aten.t.default: 1, aten.pow.Tensor_Scalar: 1, aten.mean.dim: 1,
                      aten.add.Tensor: 1, aten.rsqrt.default: 1, aten.mul.Tensor: 2}.items():
            gone[op] = gone.get(op, 0) + k
    for op, k in gone.items():
        assert after[op] == before[op] - k * n, op
    code = gm.code
    assert run_pass(gm, P6) == 0
    assert gm.code == code


@pytest.mark.parametrize("name", MODELS)
def test_prefill_is_left_alone(name):
    gm = graph_after(name, "prefill", passes=BEFORE)
    code = gm.code
    assert run_pass(gm, P6) == 0
    assert gm.code == code


@pytest.mark.parametrize("name,dtype", [("kimi-linear-tiny", torch.float32), ("k3-tiny", torch.bfloat16),
                                        ("kimi-linear-tiny", torch.bfloat16)])
def test_numerics_vs_unpassed_graph_and_eager(name, dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    before, gm = graph_after(name, "decode", dtype, passes=BEFORE), graph_after(name, "decode", dtype, passes=BEFORE)
    assert run_pass(gm, P6) == layer_counts(model(name).config)["moe"]
    x = inputs_for(name, "decode", dtype)
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")
    assert_same_step(got, eager_step(model(name, dtype), "decode", x), tol, "vs eager model")


def test_crossover_from_config_goes_into_the_graph_and_the_report():
    gm = graph_after("kimi-linear-tiny", "decode", passes=BEFORE)
    assert run_pass(gm, P6, crossover_batch=5) == 5
    assert {n.args[13] for n in _fused_nodes(gm)} == {5}
    pipeline = pipeline_from_flags(",".join(BEFORE + (P6,)))
    report = PassManager(pipeline).run(graph("kimi-linear-tiny", "decode"))
    rec = report.passes[-1]
    assert rec.name == P6 and rec.matches == 5
    # on CPU the default is the fixed value, and the report says so
    assert rec.options["crossover_batch"] == moe_decode.CPU_CROSSOVER
    assert rec.options["crossover_source"].startswith("fixed")


def test_default_pipeline_runs_p06_after_p04():
    order = PipelineConfig.default().order
    assert order.index(P6) == order.index("p04_fused_routing") + 1 or \
        order[order.index("p04_fused_routing") + 1].startswith("p05")


@pytest.mark.parametrize("name", MODELS)
def test_disabled_tail_fusion_keeps_the_shared_expert_and_latent_tail(name):
    n = layer_counts(model(name).config)["moe"]
    gm = graph_after(name, "decode", passes=BEFORE)
    before = op_counts(gm)
    assert run_pass(gm, P6, fuse_shared=False, fuse_latent=False) == n
    assert op_counts(gm)[aten.mm.default] == before[aten.mm.default]
    assert all(n.args[9] is None and n.args[14] is None for n in _fused_nodes(gm))


def test_bf16_shared_gate_up_gemm_leaves_the_graph():
    """bf16 (the 48B engine's dtype): the router runs in fp32 apart, so P1's merged GEMM on the MoE input is
    exactly [shared gate; shared up]; its weight becomes the op's shared_w13 as it is (no copy) and the GEMM
    goes: per MoE layer 2 GEMMs (that one and the shared down-projection) fewer."""
    name, n = "kimi-linear-tiny", layer_counts(model("kimi-linear-tiny").config)["moe"]
    gm = graph_after(name, "decode", torch.bfloat16, passes=BEFORE)
    merged = {k for k in gm.meta["k3"]["merged_weights"] if "shared_experts" in k and k.endswith("up_proj")}
    assert len(merged) == n
    before = op_counts(gm)
    assert run_pass(gm, P6) == n
    after = op_counts(gm)
    assert after[aten.mm.default] == before[aten.mm.default] - 2 * n
    assert after[aten.split_with_sizes.default] == before[aten.split_with_sizes.default] - n
    assert {node.args[18].target for node in _fused_nodes(gm)} == merged
    assert set(gm.meta["k3"]["merged_weights"]) >= merged  # P1's provenance of the weight stays


@pytest.mark.parametrize("name,dtype", [("kimi-linear-tiny", torch.float32), ("kimi-linear-tiny", torch.bfloat16)])
def test_shared_gate_up_left_out_keeps_the_gemm(name, dtype):
    gm = graph_after(name, "decode", dtype, passes=BEFORE)
    before = op_counts(gm)
    n = layer_counts(model(name).config)["moe"]
    assert run_pass(gm, P6, fuse_shared_up=False) == n
    assert op_counts(gm)[aten.mm.default] == before[aten.mm.default] - n  # only the shared down GEMM
    assert all(node.args[8] is not None and node.args[18] is None for node in _fused_nodes(gm))


def test_fp32_router_keeps_its_rows_of_the_merged_gemm():
    """fp32: P1 merged [router; shared gate; shared up]; P6 takes the shared rows into a new constant and the
    router's logits come from a GEMM on its own rows again (named as before P1), numerics unchanged."""
    gm = graph_after("kimi-linear-tiny", "decode", passes=BEFORE)
    assert run_pass(gm, P6) == layer_counts(model("kimi-linear-tiny").config)["moe"]
    for node in gm.graph.nodes:
        if node.target == torch.ops.k3.fused_route.default:
            logits = node.args[0]
            assert logits.target == aten.mm.default and logits.args[1].args[0].target.endswith("moe_gate_weight")
    merged = gm.meta["k3"]["merged_weights"]
    for node in _fused_nodes(gm):
        parts = merged[node.args[18].target]
        assert [p["source"].rsplit("_experts_", 1)[1] for p in parts] == ["gate_proj_weight", "up_proj_weight"]
        assert parts[1]["rows"] == [parts[0]["rows"][1], 2 * parts[0]["rows"][1]]
    assert not [k for k in merged if "moe__gate__shared" in k]  # the old merge is gone from the record too


@functools.lru_cache(maxsize=None)
def _small_model(kind: str):
    """3 layers (dense, 2 MoE). 'mxfp4': K3-like with MXFP4 experts; 'situ': Kimi-Linear-like (full width,
    shared expert) with SiTU activations, so the SiTU shared GLU is matched."""
    if kind == "mxfp4":
        cfg = model("k3-tiny").config.replace(name="mxfp4", num_hidden_layers=3, layer_types=("kda", "mla", "kda"),
                                              attn_res_block_size=None, expert_quant="mxfp4")
    else:
        cfg = model("kimi-linear-tiny").config.replace(name="situ", num_hidden_layers=3,
                                                       layer_types=("kda", "mla", "kda"), hidden_act="situ")
    m = build_model(cfg)
    init_random(m, 0)
    return m


def _small_model_on_cuda(kind: str = "situ"):
    """_small_model's weights in a bf16 CUDA copy (the GPU tests' model)."""
    m = _small_model(kind)
    gpu = build_model(m.config)
    gpu.load_state_dict(m.state_dict())
    return gpu.to("cuda", torch.bfloat16)


@pytest.mark.parametrize("kind", ["mxfp4", "situ"])
def test_mxfp4_experts_and_situ_shared_glu(kind):
    m = _small_model(kind)
    captured = capture_step(m, "decode")
    gm, before = _after_p1_p4(snapshot(captured)), _after_p1_p4(captured)
    counts = op_counts(gm)
    assert run_pass(gm, P6) == 2
    after = op_counts(gm)
    fused = _fused_nodes(gm)
    if kind == "mxfp4":
        assert counts[torch.ops.k3.moe_experts_mxfp4.default] == 2
        assert after[torch.ops.k3.moe_experts_mxfp4.default] == 0
        for n in fused:
            assert n.args[3].target.endswith("w13_packed") and n.args[5].target.endswith("w13_scale")
            assert n.args[4].target.endswith("w2_packed") and n.args[6].target.endswith("w2_scale")
    else:  # the SiTU chain (2 div, 2 tanh, 4 mul, sigmoid) of each shared GLU went into the op, its gate/up too
        assert all(n.args[18] is not None for n in fused)
        assert after[aten.tanh.default] == counts[aten.tanh.default] - 4
        assert after[aten.sigmoid.default] == counts[aten.sigmoid.default] - 2
    x = randomized_inputs(step_inputs(m, "decode"), 3)
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), FP32_TOL, f"{kind} vs unpassed graph")
    assert_same_step(got, eager_step(m, "decode", x), FP32_TOL, f"{kind} vs eager")


def test_crossover_flag_and_bad_values():
    pipeline = pipeline_from_flags(P6, pass_opts=[f"{P6}.crossover_batch=12"])
    assert pipeline.config(P6).crossover_batch == 12
    with pytest.raises(PassConfigError, match="crossover_batch must be >= 1"):
        pipeline_from_flags(P6, pass_opts=[f"{P6}.crossover_batch=0"]).validate()


def test_down_split_option_goes_into_the_op_and_bad_values_are_refused():
    """down_split (kernel B''s launch for an A/B of whole engines) becomes the op's last argument; unset, the op keeps
    its 19 arguments and the table decides. On CPU the op computes the reference whatever it says."""
    gm = graph_after("kimi-linear-tiny", "decode", passes=BEFORE)
    before = graph_after("kimi-linear-tiny", "decode", passes=BEFORE)
    assert run_pass(gm, P6, down_split="64x128x4x2x1", shared_l2_prefetch=False, down_l2_prefetch=False,
                    **RELEASES_OFF) == 5
    assert all(len(n.args) == 20 and n.args[19] == [64, 128, 4, 2, 1] for n in _fused_nodes(gm))
    x = inputs_for("kimi-linear-tiny", "decode", torch.float32)
    assert_same_step(run_graph(gm, x), run_graph(before, x), FP32_TOL, "down_split on CPU vs unpassed graph")
    pipeline = pipeline_from_flags(P6, pass_opts=[f"{P6}.down_split=32x256x4"])
    pipeline.validate()
    assert pipeline.config(P6).down_split_values() == [32, 256, 4]
    for bad in ("64x100x4", "64x128", "64x128x4x0", "64x128x4x1x2", "wide"):
        with pytest.raises(PassConfigError, match="down_split"):
            pipeline_from_flags(P6, pass_opts=[f"{P6}.down_split={bad}"]).validate()


def test_l2_prefetch_options_go_into_the_op_after_down_split_and_default_on():
    """shared_l2_prefetch / down_l2_prefetch (kernel A's and B''s shared slot: launch order and L2 prefetch) become the
    op's arguments 20 and 21, after down_split (None when unset); both off, a node has the 19 arguments it had before
    them; both on is the default. On CPU the op computes the reference whatever they say."""
    x = inputs_for("kimi-linear-tiny", "decode", torch.float32)
    before = graph_after("kimi-linear-tiny", "decode", passes=BEFORE)
    want = run_graph(before, x)
    for options, tail in (({"shared_l2_prefetch": False, "down_l2_prefetch": False}, ()), ({}, (None, True, True)),
                          ({"down_l2_prefetch": False}, (None, True)),
                          ({"shared_l2_prefetch": False}, (None, False, True)),
                          ({"shared_l2_prefetch": True, "down_l2_prefetch": True, "down_split": "64x128x4"},
                           ([64, 128, 4], True, True))):
        gm = graph_after("kimi-linear-tiny", "decode", passes=BEFORE)
        assert run_pass(gm, P6, **RELEASES_OFF, **options) == 5  # (the releases: the next test)
        assert all(tuple(n.args[19:]) == tail for n in _fused_nodes(gm)), options
        assert_same_step(run_graph(gm, x), want, FP32_TOL, f"{options} on CPU vs unpassed graph")
    pipeline = pipeline_from_flags(P6, pass_opts=[f"{P6}.shared_l2_prefetch=true", f"{P6}.down_l2_prefetch=on"])
    pipeline.validate()
    assert pipeline.config(P6).shared_l2_prefetch is True and pipeline.config(P6).down_l2_prefetch is True
    assert pipeline_from_flags(P6).config(P6).shared_l2_prefetch is True  # on: traces/h200_s10/call3 (batch 1)


def test_up_launch_goes_into_the_op_after_the_l2_options():
    """up_launch (kernel A's launch, for an A/B of tools/bench_moe11.py's winners) becomes the op's argument 22; unset,
    a node keeps the arguments it had before it. On CPU the op computes the reference whatever it says. Bad launches
    are refused by name; the op's flag_deps is no pass option (it hung a whole engine: traces/h200_s11/call2).
    early_release, down_early_release and latent_prewait (on by default, with PDL) add flag_deps (False) and
    themselves after up_launch."""
    x = inputs_for("kimi-linear-tiny", "decode", torch.float32)
    want = run_graph(graph_after("kimi-linear-tiny", "decode", passes=BEFORE), x)
    off = RELEASES_OFF
    for options, tail in ((off, (None, True, True)),
                          ({**off, "up_launch": "32x256x4"}, (None, True, True, [32, 256, 4])),
                          ({**off, "up_launch": "16X512x8", "shared_l2_prefetch": False},
                           (None, False, True, [16, 512, 8])),
                          ({}, (None, True, True, None, False, True, True, True, True)),  # releases + sorted: defaults
                          ({"down_early_release": False, "latent_prewait": False, "grouped_sorted": False},
                           (None, True, True, None, False, True)),
                          ({"latent_prewait": False, "grouped_sorted": False},
                           (None, True, True, None, False, True, True)),
                          ({"down_early_release": False, "grouped_sorted": False},
                           (None, True, True, None, False, True, False, True)),
                          ({"use_pdl": False}, (None, True, True, None, False, False, False, False, True)),
                          ({"use_pdl": False, "grouped_sorted": False}, (None, True, True))):  # releases need PDL
        gm = graph_after("kimi-linear-tiny", "decode", passes=BEFORE)
        assert run_pass(gm, P6, **options) == 5
        assert all(tuple(n.args[19:]) == tail for n in _fused_nodes(gm)), options
        assert_same_step(run_graph(gm, x), want, FP32_TOL, f"{options} on CPU vs unpassed graph")
    pipeline = pipeline_from_flags(P6, pass_opts=[f"{P6}.up_launch=64x128x8"])
    pipeline.validate()
    assert pipeline.config(P6).up_launch_values() == [64, 128, 8]
    with pytest.raises(PassConfigError, match="flag_deps"):
        pipeline_from_flags(P6, pass_opts=[f"{P6}.flag_deps=true"]).validate()
    for bad, message in (("32x100x4", "up block_k must be a power of two"), ("32x256", "up_launch must be"),
                         ("32x256x3", "up num_warps"), ("wide", "BLOCK_NxBLOCK_Kxnum_warps")):
        with pytest.raises(PassConfigError, match=message):
            pipeline_from_flags(P6, pass_opts=[f"{P6}.up_launch={bad}"]).validate()


@functools.lru_cache(maxsize=None)
def _k3_mini_like():
    """k3-mini-6b's MoE structure at tiny sizes (3 layers: dense, 2 MoE): latent MoE with RMSNorm, SiTU,
    2 shared experts in hidden space whose width (2 x moe_intermediate_size) equals the latent width
    (k3-mini-6b: 2 x 512 = 1024 = latent), unlike k3-tiny (2 x 32 = 64 != latent 32)."""
    from k3compile.model_def.config import get_preset
    big = get_preset("k3-mini-6b")
    assert big.num_shared_experts * big.moe_intermediate_size == big.latent_size != big.hidden_size
    cfg = big.replace(name="k3-mini-like", vocab_size=512, hidden_size=64, num_hidden_layers=3,
                      layer_types=("kda", "mla", "kda"), kda_num_heads=2, kda_head_dim=16, num_attention_heads=2,
                      q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      intermediate_size=128, num_experts=8, num_experts_per_token=2, moe_intermediate_size=16,
                      latent_size=32, attn_res_block_size=4, bos_token_id=256, eos_token_id=257,
                      pad_token_id=258, max_position_embeddings=4096)
    m = build_model(cfg)
    init_random(m, 0)
    return m


def test_k3_mini_like_latent_moe_with_shared_expert():
    m = _k3_mini_like()
    captured = capture_step(m, "decode")
    gm, before = _after_p1_p4(snapshot(captured)), _after_p1_p4(captured)
    assert run_pass(gm, P6) == 2
    fused = _fused_nodes(gm)
    assert len(fused) == 2 and op_counts(gm)[torch.ops.k3.moe_experts.default] == 0
    for n in fused:  # the whole tail went in: latent norm + up-projection and the SiTU shared expert
        assert n.args[14].target.endswith("routed_expert_up_proj_weight")
        assert n.args[15].target.endswith("routed_expert_norm_weight")
        assert n.args[9].target.endswith("shared_experts_down_proj_weight") and n.args[8] is not None
    x = randomized_inputs(step_inputs(m, "decode"), 5)
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), FP32_TOL, "k3-mini-like vs unpassed graph")
    assert_same_step(got, eager_step(m, "decode", x), FP32_TOL, "k3-mini-like vs eager")


def test_latent_prewait_is_the_latent_ops_last_argument():
    """latent_prewait (kernel C's shared expert before its gdc_wait) becomes the op's argument 26 behind
    down_early_release, on every latent MoE layer of the k3-mini-like model; on CPU the op is the reference."""
    m = _k3_mini_like()
    captured = capture_step(m, "decode")
    before = _after_p1_p4(captured)
    x = randomized_inputs(step_inputs(m, "decode"), 6)
    want = run_graph(before, x)
    for options, tail in (({"latent_prewait": False, "down_early_release": False, "grouped_sorted": False},
                           (None, True, True, None, False, True)),
                          ({"down_early_release": False, "grouped_sorted": False},
                           (None, True, True, None, False, True, False, True)),
                          ({"grouped_sorted": False}, (None, True, True, None, False, True, True, True))):  # both on
        gm = _after_p1_p4(snapshot(captured))
        assert run_pass(gm, P6, **options) == 2
        fused = _fused_nodes(gm)
        assert len(fused) == 2 and all(tuple(n.args[19:]) == tail for n in fused), options
        assert all(n.args[14] is not None for n in fused)  # latent MoE: kernel C exists to take the option
        assert_same_step(run_graph(gm, x), want, FP32_TOL, f"{options}: k3-mini-like vs unpassed graph")


def test_crossover_measurement_gets_the_layers_latent_tail_and_shared_width(monkeypatch):
    """The CUDA build measures the op on the layer's weights; that call once left out the latent tail, so
    the op's check refused k3-mini-6b's shared expert ([hidden, Is] vs the latent output width). Timed
    here on CPU with the reference standing in for both paths (the arguments are what is checked)."""
    m = _k3_mini_like()
    moe = m.model.layers[1].block_sparse_moe
    calls, sorted_flags = [], []

    def reference(*args, **kwargs):
        calls.append(args)
        if kwargs:
            sorted_flags.append(kwargs)
        return moe_decode.fused_moe_reference(*args)
    monkeypatch.setattr(moe_decode, "fused_moe_triton", reference)
    monkeypatch.setattr(moe_decode, "fused_moe_grouped", reference)
    monkeypatch.setattr(moe_decode, "_time_us", lambda fn: (fn(), 1.0)[1])
    crossover, timings = moe_decode.measure_crossover(
        moe.experts.w13, moe.experts.w2, shared_w2=moe.shared_experts.down_proj.weight, top_k=2, act="situ",
        dtype=torch.float32, batches=(1, 4), latent_up_w=moe.routed_expert_up_proj.weight,
        latent_norm_w=moe.routed_expert_norm.weight, latent_eps=m.config.rms_norm_eps, grouped_sorted=True)
    assert crossover == 1 and list(timings) == [1] and len(calls) == 2
    assert sorted_flags == [{"grouped_sorted": True, "sorted_finish": False}]  # timed as the op will run it
    assert reference(*calls[0]).shape == (1, m.config.hidden_size)


def test_grouped_sorted_is_the_ops_last_argument():
    """grouped_sorted (the sorted M-tiled experts above the crossover, kernels/moe_sorted.py; on by default since
    traces/h200_s16) becomes the op's argument 27 behind latent_prewait, sorted_finish 28 (only with it),
    routed_l2_prefetch 29 and up_prewait 30 (each only with PDL); off, a node keeps its old arguments. On CPU the op is
    the reference whatever they say."""
    m = _k3_mini_like()
    captured = capture_step(m, "decode")
    x = randomized_inputs(step_inputs(m, "decode"), 7)
    want = run_graph(_after_p1_p4(captured), x)
    for options, tail in (({"grouped_sorted": False}, (None, True, True, None, False, True, True, True)),
                          ({}, (None, True, True, None, False, True, True, True, True)),  # on by default
                          ({**RELEASES_OFF, "grouped_sorted": True},
                           (None, True, True, None, False, False, False, False, True)),
                          ({"sorted_finish": True}, (None, True, True, None, False, True, True, True, True, True)),
                          ({"sorted_finish": True, "grouped_sorted": False},  # finish needs the sorted path
                           (None, True, True, None, False, True, True, True)),
                          ({"routed_l2_prefetch": True},  # B''s routed W2 rows to L2 before its wait (PDL)
                           (None, True, True, None, False, True, True, True, True, False, True)),
                          ({"routed_l2_prefetch": True, "use_pdl": False},
                           (None, True, True, None, False, False, False, False, True)),
                          ({"up_prewait": True},  # kernel A's expert rows before its wait (PDL)
                           (None, True, True, None, False, True, True, True, True, False, False, True)),
                          ({"up_prewait": True, "use_pdl": False},
                           (None, True, True, None, False, False, False, False, True))):
        gm = _after_p1_p4(snapshot(captured))
        assert run_pass(gm, P6, **options) == 2
        assert all(tuple(n.args[19:]) == tail for n in _fused_nodes(gm)), options
        assert_same_step(run_graph(gm, x), want, FP32_TOL, f"{options}: k3-mini-like vs unpassed graph")


def test_layer_the_op_refuses_is_skipped_and_counted(monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("fused_moe_decode: refused for the test")
    monkeypatch.setattr(moe_decode, "check_args", refuse)
    gm = graph_after("k3-tiny", "decode", passes=BEFORE)
    code = gm.code
    report = PassManager(pipeline_from_flags(P6)).run(gm)
    rec = report.passes[-1]
    assert rec.matches == 0 and rec.options["skipped_layers"] == layer_counts(model("k3-tiny").config)["moe"]
    assert gm.code == code


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_k3_mini_like_on_cuda_measures_and_fuses():
    m = _k3_mini_like()
    cfg = m.config
    gpu = build_model(cfg)
    gpu.load_state_dict(m.state_dict())
    gpu = gpu.to("cuda", torch.bfloat16)
    gm, before = _after_p1_p4(capture_step(gpu, "decode")), _after_p1_p4(capture_step(gpu, "decode"))
    assert run_pass(gm, P6) == 2
    x = [t.cuda() if isinstance(t, torch.Tensor) else t for t in randomized_inputs(step_inputs(gpu, "decode"), 5)]
    assert_same_step(run_graph(gm, x), run_graph(before, x), BF16_TOL, "k3-mini-like on CUDA vs unpassed graph")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_k3_mini_like_on_cuda_runs_the_sorted_experts_above_the_crossover():
    """grouped_sorted with crossover 1: every decode batch takes kernels/moe_sorted.py (+ the latent tail and the
    shared expert's k3.glu_act), with and without sorted_finish; the step matches the unpassed graph in bf16."""
    m = _k3_mini_like()
    gpu = build_model(m.config)
    gpu.load_state_dict(m.state_dict())
    gpu = gpu.to("cuda", torch.bfloat16)
    before = _after_p1_p4(capture_step(gpu, "decode"))
    x = [t.cuda() if isinstance(t, torch.Tensor) else t for t in randomized_inputs(step_inputs(gpu, "decode"), 8)]
    want = run_graph(before, x)
    for finish in (False, True):  # sorted_finish: the sum and the latent RMSNorm in one kernel
        gm = _after_p1_p4(capture_step(gpu, "decode"))
        assert run_pass(gm, P6, crossover_batch=1, grouped_sorted=True, sorted_finish=finish) == 2
        assert all(n.args[13] == 1 and n.args[27] is True and n.args[28:] == ((True,) if finish else ())
                   for n in _fused_nodes(gm))
        assert_same_step(run_graph(gm, x), want, BF16_TOL, f"sorted experts (finish {finish}) on CUDA vs unpassed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kimi_like_on_cuda_runs_the_shared_gate_up_in_kernel_a_with_pdl():
    """Full-width MoE (Kimi-Linear-like, SiTU) in bf16 on CUDA: the shared gate/up GEMM leaves the graph, the op
    runs it in kernel A (Triton path: crossover above the batch), PDL on; the step matches the unpassed graph."""
    gpu = _small_model_on_cuda()
    gm, before = _after_p1_p4(capture_step(gpu, "decode")), _after_p1_p4(capture_step(gpu, "decode"))
    mms = op_counts(gm)[aten.mm.default]
    assert run_pass(gm, P6, use_pdl=True, crossover_batch=1 << 20) == 2
    assert op_counts(gm)[aten.mm.default] == mms - 2 * 2  # per MoE layer: the shared gate/up and down GEMMs
    assert all(n.args[17] is True and n.args[18] is not None for n in _fused_nodes(gm))
    x = [t.cuda() if isinstance(t, torch.Tensor) else t for t in randomized_inputs(step_inputs(gpu, "decode"), 5)]
    assert_same_step(run_graph(gm, x), run_graph(before, x), BF16_TOL, "kimi-like on CUDA vs unpassed graph")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kimi_like_on_cuda_with_the_down_split_launch_from_the_config():
    """P6's down_split reaches kernel B' on CUDA (K chunks + prefetch, PDL on): the step matches the unpassed graph."""
    gpu = _small_model_on_cuda()
    gm, before = _after_p1_p4(capture_step(gpu, "decode")), _after_p1_p4(capture_step(gpu, "decode"))
    assert run_pass(gm, P6, use_pdl=True, crossover_batch=1 << 20, down_split="16x32x4x2x1") == 2
    x = [t.cuda() if isinstance(t, torch.Tensor) else t for t in randomized_inputs(step_inputs(gpu, "decode"), 6)]
    assert_same_step(run_graph(gm, x), run_graph(before, x), BF16_TOL, "down_split on CUDA vs unpassed graph")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kimi_like_on_cuda_with_up_launch():
    """P6's up_launch (and the early releases) reach kernel A on CUDA (PDL on, the L2 options at their defaults): with
    either launch, with kernel A releasing B right after its wait, and with the defaults (B' releasing early too,
    latent_prewait on: no latent MoE here), the step matches the unpassed graph."""
    gpu = _small_model_on_cuda()
    before = _after_p1_p4(capture_step(gpu, "decode"))
    x = [t.cuda() if isinstance(t, torch.Tensor) else t for t in randomized_inputs(step_inputs(gpu, "decode"), 8)]
    want = run_graph(before, x)
    off = RELEASES_OFF
    for options, tail in (({**off, "up_launch": "16x64x4"}, ()), ({**off, "up_launch": "32x64x8"}, ()),
                          ({**off, "up_launch": "16x64x4", "early_release": True}, (False, True)),
                          # the defaults: the three releases, and the sorted experts above the crossover (bd3bf3d)
                          ({"up_launch": "16x64x4"}, (False, True, True, True, True))):
        gm = _after_p1_p4(capture_step(gpu, "decode"))
        assert run_pass(gm, P6, use_pdl=True, crossover_batch=1 << 20, **options) == 2
        assert all(tuple(n.args[22]) == tuple(int(v) for v in options["up_launch"].split("x"))
                   and tuple(n.args[23:]) == tail for n in _fused_nodes(gm))
        assert_same_step(run_graph(gm, x), want, BF16_TOL, f"{options} on CUDA vs unpassed graph")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kimi_like_on_cuda_with_the_l2_prefetch_options():
    """P6's shared_l2_prefetch and down_l2_prefetch reach kernels A and B' on CUDA (PDL on): the step computes the
    same bits as with them off, and matches the unpassed graph."""
    gpu = _small_model_on_cuda()
    before = _after_p1_p4(capture_step(gpu, "decode"))
    x = [t.cuda() if isinstance(t, torch.Tensor) else t for t in randomized_inputs(step_inputs(gpu, "decode"), 7)]
    outs = []
    for on in (False, True):
        gm = _after_p1_p4(capture_step(gpu, "decode"))
        assert run_pass(gm, P6, use_pdl=True, crossover_batch=1 << 20, shared_l2_prefetch=on, down_l2_prefetch=on) == 2
        outs.append(run_graph(gm, x))
    (out_off, in_off), (out_on, in_on) = outs
    for i, (off, on) in enumerate(list(zip(out_off, out_on)) + list(zip(in_off, in_on))):
        assert not isinstance(off, torch.Tensor) or torch.equal(off, on), f"tensor {i} differs with the options on"
    assert_same_step(outs[1], run_graph(before, x), BF16_TOL, "L2 prefetch options on CUDA vs unpassed graph")


@pytest.mark.parametrize("name,mode,dtype", [("kimi-linear-tiny", "verify", torch.float32),
                                             ("k3-tiny", "verify", torch.bfloat16),
                                             ("k3-tiny", "verify_snapshot", torch.float32)])
def test_verify_graphs_get_the_fused_op_too(name, mode, dtype):
    """A verify step's MoE sees anchor + drafts per request (a few tokens): one fused op per MoE layer there
    as well, with the verify step's numerics unchanged (window tensors included)."""
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    before, gm = graph_after(name, mode, dtype, passes=BEFORE), graph_after(name, mode, dtype, passes=BEFORE)
    assert run_pass(gm, P6) == layer_counts(model(name).config)["moe"] == len(_fused_nodes(gm))
    x = inputs_for(name, mode, dtype)
    got = run_graph(gm, x)
    assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")
    assert_same_step(got, eager_step(model(name, dtype), mode, x), tol, "vs eager model")
