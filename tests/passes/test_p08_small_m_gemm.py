"""P8 small-M GEMM choice: forced rewrite counts (every 16-bit weight GEMM of the decode graph), numerics
(k3.gemv is the aten call on CPU: bit-identical), 'auto' keeps aten without CUDA and records why, the
engine's graph format stores k3.gemv, the choices reach the pass report; the kernel under the
interpreter and at real shapes on the GPU."""
import pytest
import torch

from k3compile.capture import STEP_INPUTS
from k3compile.engine.graph_io import graph_from_dict, graph_to_dict
from k3compile.passes.kernels import gemv as gemv_kernels
from k3compile.passes.manager import PassManager
from k3compile.passes.pipeline import pipeline_from_flags
from k3compile.passes.registry import PassConfigError, get_pass

from .helpers import MODELS, graph, graph_after, inputs_for, layer_counts, model, op_counts, rel_err, run_graph, run_pass

aten = torch.ops.aten
P8 = "p08_small_m_gemm"
GEMV = torch.ops.k3.gemv.default
BEFORE = ("p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing")


def engine_before(name, mode="decode", dtype=torch.bfloat16):
    return graph_after(name, mode, dtype, BEFORE)


@pytest.mark.parametrize("name", MODELS)
def test_forced_rewrite_takes_every_16bit_weight_gemm(name):
    n = layer_counts(model(name, torch.bfloat16).config)
    gm = engine_before(name)
    before = op_counts(gm)
    want = before[aten.mm.default]  # every mm: the routers' fp32 GEMMs are inside P4's k3.fused_route now
    assert want == {"k3-tiny": 54, "kimi-linear-tiny": 33}[name]
    assert before[torch.ops.k3.fused_route.default] == n["moe"]
    ref = run_graph(gm, inputs_for(name, "decode", torch.bfloat16))
    assert run_pass(gm, P8, choice="gemv") == want
    after = op_counts(gm)
    assert after[GEMV] == want and after[aten.mm.default] == 0
    for node in gm.graph.nodes:
        if node.target == GEMV:
            assert node.args[1].op == "get_attr" and node.args[3] == gemv_kernels.MAX_M
            assert node.args[8] is True  # use_pdl, P8's default
            assert node.args[9] == 4  # num_warps: the default configuration's
    details = gm.meta["k3"]["pass_details"][P8]
    assert details["use_pdl"] is True
    assert [r["choice"] for r in details["nodes"]] == ["gemv"] * want
    got = run_graph(gm, inputs_for(name, "decode", torch.bfloat16))
    for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
        if isinstance(b, torch.Tensor):
            assert rel_err(a, b) == 0.0  # on CPU k3.gemv is the same aten call
    code = gm.code
    assert run_pass(gm, P8, choice="gemv") == 0 and gm.code == code


def test_auto_without_cuda_keeps_aten_and_records_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gm = engine_before("kimi-linear-tiny")
    code = gm.code
    assert run_pass(gm, P8) == 0 and gm.code == code
    nodes = gm.meta["k3"]["pass_details"][P8]["nodes"]
    assert len(nodes) == 33 and {r["choice"] for r in nodes} == {"cublas"}
    assert {(r["N"], r["K"]) for r in nodes} >= {(64, 32)}  # e.g. a KDA o_proj: hidden 64 <- 2 heads x 16


def test_prefill_fp32_and_cublas_are_left_alone():
    for gm, opts in ((graph("kimi-linear-tiny", "prefill", torch.bfloat16), {"choice": "gemv"}),
                     (graph("kimi-linear-tiny", "decode", torch.float32), {"choice": "gemv"}),
                     (engine_before("kimi-linear-tiny"), {"choice": "cublas"})):
        code = gm.code
        assert run_pass(gm, P8, **opts) == 0 and gm.code == code


def test_addmm_is_left_alone_and_c_is_added_after_rounding():
    """k3.gemv's c follows the rounded product (mm then add), which a 16-bit addmm (one rounding) is not."""
    from torch.fx.experimental.proxy_tensor import make_fx
    x, w = torch.randn(3, 32).bfloat16(), torch.randn(24, 32).bfloat16()
    c = torch.randn(3, 24).bfloat16()
    gm = make_fx(lambda x, c: torch.addmm(c, x, w.t()), tracing_mode="symbolic", _allow_non_fake_inputs=True)(x, c)
    gm.meta["k3"] = {"mode": "decode"}
    assert run_pass(gm, P8, choice="gemv") == 0
    for cc in (c, c[0]):
        assert torch.equal(GEMV(x, w, cc, 16, 64, 128, 1), torch.mm(x, w.t()) + cc)


def test_choices_reach_the_pass_report_and_the_engine_graph_format():
    gm = engine_before("kimi-linear-tiny")
    rep = PassManager(pipeline_from_flags("p08_small_m_gemm", pass_opts=["p08_small_m_gemm.choice=gemv"])).run(gm)
    rec = rep.passes[0]
    assert rec.matches == 33 and len(rec.details["nodes"]) == 33
    assert P8 not in gm.meta["k3"].get("pass_details", {})  # moved into the report
    keys = {n.target: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    weights = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    back = graph_from_dict(graph_to_dict(gm, "decode", keys), weights, STEP_INPUTS)
    assert op_counts(back)[GEMV] == 33
    inputs = inputs_for("kimi-linear-tiny", "decode", torch.bfloat16)
    assert torch.equal(run_graph(back, inputs)[0][0], run_graph(gm, inputs)[0][0])


def test_engine_written_before_num_warps_still_loads():
    """An engine graph whose k3.gemv calls have 9 arguments (no num_warps) loads with the schema's default, 4."""
    gm = engine_before("kimi-linear-tiny")
    run_pass(gm, P8, choice="gemv")
    keys = {n.target: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    weights = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    doc = graph_to_dict(gm, "decode", keys)
    old = 0
    for e in doc["nodes"]:
        if e.get("target") == "k3.gemv.default":
            assert len(e["args"]) == 10
            e["args"] = e["args"][:9]
            old += 1
    assert old == 33
    back = graph_from_dict(doc, weights, STEP_INPUTS)
    gemvs = [n for n in back.graph.nodes if n.target == GEMV]
    assert len(gemvs) == 33 and all(len(n.args) == 9 for n in gemvs)
    inputs = inputs_for("kimi-linear-tiny", "decode", torch.bfloat16)
    assert torch.equal(run_graph(back, inputs)[0][0], run_graph(gm, inputs)[0][0])


def test_l2_prefetch_option_reaches_the_nodes_the_report_and_the_engine_format():
    """l2_prefetch_mb: each k3.gemv gets an 11th argument (KiB), recorded per node; without it (the default) the
    nodes keep 10 arguments, as before the option; the op takes it on CPU (the aten call) and in opcheck."""
    gm = engine_before("kimi-linear-tiny")
    assert run_pass(gm, P8, choice="gemv", l2_prefetch_mb=24) == 33
    gemvs = [n for n in gm.graph.nodes if n.target == GEMV]
    assert len(gemvs) == 33 and all(len(n.args) == 11 and n.args[10] == 24 << 10 for n in gemvs)
    assert all(r["l2_prefetch_kb"] == 24 << 10 for r in gm.meta["k3"]["pass_details"][P8]["nodes"])
    keys = {n.target: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    weights = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    back = graph_from_dict(graph_to_dict(gm, "decode", keys), weights, STEP_INPUTS)
    assert [n.args[10] for n in back.graph.nodes if n.target == GEMV] == [24 << 10] * 33
    inputs = inputs_for("kimi-linear-tiny", "decode", torch.bfloat16)
    plain = engine_before("kimi-linear-tiny")
    run_pass(plain, P8, choice="gemv")
    assert all(len(n.args) == 10 for n in plain.graph.nodes if n.target == GEMV)
    assert torch.equal(run_graph(back, inputs)[0][0], run_graph(plain, inputs)[0][0])
    no_pdl = engine_before("kimi-linear-tiny")
    run_pass(no_pdl, P8, choice="gemv", l2_prefetch_mb=24, use_pdl=False)  # the prefetch comes with PDL only
    assert all(len(n.args) == 10 for n in no_pdl.graph.nodes if n.target == GEMV)
    x, w = torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    torch.library.opcheck(GEMV, (x, w, None, 4, 4, 128, 2, gemv_kernels.DESIGNS["rows"], True, 8, 1024))


def test_early_release_option_reaches_the_nodes_the_report_and_the_engine_format():
    """early_release: each k3.gemv gets a 12th argument (True, after l2_prefetch_kb 0), recorded per node and kept
    by the engine format; without PDL (or without the option) the nodes keep 10 arguments."""
    gm = engine_before("kimi-linear-tiny")
    assert run_pass(gm, P8, choice="gemv", early_release="all") == 33
    gemvs = [n for n in gm.graph.nodes if n.target == GEMV]
    assert len(gemvs) == 33 and all(len(n.args) == 12 and n.args[10:] == (0, True) for n in gemvs)
    assert all(r["early_release"] for r in gm.meta["k3"]["pass_details"][P8]["nodes"])
    keys = {n.target: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    weights = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    back = graph_from_dict(graph_to_dict(gm, "decode", keys), weights, STEP_INPUTS)
    assert [n.args[10:] for n in back.graph.nodes if n.target == GEMV] == [(0, True)] * 33
    plain = engine_before("kimi-linear-tiny")
    run_pass(plain, P8, choice="gemv")
    inputs = inputs_for("kimi-linear-tiny", "decode", torch.bfloat16)
    assert torch.equal(run_graph(back, inputs)[0][0], run_graph(plain, inputs)[0][0])
    no_pdl = engine_before("kimi-linear-tiny")
    run_pass(no_pdl, P8, choice="gemv", early_release="all", use_pdl=False)  # a release point needs PDL
    assert all(len(n.args) == 10 for n in no_pdl.graph.nodes if n.target == GEMV)
    x, w = torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    torch.library.opcheck(GEMV, (x, w, None, 4, 4, 128, 2, gemv_kernels.DESIGNS["rows"], True, 8, 0, True))


def test_early_release_except_kda_inputs_skips_the_in_projections():
    """early_release="except_kda_inputs": every GEMV but the KDA layers' in-projections (whose column blocks feed the
    fused KDA kernel) gets the release argument; an unknown value is refused by name."""
    gm = engine_before("kimi-linear-tiny")
    run_pass(gm, "p05_fused_kda_decode")
    n_kda = sum(n.target == torch.ops.k3.fused_kda_decode.default for n in gm.graph.nodes)
    assert n_kda == 4
    assert run_pass(gm, P8, choice="gemv", early_release="except_kda_inputs") > n_kda
    gemvs = [n for n in gm.graph.nodes if n.target == GEMV]
    late = [n for n in gemvs if len(n.args) < 12]
    assert len(late) == n_kda and all(len(n.args) == 12 and n.args[11] is True for n in gemvs if n not in late)
    with pytest.raises(PassConfigError, match="early_release must be one of none, all, except_kda_inputs"):
        pipeline_from_flags(P8, pass_opts=[f"{P8}.early_release=yes"]).validate()


@pytest.mark.parametrize("name, fronts", [("k3-tiny", "moe"), ("kimi-linear-tiny", 0)])
def test_early_release_moe_inputs_takes_only_the_latent_moe_fronts(name, fronts):
    """early_release="moe_inputs": only the GEMVs whose output reaches P6's fused MoE op get the release argument. In
    K3's latent MoE that is each MoE layer's front (the experts' latent down-projection merged with the shared
    expert's gate/up); Kimi-Linear's experts read the hidden state (the norm's output), so no GEMV qualifies."""
    from k3compile.passes.p08_small_m_gemm import _feeds_fused_moe
    from .helpers import UP_TO_P7
    gm = graph_after(name, "decode", torch.bfloat16, UP_TO_P7)
    want = layer_counts(model(name, torch.bfloat16).config)["moe"] if fronts == "moe" else 0
    assert run_pass(gm, P8, choice="gemv", early_release="moe_inputs") > 0
    gemvs = [n for n in gm.graph.nodes if n.target == GEMV]
    early = [n for n in gemvs if len(n.args) >= 12 and n.args[11] is True]
    assert len(early) == want
    assert all(_feeds_fused_moe(n) for n in early) and not any(_feeds_fused_moe(n) for n in gemvs if n not in early)


def test_prefetch_plan_counts_the_leading_programs_the_budget_covers_and_refuses_unaligned_rows():
    w = torch.zeros(64, 256, dtype=torch.bfloat16)  # 512-byte rows
    assert gemv_kernels.prefetch_plan(w, 4, 1, 256, 0) == 0
    assert gemv_kernels.prefetch_plan(w, 4, 1, 256, 1024) == 16  # 1 MiB > the weight: all 16 programs
    assert gemv_kernels.prefetch_plan(w, 4, 2, 128, 1024) == 32  # split K: 16 tiles x 2 splits
    assert gemv_kernels.prefetch_plan(w, 4, 1, 256, 5) == 2  # 5 KiB: two whole 2 KiB slices
    assert gemv_kernels.prefetch_plan(w, 4, 1, 256, 1) == 0  # less than one slice: none
    assert gemv_kernels.prefetch_plan(torch.zeros(64, 252, dtype=torch.bfloat16), 4, 1, 256, 1024) == 0  # 504 B rows
    assert gemv_kernels.prefetch_plan(w.t().contiguous().t(), 4, 1, 256, 1024) == 0  # column-major: not row ranges


def test_auto_times_the_way_the_engine_launches_and_carries_warps(monkeypatch):
    """'auto' with synthetic timings (no GPU): `timing` decides whether candidates are timed with PDL, the rows
    design's warps are candidates, and the chosen warps reach k3.gemv's arguments and the report."""
    from k3compile.passes import p08_small_m_gemm as p8
    calls = []

    def fake_measure(w, buckets, bench_ms, use_pdl=False, rows_warps=(4,), rows_programs=(528,)):
        calls.append((tuple(w.shape), use_pdl, rows_warps, rows_programs))
        rows = gemv_kernels.DESIGNS["rows"]
        return {m: {"cublas_us": 10.0, "gemv_us": {(4, 32, 1, rows, 8): 6.0, (4, 32, 1, rows, 2): 7.0,
                                                   (64, 128, 1, 0, 4): 11.0}} for m in buckets}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "synthetic")
    monkeypatch.setattr(p8, "_measure", fake_measure)
    monkeypatch.setattr(p8, "_MEASURED", {})
    for timing, pdl, want_pdl in (("pdl_chain", True, True), ("alone", True, False), ("pdl_chain", False, False)):
        calls.clear()
        gm = engine_before("kimi-linear-tiny")
        assert run_pass(gm, P8, buckets="1,2,4", timing=timing, use_pdl=pdl, rows_warps="2+8",
                        rows_programs="1056,264+264") == 33
        assert calls and {c[1] for c in calls} == {want_pdl} and {c[2] for c in calls} == {(2, 8)}
        assert {c[3] for c in calls} == {(264, 1056)}  # '+' and ',' both separate; sorted, once each
        assert len(calls) == len({c[0] for c in calls})  # each shape measured once
        for node in gm.graph.nodes:
            if node.target == GEMV:
                assert node.args[3:] == (4, 4, 32, 1, gemv_kernels.DESIGNS["rows"], pdl, 8)
        details = gm.meta["k3"]["pass_details"][P8]
        assert details["timing"] == timing
        rec = details["nodes"][0]
        assert rec["config"] == {"block_n": 4, "block_k": 32, "split_k": 1, "design": "rows", "num_warps": 8}
        assert rec["us"]["1"]["gemv"]["4x32x1x1 w8"] == 6.0


def test_a_shape_is_measured_once_per_process(monkeypatch):
    """Later builds in one process (bench ladder's rungs and variants) reuse a shape's timings; other timing
    options measure again."""
    from k3compile.passes import p08_small_m_gemm as p8
    calls = []

    def fake_measure(w, buckets, bench_ms, use_pdl=False, rows_warps=(4,), rows_programs=(528,)):
        calls.append(tuple(w.shape))
        return {m: {"cublas_us": 10.0, "gemv_us": {(4, 32, 1, gemv_kernels.DESIGNS["rows"], 4): 6.0}} for m in buckets}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "synthetic-memo")
    monkeypatch.setattr(p8, "_measure", fake_measure)
    monkeypatch.setattr(p8, "_MEASURED", {})
    gm = engine_before("kimi-linear-tiny")
    assert run_pass(gm, P8, buckets="1,2") == 33
    first = list(calls)
    assert first and len(first) == len(set(first))
    assert not any(r["measured_earlier"] for r in gm.meta["k3"]["pass_details"][P8]["nodes"][:1])
    gm2 = engine_before("kimi-linear-tiny")
    assert run_pass(gm2, P8, buckets="1,2") == 33 and calls == first  # nothing measured again
    assert all(r["measured_earlier"] for r in gm2.meta["k3"]["pass_details"][P8]["nodes"])
    assert run_pass(engine_before("kimi-linear-tiny"), P8, buckets="1,2", timing="alone") == 33
    assert calls == first + first  # other timing options: measured afresh
    assert run_pass(engine_before("kimi-linear-tiny"), P8, buckets="1,2", rows_programs="528+1056") == 33
    assert calls == first * 3  # other candidates: measured afresh


def test_candidates_and_pruning_of_the_warps_sweep():
    from k3compile.passes.p08_small_m_gemm import _candidates, _pruned
    rows, dot = gemv_kernels.DESIGNS["rows"], gemv_kernels.DESIGNS["dot"]
    cands = _candidates(2304, 4096, 132, (2, 4, 8))
    # the tiles kda8 found best at the 48B KDA shapes are candidates, at every warps asked for
    assert {(4, 1024, 1, rows, w) for w in (2, 4, 8)} <= set(cands)
    assert {(16, 256, 1, rows, w) for w in (2, 4, 8)} <= set(_candidates(12576, 2304, 132, (2, 4, 8)))
    assert {c[4] for c in cands if c[3] == dot} == {4} and len([c for c in cands if c[3] == dot]) == 3
    assert len(cands) == 3 + 2 * 3
    first = {"cublas_us": 9.0, "gemv_us": {c: 10.0 for c in cands}}
    first["gemv_us"][(4, 1024, 1, rows, 8)] = 6.0
    first["gemv_us"][(16, 256, 4, rows, 2)] = 7.0
    kept = _pruned(cands, first)
    assert [c for c in kept if c[3] == rows] == [(4, 1024, 1, rows, 8), (16, 256, 4, rows, 2)]
    assert [c for c in kept if c[3] == dot] == [c for c in cands if c[3] == dot]


def test_rows_programs_add_rows_tiles_at_k3_mini_shapes():
    """k3-mini-6b's 2048-wide GEMVs: the default count (528) gives both rows tiles 1024 programs of one K step; each
    other count adds the tiles with the fewest splits that reach it (1 split at 132, 4 at 1056...)."""
    from k3compile.passes.p08_small_m_gemm import _candidates
    rows = gemv_kernels.DESIGNS["rows"]
    assert gemv_kernels.rows_configs(2048, 2048) == [(4, 1024, 2, rows), (16, 256, 8, rows)]
    assert gemv_kernels.rows_configs(2048, 2048, 132) == [(4, 1024, 1, rows), (16, 256, 2, rows)]
    assert gemv_kernels.rows_configs(2048, 2048, 2112) == [(4, 1024, 2, rows), (16, 256, 8, rows)]  # K caps it
    assert gemv_kernels.rows_configs(3072, 2048, 1056) == [(4, 1024, 2, rows), (16, 256, 8, rows)]
    default = set(_candidates(2048, 2048, 132, (4,)))
    more = set(_candidates(2048, 2048, 132, (4,), (132, 264, 528)))
    assert default < more
    assert more - default == {(4, 1024, 1, rows, 4), (16, 256, 2, rows, 4), (16, 256, 4, rows, 4)}
    assert len(_candidates(2048, 2048, 132, (2, 4), (528, 528))) == len(_candidates(2048, 2048, 132, (2, 4)))


def test_bad_options_are_named():
    spec = get_pass(P8)
    for opts, what in (({"choice": "fast"}, "choice"), ({"buckets": "1,32"}, "buckets"),
                       ({"dtypes": "fp8"}, "dtypes"), ({"buckets": "a"}, "buckets"), ({"timing": "graph"}, "timing"),
                       ({"rows_warps": "3"}, "rows_warps"), ({"rows_warps": "x"}, "rows_warps"),
                       ({"l2_prefetch_mb": -1}, "l2_prefetch_mb"), ({"first_bucket_tol": 1.0}, "first_bucket_tol"),
                       ({"rows_programs": "0"}, "rows_programs"), ({"rows_programs": "a+b"}, "rows_programs"),
                       ({"rows_programs": ""}, "rows_programs"), ({"upper_min_gain": -0.6}, "upper_min_gain"),
                       ({"upper_min_gain": 1.0}, "upper_min_gain")):
        with pytest.raises(PassConfigError, match=what):
            spec.config_cls(**opts).validate()


def test_op_checks_and_opcheck():
    x, w = torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    with pytest.raises(ValueError, match="K = 16"):
        GEMV(torch.randn(2, 8).bfloat16(), w, None, 16, 64, 128, 1)
    with pytest.raises(ValueError, match="max_m"):
        GEMV(x, w, None, 17, 64, 128, 1)
    with pytest.raises(ValueError, match="design must be"):
        GEMV(x, w, None, 4, 4, 128, 1, 7)
    with pytest.raises(ValueError, match="rows design takes at most 4 rows"):
        GEMV(x, w, None, 8, 4, 128, 1, gemv_kernels.DESIGNS["rows"])
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        GEMV(x, w, None, 4, 4, 128, 1, gemv_kernels.DESIGNS["dot"])
    with pytest.raises(ValueError, match="num_warps must be one of"):
        GEMV(x, w, None, 4, 4, 128, 1, gemv_kernels.DESIGNS["rows"], True, 3)
    for args in ((x, w, None, 16, 64, 128, 1), (x, w, torch.randn(8).bfloat16(), 4, 32, 64, 2),
                 (x, w, None, 4, 4, 128, 2, gemv_kernels.DESIGNS["rows"]),
                 (x, w, None, 4, 4, 128, 2, gemv_kernels.DESIGNS["rows"], True, 8)):
        torch.library.opcheck(GEMV, args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", (1, 3, 8, 16))
@pytest.mark.parametrize("n,k", ((2304, 9216), (2304, 4096), (12672, 2304), (163840, 2304)))  # 48B: down,
# o_proj, merged in-proj, lm_head
def test_kernel_at_real_shapes_on_gpu(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (0.02 * torch.randn(n, k, device="cuda", generator=gen)).bfloat16()
    want = gemv_kernels.gemv_reference(x.float(), w.float())
    dot = gemv_kernels.DESIGNS["dot"]
    configs = {(*gemv_kernels.default_config(n, k), dot), (64, 128, 1, dot)}
    if m <= gemv_kernels.ROWS_MAX_M:
        configs |= set(gemv_kernels.rows_configs(n, k))
    for bn, bk, split, design in configs:
        for _ in range(2):  # the split-K counters are reset by each launch
            got = gemv_kernels.gemv_triton(x, w, None, bn, bk, split, design=design)
            assert rel_err(got.float(), want) < 1e-2, (bn, bk, split, design)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", ((2304, 4096), (12576, 2304)))  # 48B KDA o_proj, merged in-proj
def test_warps_candidates_with_pdl_in_a_graph_on_gpu(n, k):
    """Every candidate P8 times at M = 1 (the rows design at each warps count), launched as the engine does (PDL,
    back to back in a CUDA graph, the split-K counters shared), and k3.gemv with the num_warps it records."""
    from k3compile.passes.p08_small_m_gemm import _candidates
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    ws = [(0.02 * torch.randn(n, k, device="cuda", generator=gen)).bfloat16() for _ in range(3)]
    wants = [gemv_kernels.gemv_reference(x.float(), w.float()) for w in ws]
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for bn, bk, split, design, warps in _candidates(n, k, sm, (2, 4, 8)):
        _check_in_a_pdl_graph(x, ws, wants, (bn, bk, split, design, warps))
        got = GEMV(x, ws[0], None, 1, bn, bk, split, design, True, warps)
        assert rel_err(got.float(), wants[0]) < 1e-2, (bn, bk, split, design, warps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", ((2048, 2048), (8336, 2048)))  # k3-mini-6b o_proj, KDA merged in-proj
def test_rows_programs_candidates_at_k3_mini_shapes_in_a_pdl_graph_on_gpu(n, k):
    """The rows tiles `rows_programs` adds (fewer / more K splits than the default), launched as the engine does
    (PDL, back to back in a CUDA graph, split-K counters shared), against the fp32 reference."""
    from k3compile.passes.p08_small_m_gemm import _candidates
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    ws = [(0.02 * torch.randn(n, k, device="cuda", generator=gen)).bfloat16() for _ in range(3)]
    wants = [gemv_kernels.gemv_reference(x.float(), w.float()) for w in ws]
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = gemv_kernels.DESIGNS["rows"]
    cands = [c for c in _candidates(n, k, sm, (4,), (132, 264, 528, 1056)) if c[3] == rows]
    assert len({c[2] for c in cands}) >= 3  # several split counts really are tried
    for cfg in cands:
        _check_in_a_pdl_graph(x, ws, wants, cfg)


def _check_in_a_pdl_graph(x, ws, wants, cfg):
    """One candidate launched as the engine launches it: with PDL, back to back over the weights in a CUDA graph
    (split-K counters shared), replayed twice, each output against its fp32 reference."""
    bn, bk, split, design, warps = cfg

    def chain():
        return [gemv_kernels.gemv_triton(x, w, None, bn, bk, split, num_warps=warps, design=design, use_pdl=True)
                for w in ws]
    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for _ in range(2):
        graph.replay()
        for got, want in zip(outs, wants):
            assert rel_err(got.float(), want) < 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", ((2304, 4096), (12576, 2304)))  # 48B KDA o_proj, merged in-proj
def test_l2_prefetch_and_early_release_give_the_same_bits_in_a_pdl_graph_on_gpu(n, k):
    """With an L2 prefetch before gdc_wait (whole weight, and a budget that covers part of each row), and with the
    release of the next launch right after the wait, every launch P8 may emit computes exactly what it computes
    without them, replayed in a CUDA graph with PDL."""
    from k3compile.passes.p08_small_m_gemm import _candidates
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [(0.02 * torch.randn(n, k, device="cuda", generator=gen)).bfloat16() for _ in range(2)]
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 4):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        want = gemv_kernels.gemv_reference(x.float(), ws[0].float())
        for bn, bk, split, design, warps in _candidates(n, k, sm, (2, 8)):
            if design == gemv_kernels.DESIGNS["rows"] and m > gemv_kernels.ROWS_MAX_M:
                continue
            outs = {}
            # the release point at batch 1 only (each option value is one more Triton compile per candidate)
            for kb, early in ((0, False), (1 << 20, False), (4 << 10, False)) + (((0, True),) if m == 1 else ()):
                def chain(kb=kb, early=early):
                    return [gemv_kernels.gemv_triton(x, w, None, bn, bk, split, num_warps=warps, design=design,
                                                     use_pdl=True, l2_prefetch_kb=kb, early_release=early)
                            for w in ws]
                chain()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    got = chain()
                graph.replay()
                graph.replay()
                outs[kb, early] = got[0].clone()
            for key in outs:  # the prefetch and the release point change when loads happen, not what is summed
                assert torch.equal(outs[0, False], outs[key]), (bn, bk, split, design, key)
            assert rel_err(outs[1 << 20, False].float(), want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("timing", ("pdl_chain", "alone"))
def test_auto_choice_measures_on_gpu(timing):
    gm = engine_before("kimi-linear-tiny")
    run_pass(gm, P8, buckets="1,8", bench_ms=5.0, timing=timing)
    details = gm.meta["k3"]["pass_details"][P8]
    assert details["measured_on"] and details["timing"] == timing
    for r in details["nodes"]:
        assert set(r["us"]) == {"1", "8"} and r["us"]["1"]["cublas"] > 0
        assert (r["choice"] == "gemv") == (r["max_m"] > 0)


def test_decision_rule():
    from k3compile.passes.p08_small_m_gemm import _decide

    def t(cublas, **gemv):  # c<block_n>_<block_k>_<split_k>[_<design>_<warps>]
        return {"cublas_us": cublas, "gemv_us": {tuple(map(int, k[1:].split("_"))): v for k, v in gemv.items()}}
    # config A wins M = 1, 2 and loses at 4 (saves 5 + 4 us); B wins only M = 1 (saves 6): A saves more
    timings = {1: t(10.0, c64_128_1=5.0, c32_256_2=4.0), 2: t(10.0, c64_128_1=6.0, c32_256_2=11.0),
               4: t(10.0, c64_128_1=12.0, c32_256_2=12.0)}
    assert _decide(timings, [1, 2, 4]) == (2, (64, 128, 1))
    # ... unless only the configurations near the fastest at M = 1 compete (first_tol): B
    assert _decide(timings, [1, 2, 4], first_tol=0.03) == (1, (32, 256, 2))
    assert _decide(timings, [1, 2, 4], first_tol=0.3) == (2, (64, 128, 1))  # A is within 30% of B at M = 1
    # a win inside the noise margin is no win
    assert _decide({1: t(10.0, c64_128_1=9.9)}, [1], min_gain=0.03) == (0, None)
    assert _decide({1: t(10.0, c64_128_1=9.9)}, [1], min_gain=0.0) == (1, (64, 128, 1))
    # losing at M = 1 means cuBLAS whatever happens above
    assert _decide({1: t(10.0, c64_128_1=11.0), 2: t(10.0, c64_128_1=1.0)}, [1, 2]) == (0, None)
    # kda8's 48B KDA o_proj with PDL (M = 1): the w8 rows tile wins, another warps count of the same tile is a
    # different candidate; a warps variant pruned above M = 1 (absent there) reaches only M = 1
    o_proj = {1: t(9.19, c4_1024_1_1_8=6.17, c4_1024_1_1_4=6.51, c4_1024_1_1_2=7.48, c64_128_8_0_4=9.13),
              2: t(9.5, c4_1024_1_1_8=8.0, c64_128_8_0_4=9.6)}
    assert _decide(o_proj, [1, 2], min_gain=0.03) == (2, (4, 1024, 1, 1, 8))
    o_proj[2]["gemv_us"][(4, 1024, 1, 1, 8)] = 9.4  # inside the margin at M = 2: reach 1, still the fastest at 1
    assert _decide(o_proj, [1, 2], min_gain=0.03) == (1, (4, 1024, 1, 1, 8))
    # the same shape timed alone (kda8, PDL off): no candidate beats cuBLAS by 3% at M = 1 except w8's 7.90 us
    alone = {1: t(9.19, c4_1024_1_1_8=7.90, c4_1024_1_1_4=9.22, c64_128_8_0_4=9.81)}
    assert _decide(alone, [1], min_gain=0.03) == (1, (4, 1024, 1, 1, 8))
    # in_proj: with PDL 16x256 w4 wins (15.29 < 17.54); alone, the best (64x128x2 dot, 18.35) loses: cuBLAS
    assert _decide({1: t(17.54, c16_256_1_1_4=15.29, c16_256_1_1_2=15.83)}, [1], 0.03) == (1, (16, 256, 1, 1, 4))
    assert _decide({1: t(17.54, c16_256_1_1_4=19.68, c64_128_2_0_4=18.35)}, [1], 0.03) == (0, None)
    # session 9's H200 o_proj in a PDL chain: the dot tile wins M = 1 and 2 by little (9.01, 9.54 vs 9.99, 9.91),
    # the w8 rows tile only M = 1 but by 3.8 us (pruned above): the time saved picks the rows tile
    s9 = {1: t(9.99, c4_1024_1_1_8=6.17, c64_128_8_0_4=9.01), 2: t(9.91, c64_128_8_0_4=9.54),
          4: t(9.88, c64_128_8_0_4=9.66)}
    assert _decide(s9, [1, 2, 4], min_gain=0.03) == (1, (4, 1024, 1, 1, 8))
    # session 13's H200 o_proj (traces/h200_s13/call1): the dot tile 1-4% ahead of cuBLAS at M = 2..8 sums to
    # more saving (4.71 us) than the rows tile's M = 1 win (4.32 us); the first-bucket rule keeps the rows tile
    s13 = {1: t(11.45, c4_1024_1_1_8=7.13, c64_128_8_0_4=9.54), 2: t(10.77, c4_1024_1_1_8=10.58, c64_128_8_0_4=10.08),
           4: t(11.46, c4_1024_1_1_8=22.27, c64_128_8_0_4=10.08), 8: t(11.36, c64_128_8_0_4=10.95),
           16: t(11.33, c64_128_8_0_4=11.01)}
    assert _decide(s13, [1, 2, 4, 8, 16], min_gain=0.03) == (8, (64, 128, 8, 0, 4))
    assert _decide(s13, [1, 2, 4, 8, 16], min_gain=0.03, first_tol=0.03) == (1, (4, 1024, 1, 1, 8))
    # equal savings: the longer reach
    assert _decide({1: t(10.0, c4_1024_1_1_8=7.0, c64_128_8_0_4=8.0), 2: t(10.0, c64_128_8_0_4=9.0)}, [1, 2]) \
        == (2, (64, 128, 8, 0, 4))


# --------------------------------------------------------------------------- upper tier (issue 9, batch 8)

TRACES = __import__("pathlib").Path(__file__).parents[2] / "traces"
RECORDED = ("h200_s12/call2", "h200_s12/call3", "h200_s13/call1", "h200_s13/call2")  # 48B ladders, P8's timings
O_PROJ, DOWN, IN_PROJ, GATE_UP, MLA_IN, LM_HEAD = (2304, 4096), (2304, 9216), (12576, 2304), (18432, 2304), \
    (6720, 2304), (163840, 2304)
SPLIT_DOT, DOT = (64, 128, 8, 0, 4), (64, 128, 1, 0, 4)


def recorded_timings(run: str) -> dict:
    """{(N, K): {M: {"cublas_us", "gemv_us": {config: us}}}} of P8's report in a committed 48B ladder JSON."""
    import json
    doc = json.loads((TRACES / run / "ladder_kimi-linear-48b_bf16.json").read_text())
    out = {}
    for rung in doc["rungs"]:
        for rep in rung.get("pass_reports") or []:
            for p in rep["passes"]:
                for node in p["details"].get("nodes", []) if p["name"] == P8 else []:
                    out.setdefault((node["N"], node["K"]), {int(m): {"cublas_us": t["cublas"], "gemv_us": {
                        (*map(int, lbl.split(" w")[0].split("x")), int(lbl.split(" w")[1])): us
                        for lbl, us in t["gemv"].items()}} for m, t in node["us"].items()})
    return out


# upper tier per run and shape with upper_min_gain -0.03 (the default): (reach, config); None: no upper tier
UPPER_WANT = {
    "h200_s12/call2": {IN_PROJ: (2, DOT), O_PROJ: (16, SPLIT_DOT), GATE_UP: None, DOWN: (16, SPLIT_DOT)},
    "h200_s12/call3": {IN_PROJ: None, O_PROJ: (8, SPLIT_DOT), GATE_UP: (4, DOT), DOWN: (16, SPLIT_DOT)},
    "h200_s13/call1": {IN_PROJ: None, O_PROJ: (16, SPLIT_DOT), GATE_UP: (4, DOT), DOWN: (16, SPLIT_DOT)},
    "h200_s13/call2": {IN_PROJ: (4, DOT), O_PROJ: (16, SPLIT_DOT), GATE_UP: (2, DOT), DOWN: (16, SPLIT_DOT)},
}


@pytest.mark.parametrize("run", RECORDED)
def test_upper_tier_on_recorded_h200_timings(run):
    """On the four committed 48B builds' timings: the first tier is what it is without the option; the upper tier
    runs the o_proj and the dense down (the GEMMs cuBLAS launches as a split-K + reduce pair, 28 a step) in one
    split-K kernel at M = 8 in every run; with the first tier's margin (+3%) the o_proj would fall back to cuBLAS at
    M = 8 in both session-12 runs (cuBLAS's own M = 8 timing there 10.62 / 10.64 us, 11.27-11.36 in session 13)."""
    from k3compile.passes.p08_small_m_gemm import SmallMGemmConfig, _decide_tiers
    timings = recorded_timings(run)
    assert set(timings) == {O_PROJ, DOWN, IN_PROJ, GATE_UP, MLA_IN, LM_HEAD}
    on, off = SmallMGemmConfig(upper_tier=True), SmallMGemmConfig()
    strict = SmallMGemmConfig(upper_tier=True, upper_min_gain=0.03)
    for shape, t in timings.items():
        buckets = sorted(t)
        assert buckets == [1, 2, 4, 8, 16]
        max_m, cfg, upper = _decide_tiers(t, buckets, on)
        assert (max_m, cfg, []) == _decide_tiers(t, buckets, off)
        want = UPPER_WANT[run].get(shape)
        assert upper == ([] if want is None else [(want[0], *want[1])]), shape
        if shape in (O_PROJ, DOWN):
            assert cfg[3] == gemv_kernels.DESIGNS["rows"] and max_m <= 2
            assert gemv_kernels.tier_for(8, max_m, cfg, gemv_kernels.flat_upper(upper)) == (want[0], SPLIT_DOT)
        if shape in (MLA_IN, LM_HEAD):  # cuBLAS-class at M > 1 (or at every M): no upper tier
            assert upper == []
    o_strict = _decide_tiers(timings[O_PROJ], [1, 2, 4, 8, 16], strict)[2]
    assert o_strict == ([(4, *SPLIT_DOT)] if run.startswith("h200_s12") else [(8, *SPLIT_DOT)])


def test_upper_tier_decision_rule():
    from k3compile.passes.p08_small_m_gemm import SmallMGemmConfig, _decide_tiers, _decide_upper

    def t(cublas, **gemv):
        return {"cublas_us": cublas, "gemv_us": {tuple(map(int, k[1:].split("_"))): v for k, v in gemv.items()}}
    rows = (4, 1024, 1, 1, 8)
    timings = {1: t(10.0, c4_1024_1_1_8=6.0, c64_128_8_0_4=9.0), 2: t(10.0, c4_1024_1_1_8=11.0, c64_128_8_0_4=9.0),
               4: t(10.0, c64_128_8_0_4=10.2), 8: t(10.0, c64_128_8_0_4=10.4)}
    on = SmallMGemmConfig(upper_tier=True)
    assert _decide_tiers(timings, [1, 2, 4, 8], SmallMGemmConfig()) == (1, rows, [])
    # above M = 1 the split dot tile: wins 2, within 3% of cuBLAS at 4, 4% behind at 8
    assert _decide_tiers(timings, [1, 2, 4, 8], on) == (1, rows, [(4, 64, 128, 8, 0, 4)])
    assert _decide_upper(timings, [1, 2, 4, 8], 1, 0.03) == (2, (64, 128, 8, 0, 4))
    assert _decide_upper(timings, [1, 2, 4, 8], 1, -0.05) == (8, (64, 128, 8, 0, 4))
    assert _decide_upper(timings, [1, 2, 4, 8], 0, -0.05) == (0, None)  # no first tier (cuBLAS at M = 1): none
    assert _decide_upper(timings, [1, 2], 2, -0.05) == (0, None)  # nothing above the first tier
    # the first tier's own configuration admitted above by the tolerance: one tier with a longer reach
    same = {1: t(10.0, c64_128_8_0_4=6.0), 2: t(10.0, c64_128_8_0_4=10.2), 4: t(10.0, c64_128_8_0_4=11.0)}
    assert _decide_tiers(same, [1, 2, 4], on) == (2, (64, 128, 8, 0, 4), [])
    # losing the first bucket above (beyond the tolerance): cuBLAS above the first tier, as without the option
    assert _decide_tiers({1: t(10.0, c4_1024_1_1_8=6.0), 2: t(10.0, c64_128_8_0_4=10.5)}, [1, 2], on) == (1, rows, [])


def test_upper_tier_reaches_the_nodes_the_report_and_the_engine_format(monkeypatch):
    """upper_tier with the 48B o_proj's recorded timings (session 12 call 2) for every GEMM of kimi-linear-tiny: each
    k3.gemv gets the rows tile up to M = 2 and the split dot tile up to 16 as its 13th argument (after the defaults of
    l2_prefetch_kb and early_release), recorded per node; the engine format keeps it; on CPU the values are the aten
    calls' (bit-identical to the graph without the option); without the option the nodes keep 10 arguments."""
    from k3compile.passes import p08_small_m_gemm as p8
    o_proj = recorded_timings("h200_s12/call2")[O_PROJ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "recorded-s12c2")
    monkeypatch.setattr(p8, "_measure", lambda w, buckets, *a, **k: {m: o_proj[m] for m in buckets})
    monkeypatch.setattr(p8, "_MEASURED", {})
    plain = engine_before("kimi-linear-tiny")
    assert run_pass(plain, P8) == 33
    assert all(len(n.args) == 10 and n.args[3] == 2 for n in plain.graph.nodes if n.target == GEMV)
    gm = engine_before("kimi-linear-tiny")
    assert run_pass(gm, P8, upper_tier=True) == 33
    gemvs = [n for n in gm.graph.nodes if n.target == GEMV]
    assert len(gemvs) == 33
    for n in gemvs:
        assert n.args[3:10] == (2, 4, 1024, 1, gemv_kernels.DESIGNS["rows"], True, 8)
        assert n.args[10:] == (0, False, [16, *SPLIT_DOT])
    recs = gm.meta["k3"]["pass_details"][P8]["nodes"]
    assert all(r["upper"] == [{"max_m": 16, "block_n": 64, "block_k": 128, "split_k": 8, "design": "dot",
                               "num_warps": 4}] for r in recs)
    keys = {n.target: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    weights = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    back = graph_from_dict(graph_to_dict(gm, "decode", keys), weights, STEP_INPUTS)
    assert [n.args[10:] for n in back.graph.nodes if n.target == GEMV] == [(0, False, [16, *SPLIT_DOT])] * 33
    inputs = inputs_for("kimi-linear-tiny", "decode", torch.bfloat16)
    assert torch.equal(run_graph(back, inputs)[0][0], run_graph(plain, inputs)[0][0])
    # with early release: the tier after the release flag
    early = engine_before("kimi-linear-tiny")
    assert run_pass(early, P8, upper_tier=True, early_release="all") == 33
    assert [n.args[10:] for n in early.graph.nodes if n.target == GEMV] == [(0, True, [16, *SPLIT_DOT])] * 33


def test_upper_tiers_of_the_op():
    """k3.gemv's `upper` argument: rows checked by name, the tier per row count (`tier_for`), opcheck with it."""
    rows, dot = gemv_kernels.DESIGNS["rows"], gemv_kernels.DESIGNS["dot"]
    cfg = (4, 1024, 1, rows, 8)
    up = [16, 64, 128, 8, dot, 4]
    assert gemv_kernels.upper_rows(None) == [] and gemv_kernels.upper_rows(up) == [tuple(up)]
    assert [gemv_kernels.tier_for(m, 2, cfg, up) for m in (1, 2, 3, 8, 16, 17)] == \
        [(2, cfg)] * 2 + [(16, tuple(up[1:]))] * 3 + [None]
    assert gemv_kernels.tier_for(3, 2, cfg) is None  # no upper tier: the aten calls above max_m, as before
    two = [4, 64, 128, 8, dot, 4, 8, 32, 256, 4, dot, 4]
    assert gemv_kernels.tier_for(8, 2, cfg, two) == (8, (32, 256, 4, dot, 4))
    x, w = torch.randn(3, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    for bad, what in (([16, 64, 128, 8, dot], "rows of 6"), ([2, 64, 128, 8, dot, 4], "exceed"),
                      ([8, 4, 128, 1, rows, 8], "configuration"), ([8, 8, 128, 1, dot, 4], "powers of two"),
                      ([8, 64, 128, 1, dot, 3], "configuration"), ([17, 64, 128, 1, dot, 4], "configuration"),
                      ([8, 64, 128, 1, dot, 4, 4, 64, 128, 1, dot, 4], "exceed")):
        with pytest.raises(ValueError, match=what):
            GEMV(x, w, None, 2, *cfg[:4], True, 8, 0, False, bad)
    assert torch.equal(GEMV(x, w, None, 2, *cfg[:4], True, 8, 0, False, up), torch.mm(x, w.t()))
    torch.library.opcheck(GEMV, (x, w, None, 2, *cfg[:4], True, 8, 0, False, up))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", (O_PROJ, DOWN))  # 48B: cuBLAS's split-K + reduce pairs at M = 8
def test_upper_tier_launches_in_a_pdl_graph_on_gpu(n, k):
    """k3.gemv with the tiers upper_tier records for these shapes (rows tile to M = 2, split dot tile to 16): each
    row count launches its tier's kernel (the same bits as that configuration launched directly), in a CUDA graph with
    PDL, against the fp32 reference; one kernel per call up to M = 16."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (0.02 * torch.randn(n, k, device="cuda", generator=gen)).bfloat16()
    rows = (4, 1024, 1, gemv_kernels.DESIGNS["rows"], 8)
    upper = [16, *SPLIT_DOT]
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        want = gemv_kernels.gemv_reference(x.float(), w.float())
        bn, bk, split, design, warps = rows if m <= 2 else SPLIT_DOT
        direct = gemv_kernels.gemv_triton(x, w, None, bn, bk, split, num_warps=warps, design=design, use_pdl=True)

        def call():
            return GEMV(x, w, None, 2, *rows[:4], True, rows[4], 0, False, upper)
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = call()
        for _ in range(2):  # split-K counters back at zero after each replay
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(got, direct), m
            assert rel_err(got.float(), want) < 1e-2, m
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, (m, [e.name for e in kernels])
