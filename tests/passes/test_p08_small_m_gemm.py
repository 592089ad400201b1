"""P8 small-M GEMM choice: forced rewrite counts (every 16-bit weight GEMM of the decode graph), numerics
(k3.gemv is the aten call on CPU: bit-identical), 'auto' keeps aten without CUDA and records why, the
engine's graph format stores k3.gemv, the choices reach the pass report; the kernel under the
interpreter and at real shapes on the GPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3compile.capture import STEP_INPUTS
from k3compile.engine.graph_io import graph_from_dict, graph_to_dict
from k3compile.passes.kernels import gemv as gemv_kernels
from k3compile.passes.manager import PassManager
from k3compile.passes.pipeline import pipeline_from_flags
from k3compile.passes.registry import PassConfigError, get_pass

from .helpers import MODELS, graph, inputs_for, layer_counts, model, op_counts, rel_err, run_graph, run_pass

aten = torch.ops.aten
P8 = "p08_small_m_gemm"
GEMV = torch.ops.k3.gemv.default
BEFORE = ("p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing")


def engine_before(name, mode="decode", dtype=torch.bfloat16):
    gm = graph(name, mode, dtype)
    for p in BEFORE:
        run_pass(gm, p)
    return gm


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
    rep = PassManager(pipeline_from_flags("p08", pass_opts=["p08.choice=gemv"])).run(gm)
    rec = rep.passes[0]
    assert rec.matches == 33 and len(rec.details["nodes"]) == 33
    assert P8 not in gm.meta["k3"].get("pass_details", {})  # moved into the report
    keys = {n.target: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    weights = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    back = graph_from_dict(graph_to_dict(gm, "decode", keys), weights, STEP_INPUTS)
    assert op_counts(back)[GEMV] == 33
    inputs = inputs_for("kimi-linear-tiny", "decode", torch.bfloat16)
    assert torch.equal(run_graph(back, inputs)[0][0], run_graph(gm, inputs)[0][0])


def test_bad_options_are_named():
    spec = get_pass(P8)
    for opts, what in (({"choice": "fast"}, "choice"), ({"buckets": "1,32"}, "buckets"),
                       ({"dtypes": "fp8"}, "dtypes"), ({"buckets": "a"}, "buckets")):
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
    for args in ((x, w, None, 16, 64, 128, 1), (x, w, torch.randn(8).bfloat16(), 4, 32, 64, 2),
                 (x, w, None, 4, 4, 128, 2, gemv_kernels.DESIGNS["rows"])):
        torch.library.opcheck(GEMV, args)


def test_triton_kernel_under_interpreter_matches_reference():
    script = Path(__file__).parent / "kernels" / "interpret_gemv.py"
    done = subprocess.run([sys.executable, str(script)], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cases match" in done.stdout


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
def test_auto_choice_measures_on_gpu():
    gm = engine_before("kimi-linear-tiny")
    run_pass(gm, P8, buckets="1,8", bench_ms=5.0)
    details = gm.meta["k3"]["pass_details"][P8]
    assert details["measured_on"]
    for r in details["nodes"]:
        assert set(r["us"]) == {"1", "8"} and r["us"]["1"]["cublas"] > 0
        assert (r["choice"] == "gemv") == (r["max_m"] > 0)


def test_decision_rule():
    from k3compile.passes.p08_small_m_gemm import _decide

    def t(cublas, **gemv):
        return {"cublas_us": cublas, "gemv_us": {tuple(map(int, k[1:].split("_"))): v for k, v in gemv.items()}}
    # config A wins M = 1, 2 and loses at 4; B wins only M = 1 but by more: reach counts first
    timings = {1: t(10.0, c64_128_1=5.0, c32_256_2=4.0), 2: t(10.0, c64_128_1=6.0, c32_256_2=11.0),
               4: t(10.0, c64_128_1=12.0, c32_256_2=12.0)}
    assert _decide(timings, [1, 2, 4]) == (2, (64, 128, 1))
    # a win inside the noise margin is no win
    assert _decide({1: t(10.0, c64_128_1=9.9)}, [1], min_gain=0.03) == (0, None)
    assert _decide({1: t(10.0, c64_128_1=9.9)}, [1], min_gain=0.0) == (1, (64, 128, 1))
    # losing at M = 1 means cuBLAS whatever happens above
    assert _decide({1: t(10.0, c64_128_1=11.0), 2: t(10.0, c64_128_1=1.0)}, [1, 2]) == (0, None)
