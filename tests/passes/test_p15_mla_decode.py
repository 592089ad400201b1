"""P15 MLA decode: one prologue (norms + KV write) and one fused attention (W_UV absorbed after it) per
MLA layer in decode graphs, nothing in prefill; K3's q_a norm joins the prologue after P1's merged GEMM; numerics vs
the unpassed graph and the eager model, pools included."""
import pytest
import torch

from k3compile.passes.kernels import mla_absorb, mla_decode, norm_gemv  # noqa: F401  (register torch.ops.k3.*)

from .helpers import (BF16_TOL, FP32_TOL, MODELS, assert_same_step, eager_step, graph, inputs_for, layer_counts, model,
                      op_counts, other_batch, run_graph, run_pass)

aten = torch.ops.aten
P15 = "p15_mla_decode"
PROLOGUE = torch.ops.k3.mla_decode_prologue.default
FUSED = torch.ops.k3.mla_decode_fused.default
FUSED_OUT = torch.ops.k3.mla_decode_fused_out.default
OFF = {"gate_out": False, "q_norm_gemv": False}  # the two K3 folds (on by default) off: the tests of the other options


@pytest.mark.parametrize("name", MODELS)
def test_three_rewrites_per_mla_layer_in_decode(name):
    cfg = model(name).config
    n = layer_counts(cfg)
    gm = graph(name, "decode")
    before = op_counts(gm)
    assert before[torch.ops.k3.kv_write.default] == before[torch.ops.k3.mla_decode.default] == n["mla"]
    assert run_pass(gm, "p01_gemm_merge") > 0  # the merged input GEMM puts q_a next to the kv columns
    assert run_pass(gm, P15, **OFF, absorb_q="cublas") == 3 * n["mla"]
    after = op_counts(gm)
    assert after[PROLOGUE] == after[FUSED_OUT] == n["mla"] and after[FUSED] == 0
    # W_UK's batched GEMM stays, W_UV's and the flatten's copy go
    assert after[aten.bmm.default] == before[aten.bmm.default] - n["mla"]
    assert after[aten.clone.default] == before[aten.clone.default] - n["mla"]
    assert after[torch.ops.k3.kv_write.default] == after[torch.ops.k3.mla_decode.default] == 0
    assert after[aten.cat.default] == before[aten.cat.default] - 2 * n["mla"]
    # kv norm (and K3's q_a norm) gone: 1 or 2 rsqrt per MLA layer
    norms_per_layer = 1 if cfg.q_lora_rank is None else 2
    assert after[aten.rsqrt.default] == before[aten.rsqrt.default] - norms_per_layer * n["mla"]
    for node in gm.graph.nodes:
        if node.target == PROLOGUE:
            assert (node.args[6] is None) == (cfg.q_lora_rank is None)
            assert node.args[2] == 1e-6 and node.args[4] in range(n["mla"])
            assert node.args[9] is True  # PDL is on by default
        if node.target == FUSED_OUT:
            assert node.args[9] is True and node.args[8] == cfg.qk_nope_head_dim
            assert node.args[7].op == "get_attr" and node.args[7].target.endswith("kv_b_proj_weight")
    code = gm.code
    assert run_pass(gm, P15, **OFF, absorb_q="cublas") == 0 and gm.code == code


@pytest.mark.parametrize("name", MODELS)
def test_prefill_is_left_alone(name):
    gm = graph(name, "prefill")
    code = gm.code
    assert run_pass(gm, P15) == 0 and gm.code == code


@pytest.mark.parametrize("name,dtype,merged", [("k3-tiny", torch.float32, True),
                                               ("kimi-linear-tiny", torch.float32, False),
                                               ("k3-tiny", torch.bfloat16, False),
                                               ("kimi-linear-tiny", torch.bfloat16, True)])
def test_numerics_vs_unpassed_graph_and_eager(name, dtype, merged):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    before, gm = graph(name, "decode", dtype), graph(name, "decode", dtype)
    if merged:
        run_pass(gm, "p01_gemm_merge")
    n = layer_counts(model(name).config)["mla"]
    assert run_pass(gm, P15, **OFF, absorb_q="cublas", pdl=not merged) == 3 * n  # either way on CPU
    for x in (inputs_for(name, "decode", dtype), other_batch(model(name, dtype), "decode")):
        got = run_graph(gm, x)
        assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")  # KV pool included
        assert_same_step(got, eager_step(model(name, dtype), "decode", x), tol, "vs eager model")


def test_options_turn_each_half_off():
    gm = graph("kimi-linear-tiny", "decode")
    n = layer_counts(model("kimi-linear-tiny").config)["mla"]
    assert run_pass(gm, P15, **OFF, absorb_q="cublas", attention=False) == n
    assert op_counts(gm)[PROLOGUE] == n and op_counts(gm)[FUSED] == 0
    assert run_pass(gm, P15, **OFF, absorb_q="cublas", prologue=False) == 2 * n
    assert op_counts(gm)[FUSED_OUT] == n
    gm = graph("kimi-linear-tiny", "decode")
    assert run_pass(gm, P15, **OFF, absorb_q="cublas", absorb_out=False) == 2 * n
    assert op_counts(gm)[FUSED] == n and op_counts(gm)[FUSED_OUT] == 0


def test_launch_table_is_recorded_on_every_attention_node_and_checked():
    from k3compile.passes.pipeline import PipelineConfig
    from k3compile.passes.registry import PassConfigError, get_pass
    config_cls = get_pass(P15).config_cls
    gm = graph("kimi-linear-tiny", "decode")
    n = layer_counts(model("kimi-linear-tiny").config)["mla"]
    assert run_pass(gm, P15, **OFF, absorb_q="cublas", launch_table="1:4:8/*:0:0") == 3 * n
    recorded = [node.args[10] for node in gm.graph.nodes if node.target == FUSED_OUT]
    assert recorded == [[1, 4, 8, 1 << 30, 0, 0]] * n
    table = mla_decode.parse_launch_table("1:4:8/*:0:0")
    assert mla_decode.launch_for(1, 16, table) == (4, 8) and mla_decode.launch_for(5, 16, table) == (0, 0)
    assert mla_decode.parse_launch_table(config_cls().launch_table) == mla_decode.LAUNCH_TABLE
    cfg = PipelineConfig.default()
    cfg.set_option(P15, "launch_table", "8:16:64/*:0:128")  # a flag's spelling; the pipeline's dict round-trips
    assert PipelineConfig.from_dict(cfg.to_dict()).config(P15).launch_table == "8:16:64/*:0:128"
    for bad in ("4:0:48", "4:0:64/2:0:64", "4:-1:64", "4:64", "a:b:c", "*:0:64/8:0:64"):
        cfg = config_cls(launch_table=bad)
        with pytest.raises(PassConfigError, match="launch table"):
            cfg.validate()


ABSORB_Q = torch.ops.k3.mla_absorb_q.default


@pytest.mark.parametrize("name,dtype", [("kimi-linear-tiny", torch.float32), ("k3-tiny", torch.bfloat16)])
def test_absorb_q_triton_replaces_w_uks_batched_gemm(name, dtype):
    """absorb_q="triton": a fourth rewrite per MLA layer, W_UK's bmm (and its views) -> k3.mla_absorb_q reading the
    query's nope columns in place; the default leaves the bmm; numerics vs the unpassed graph and the eager model."""
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    cfg = model(name).config
    n = layer_counts(cfg)["mla"]
    before, gm = graph(name, "decode", dtype), graph(name, "decode", dtype)
    bmm_before = op_counts(before)[aten.bmm.default]
    assert run_pass(gm, P15, **OFF, absorb_q="triton") == 4 * n
    after = op_counts(gm)
    assert after[ABSORB_Q] == after[FUSED_OUT] == n and after[aten.bmm.default] == bmm_before - 2 * n
    for node in gm.graph.nodes:
        if node.target == ABSORB_Q:
            q, w, nope, pdl = node.args
            assert nope == cfg.qk_nope_head_dim and pdl is True
            assert w.op == "get_attr" and w.target.endswith("kv_b_proj_weight")
            assert tuple(q.meta["val"].shape[1:]) == (cfg.num_attention_heads, nope)
            assert [u.target for u in node.users] == [FUSED_OUT]
    code = gm.code
    assert run_pass(gm, P15, **OFF, absorb_q="triton") == 0 and gm.code == code
    for x in (inputs_for(name, "decode", dtype), other_batch(model(name, dtype), "decode")):
        got = run_graph(gm, x)
        assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")
        assert_same_step(got, eager_step(model(name, dtype), "decode", x), tol, "vs eager model")


def test_prefetch_w_uv_is_recorded_only_when_on_and_absorb_q_is_checked():
    from k3compile.passes.registry import PassConfigError, get_pass
    n = layer_counts(model("kimi-linear-tiny").config)["mla"]
    gm = graph("kimi-linear-tiny", "decode")
    assert run_pass(gm, P15, **OFF, absorb_q="cublas") == 3 * n
    assert [len(node.args) for node in gm.graph.nodes if node.target == FUSED_OUT] == [11] * n  # as engines before
    gm = graph("kimi-linear-tiny", "decode")
    assert run_pass(gm, P15, **OFF, absorb_q="cublas", prefetch_w_uv=True) == 3 * n
    assert [node.args[11] for node in gm.graph.nodes if node.target == FUSED_OUT] == [True] * n
    gm = graph("kimi-linear-tiny", "decode")
    # the prefetch only ever runs under PDL
    assert run_pass(gm, P15, **OFF, absorb_q="cublas", prefetch_w_uv=True, pdl=False) == 3 * n
    assert [len(node.args) for node in gm.graph.nodes if node.target == FUSED_OUT] == [11] * n
    assert get_pass(P15).config_cls().absorb_q == "fold"  # the default since traces/h200_s10/call3
    with pytest.raises(PassConfigError, match="absorb_q"):
        get_pass(P15).config_cls(absorb_q="cutlass").validate()


@pytest.mark.parametrize("name", MODELS)
def test_w_uv_max_tokens_is_recorded_only_when_it_differs_and_checked(name):
    """w_uv_max_tokens=4 (not the default, 8): every k3.mla_decode_fused_out gets it as its 14th argument
    (launch_table, prefetch_w and a gate kept or spelled out as the op's defaults), same match count; the default
    leaves the arguments engines had; the engine format keeps it; on CPU the op is the reference: the same bits as without it."""
    from k3compile.capture import STEP_INPUTS
    from k3compile.engine.graph_io import graph_from_dict, graph_to_dict
    from k3compile.passes.registry import PassConfigError, get_pass
    cfg = model(name).config
    n = layer_counts(cfg)["mla"]
    gated = n if cfg.mla_output_gate else 0
    folded = n if cfg.q_lora_rank is None else 0
    want = 4 * n + gated + (n - folded)  # prologue, W_UK, attention, W_UV (+ gate, + K3's q norm into the GEMV)
    plain, gm = graph(name, "decode", torch.bfloat16), graph(name, "decode", torch.bfloat16)
    for g in (plain, gm):
        run_pass(g, "p01_gemm_merge")
        run_pass(g, "p08_small_m_gemm", choice="gemv")
    assert get_pass(P15).config_cls().w_uv_max_tokens == mla_decode.OUT_MAX_TOKENS == 8
    assert run_pass(plain, P15) == want and run_pass(gm, P15, w_uv_max_tokens=4) == want
    outs = [node for node in gm.graph.nodes if node.target == FUSED_OUT]
    plain_outs = [node for node in plain.graph.nodes if node.target == FUSED_OUT]
    assert len(outs) == len(plain_outs) == n
    for node, ref in zip(outs, plain_outs):
        assert len(ref.args) in (11, 13) and len(node.args) == 14 and node.args[13] == 4
        assert node.args[11] is False and (node.args[12] is None) == (not gated)
        consts = [[a for a in nd.args[:11] if not isinstance(a, torch.fx.Node)] for nd in (node, ref)]
        assert consts[0] == consts[1]  # layer, scale, nope, pdl, launch_table as without the option
    keys = {nd.target: nd.target for nd in gm.graph.nodes if nd.op == "get_attr"}
    weights = {nd.target: getattr(gm, nd.target) for nd in gm.graph.nodes if nd.op == "get_attr"}
    back = graph_from_dict(graph_to_dict(gm, "decode", keys), weights, STEP_INPUTS)
    assert [nd.args[13] for nd in back.graph.nodes if nd.target == FUSED_OUT] == [4] * n
    x = inputs_for(name, "decode", torch.bfloat16)
    assert_same_step(run_graph(back, x), run_graph(plain, x), 0.0, "vs the default bound")
    for bad in (-1, 65):
        with pytest.raises(PassConfigError, match="w_uv_max_tokens"):
            get_pass(P15).config_cls(w_uv_max_tokens=bad).validate()


PROLOGUE_ABSORB = torch.ops.k3.mla_decode_prologue_absorb.default


@pytest.mark.parametrize("name,dtype,merged", [("kimi-linear-tiny", torch.float32, False),
                                               ("kimi-linear-tiny", torch.bfloat16, True),
                                               ("k3-tiny", torch.float32, True)])
def test_absorb_q_fold_joins_the_prologue_without_q_lora(name, dtype, merged):
    """absorb_q="fold": Kimi Linear's prologue and W_UK absorption become one k3.mla_decode_prologue_absorb per MLA
    layer (same 4 matches); K3's query comes out of the prologue's q_a norm, so it keeps the two ops; numerics."""
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    cfg = model(name).config
    n = layer_counts(cfg)["mla"]
    before, gm = graph(name, "decode", dtype), graph(name, "decode", dtype)
    if merged:
        run_pass(gm, "p01_gemm_merge")
    assert run_pass(gm, P15, **OFF, absorb_q="fold") == 4 * n
    after = op_counts(gm)
    folded = n if cfg.q_lora_rank is None else 0
    assert after[PROLOGUE_ABSORB] == folded and after[ABSORB_Q] == after[PROLOGUE] == n - folded
    for node in gm.graph.nodes:
        if node.target == PROLOGUE_ABSORB:
            assert node.args[4] in range(n) and node.args[8] == cfg.qk_nope_head_dim and node.args[9] is True
            assert [u.target for u in node.users] == [FUSED_OUT]
    for x in (inputs_for(name, "decode", dtype), other_batch(model(name, dtype), "decode")):
        got = run_graph(gm, x)
        assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")  # KV pool included
        assert_same_step(got, eager_step(model(name, dtype), "decode", x), tol, "vs eager model")


@pytest.mark.parametrize("name,dtype,merged", [("k3-tiny", torch.float32, True), ("k3-tiny", torch.bfloat16, False),
                                               ("kimi-linear-tiny", torch.bfloat16, True)])
def test_gate_out_folds_the_output_gate_into_the_merge(name, dtype, merged):
    """gate_out=True: K3's o * sigmoid(g) after each fused attention becomes the op's gate argument (one more match
    per gated MLA layer, its sigmoid and product gone); Kimi Linear has no output gate (0 more); on by default;
    numerics vs the unpassed graph and the eager model (the gate's rounding as the unfused ops')."""
    from k3compile.passes.registry import get_pass
    assert get_pass(P15).config_cls().gate_out is True
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    cfg = model(name).config
    n = layer_counts(cfg)["mla"]
    gated = n if cfg.mla_output_gate else 0
    before, gm, plain = (graph(name, "decode", dtype) for _ in range(3))
    if merged:
        run_pass(gm, "p01_gemm_merge")
        run_pass(plain, "p01_gemm_merge")
    assert run_pass(plain, P15, **OFF) == 4 * n
    assert run_pass(gm, P15, gate_out=True) == 4 * n + gated
    counts, plain_counts = op_counts(gm), op_counts(plain)
    assert counts[FUSED_OUT] == n
    assert counts[aten.sigmoid.default] == plain_counts[aten.sigmoid.default] - gated
    assert counts[aten.mul.Tensor] == plain_counts[aten.mul.Tensor] - gated
    gates = [node.args[12] for node in gm.graph.nodes if node.target == FUSED_OUT and len(node.args) > 12]
    assert len(gates) == gated
    for g in gates:
        assert tuple(g.meta["val"].shape[1:]) == (cfg.num_attention_heads * cfg.v_head_dim,)
    for node in gm.graph.nodes:
        if node.target == FUSED_OUT:  # ungated: the arguments engines had before; gated: prefetch_w spelled out
            assert len(node.args) == 11 if not gated else node.args[11] is False
    code = gm.code
    assert run_pass(gm, P15, gate_out=True) == 0 and gm.code == code
    for x in (inputs_for(name, "decode", dtype), other_batch(model(name, dtype), "decode")):
        got = run_graph(gm, x)
        assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")  # KV pool included
        assert_same_step(got, eager_step(model(name, dtype), "decode", x), tol, "vs eager model")
        # on CPU the op runs the reference, the very ops it replaced: the same bits
        assert_same_step(got, run_graph(plain, x), 0.0, "vs P15 without gate_out")


NORM_GEMV = torch.ops.k3.norm_gemv.default


@pytest.mark.parametrize("name,dtype", [("k3-tiny", torch.float32), ("k3-tiny", torch.bfloat16),
                                        ("kimi-linear-tiny", torch.bfloat16)])
def test_q_norm_gemv_moves_the_q_lora_norm_into_the_query_gemv(name, dtype):  # fp32: P8 leaves cuBLAS, 0 moved
    """q_norm_gemv=True after P1 and P8 (choice gemv): K3's q_a norm leaves the prologue for a k3.norm_gemv in place of
    the q_b k3.gemv (one more match per MLA layer), so absorb_q="fold" joins the prologue and W_UK's absorption as in
    Kimi Linear (no q-LoRA: nothing to move, 0 more); on by default; numerics vs the unpassed graph and eager."""
    from k3compile.passes.registry import get_pass
    assert get_pass(P15).config_cls().q_norm_gemv is True
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    cfg = model(name).config
    n = layer_counts(cfg)["mla"]
    moved = n if cfg.q_lora_rank is not None and dtype != torch.float32 else 0
    before, gm = graph(name, "decode", dtype), graph(name, "decode", dtype)
    run_pass(gm, "p01_gemm_merge")
    run_pass(gm, "p08_small_m_gemm", choice="gemv")
    gemvs = op_counts(gm)[torch.ops.k3.gemv.default]
    assert run_pass(gm, P15, q_norm_gemv=True, gate_out=True) == 4 * n + moved + (n if cfg.mla_output_gate else 0)
    after = op_counts(gm)
    assert after[NORM_GEMV] == moved and after[torch.ops.k3.gemv.default] == gemvs - moved
    folded = n if moved or cfg.q_lora_rank is None else 0
    assert after[PROLOGUE_ABSORB] == folded and after[PROLOGUE] == after[ABSORB_Q] == n - folded
    for node in gm.graph.nodes:
        if node.target == NORM_GEMV:  # the q_a column block, no delta, the q_a norm's weight, P8's configuration
            assert node.args[1] is None and node.args[2].target.endswith("q_a_layernorm_weight")
            assert node.args[4].target.endswith("q_b_proj_weight")
    code = gm.code
    assert run_pass(gm, P15, q_norm_gemv=True, gate_out=True) == 0 and gm.code == code
    for x in (inputs_for(name, "decode", dtype), other_batch(model(name, dtype), "decode")):
        got = run_graph(gm, x)
        assert_same_step(got, run_graph(before, x), tol, "vs unpassed graph")  # KV pool included
        assert_same_step(got, eager_step(model(name, dtype), "decode", x), tol, "vs eager model")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("launch", [(16, 64, 128, 1, 0, True, 4), (4, 16, 256, 1, 1, True, 4),
                                    (16, 64, 128, 2, 0, True, 4)])  # dot, rows, dot split-K 2
def test_cuda_q_norm_gemv_matches_prologue_then_gemv_at_k3_mini_shape(tokens, launch):
    """q_norm_gemv's pair at k3-mini-6b's MLA shape (q_lora 768 -> 16 heads x 192, kv 512 + 64) with PDL: the KV half
    of the prologue writes the same cache rows, and norm_gemv on the q_a column block equals the prologue's q_a norm
    then k3.gemv within bf16 rounding."""
    gen = torch.Generator().manual_seed(tokens)
    merged = torch.randn(tokens, 768 + 576 + 16 * 128, generator=gen).bfloat16().cuda()  # [q_a | ckv | gate]
    q_a, ckv = merged[:, :768], merged[:, 768: 768 + 576]
    w_kv, w_q = (1 + 0.1 * torch.randn(512, generator=gen)).bfloat16().cuda(), \
        (1 + 0.1 * torch.randn(768, generator=gen)).bfloat16().cuda()
    w_qb = (torch.randn(16 * 192, 768, generator=gen) * 768 ** -0.5).bfloat16().cuda()
    kv = torch.zeros(tokens * 2 + 1, 2, 16, 576, dtype=torch.bfloat16, device="cuda")
    kv_ref = kv.clone()
    loc = (torch.randperm(tokens * 16, generator=gen)[:tokens] + 16).cuda()
    q_normed = PROLOGUE(ckv, w_kv, 1e-6, kv_ref, 1, loc, q_a, w_q, 1e-6, True)
    want = torch.ops.k3.gemv(q_normed, w_qb, None, *launch)
    empty = PROLOGUE(ckv, w_kv, 1e-6, kv, 1, loc, None, None, 0.0, True)
    got, _ = NORM_GEMV(q_a, None, w_q, 1e-6, w_qb, None, *launch, 16)
    torch.cuda.synchronize()
    assert empty.numel() == 0 and torch.equal(kv, kv_ref)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert got.shape == (tokens, 16 * 192) and err <= 1e-2
