"""`k3compile bench ladder` on CPU at tiny sizes: one rung per enabled pass in pipeline order, anchors, JSON +
markdown (+ plot when matplotlib is there). Numbers are structure checks only (CPU, BENCHMARKS.md rule 7)."""
import json

import pytest
import torch

from k3compile import cli
from k3compile.bench.hf_arm import HF_ARM
from k3compile.bench.ladder import LadderBench, apply_quick, render_ladder_markdown, rung_name
from k3compile.passes.pipeline import PipelineConfig


@pytest.fixture
def main(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, *(c for c in ("bench",) if c not in cli.COMMANDS)])
    return cli.main


def model_config_moe(name):
    from k3compile.model_def.config import get_preset
    cfg = get_preset(name)
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def model_config_mla(name):
    from k3compile.model_def.config import get_preset
    return len(get_preset(name).mla_layers)


def test_rungs_follow_the_default_pipeline():
    """Rung k = the first k enabled passes of whatever the registry registers (new pass files included)."""
    import argparse

    from k3compile.bench import ladder
    sub = argparse.ArgumentParser().add_subparsers()
    args = ladder.register(sub).parse_args(["--model", "k3-tiny"])
    bench = LadderBench(args, [1], torch.device("cpu"))
    order = PipelineConfig.default().enabled_passes()
    assert [r["passes"] for r in bench.rungs] == [order[:k] for k in range(len(order) + 1)]
    assert bench.arms == ["eager"] + [rung_name(0, None)] + [rung_name(i, p) for i, p in enumerate(order, 1)]
    assert bench.anchors["engine-after"] == rung_name(len(order), order[-1])
    assert bench.anchors["engine-before"] == rung_name(4, "p04_fused_routing")


def test_cpu_smoke_run(main, tmp_path, capsys):
    """One run with every part: rungs, anchors (transformers in its own process), accuracy gate, per-layer
    counts and the where-the-ops-go table."""
    out = tmp_path / "ladder"
    rc = main(["bench", "ladder", "--model", "kimi-linear-tiny", "--batch", "1", "--steps", "1", "--warmup", "0",
               "--reps", "1", "--context", "8", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.001",
               "--passes", "p01,p04", "--gate-steps", "2", "--hf", "--hf-steps", "1", "--out", str(out),
               "--variant", "noabsorb:p04_fused_routing.absorb_router_max_tokens=0"])
    assert rc == 0
    doc = json.load(open(out / "ladder_kimi-linear-tiny_fp32.json"))
    rungs = [rung_name(0, None), rung_name(1, "p01_gemm_merge"), rung_name(2, "p04_fused_routing")]
    assert [r["name"] for r in doc["rungs"]] == rungs
    assert doc["config"]["arms"] == ["eager"] + rungs + ["v-noabsorb", HF_ARM]
    # the variant: the last rung's pipeline with P4's option changed, built from the rung before P4
    (var,) = doc["variants"]
    assert var["name"] == "v-noabsorb" and var["from_rung"] == rungs[1] and var["passes_run"] == ["p04_fused_routing"]
    assert var["options"] == ["p04_fused_routing.absorb_router_max_tokens=0"] and "error" not in var
    assert var["pass_reports"][0]["passes"][0]["matches"] > 0
    # engine-before: the rung after the pipeline's P1-P4 passes (here all of it)
    assert doc["anchors"] == {"eager": "eager", "engine-after": rungs[-1], "engine-before": rungs[-1],
                              "transformers+fla": HF_ARM}
    rows = {r["arm"]: r for r in doc["results"]}
    assert set(rows) == {"eager", *rungs, "v-noabsorb", HF_ARM}
    hf = rows.pop(HF_ARM)  # transformers, its own process: timed, counted, its roofline from our bytes/step
    assert hf["status"] == "ok" and len(hf["samples_ms"]) == 1 and hf["steps_per_rep"] == 1, hf
    assert hf["roofline_pct"] > 0 and hf["cpu_ops_per_step"] > 0 and hf["cpu_ops_per_layer"] > 0
    assert doc["hf"]["kernels"]["fla"] is None and "error" not in doc["hf"]  # CPU: transformers' own fallback
    for arm, r in rows.items():
        assert r["status"] == "ok" and len(r["samples_ms"]) == 1 and r["roofline_pct"] > 0, arm
        assert r["max_abs_diff_vs_eager"] < 1e-4, arm  # every rung computes the same step
        assert r["cpu_ops_per_layer"] == pytest.approx(r["cpu_ops_per_step"] / doc["config"]["layers"])
        assert sum(r["cpu_ops_by_category"].values()) == r["cpu_ops_per_step"], arm
    # the accuracy gate, routing pinned (the verdict) then free: each rung vs the one before (rung 0 vs eager),
    # fp32: within 1e-4, same tokens. Pinned, the graphs' routers read the pinned biases in place (a rung that
    # routed freely while eager was pinned would be far off), every rung's graph reads all of them.
    acc = doc["accuracy_gate"]
    assert acc["modes"] == ["pinned", "free"] and acc["verdict_mode"] == "pinned" and acc["probes"]
    assert acc["routers"] == len(model_config_moe("kimi-linear-tiny")) > 0
    assert all(r["router_biases_read"] == acc["routers"] for r in doc["rungs"])
    for mode in ("pinned", "free"):
        gate = acc["per_batch"]["1"][mode]
        assert gate["eager"]["steps"] == 2 and len(gate["eager"]["tokens"]) == 2
        assert [gate[n]["vs"] for n in rungs] == ["eager"] + rungs[:-1]
        assert gate["v-noabsorb"]["vs"] == rungs[-1] and gate["v-noabsorb"]["ok"]  # variants: vs engine-after
        for n in rungs:
            assert gate[n]["ok"] and gate[n]["rel_err"] < 1e-4 and gate[n]["token_agreement"] == 1.0, (mode, gate[n])
            assert rows[n]["gate"][mode]["rel_err"] == gate[n]["rel_err"]
        # calibration probes: the rounding-only change within the fp32 tolerance, the injected bugs over it
        assert gate["probe:reordered-gemms"]["ok"] and gate["probe:reordered-gemms"]["rel_err"] > 0
        for bug in ("scale", "drop_shared", "wrong_expert"):
            assert not gate[f"probe:bug-{bug}"]["ok"], (mode, bug, gate[f"probe:bug-{bug}"])
    pinned = acc["per_batch"]["1"]["pinned"]["eager"]
    assert pinned["calibrated"] and pinned["tolerance"] == 1e-4  # fp32: the floor is above 2 x the probe
    assert len(pinned["pinned_experts"]) == acc["routers"]
    # each pass removes ops: CPU ops per step fall along the ladder (the GPU run counts kernels instead)
    ops = [rows[n]["cpu_ops_per_step"] for n in rungs]
    assert ops[0] > ops[1] > ops[2]
    assert doc["rungs"][1]["pass_reports"][0]["passes"][0]["matches"] > 0
    # traces: only the last rung's kept by default
    assert rows[rungs[-1]]["trace"] and rows[rungs[0]]["trace"] is None
    md = (out / "ladder_kimi-linear-tiny_fp32.md").read_text()
    assert f"| {rungs[-1]} | engine-after, engine-before |" in md and "% HBM roofline" in md
    assert "- batch 1: eager / engine-after = " in md and "transformers+fla / engine-after = " in md
    assert f"| {HF_ARM} | transformers+fla |" in md and "fla not installed (PyTorch fallback)" in md
    assert "- routing pinned (the verdict): every rung within tolerance." in md
    assert "- routing free (not gated): every rung within tolerance." in md and f"| {rungs[1]} | {rungs[0]} | " in md
    assert "- bs1, routing pinned: reordered-gemms " in md and "wrong_expert" in md
    assert "- tolerance used: bs1 0.0001 (probe " in md
    assert "Where the ops go, batch 1" in md
    assert "- v-noabsorb (p04_fused_routing.absorb_router_max_tokens=0; from r01-p01_gemm_merge): bs1 " in md
    assert md in capsys.readouterr().out
    # a rung over tolerance is flagged in the table and listed
    doc["accuracy_gate"]["per_batch"]["1"]["pinned"][rungs[1]]["ok"] = False
    flagged = render_ladder_markdown(doc)
    assert "**over**" in flagged and f"- routing pinned (the verdict): over tolerance: {rungs[1]}." in flagged
    # the copy census per rung (graph level): P1 merges GEMMs, none of these passes adds copies
    copies = [r["graph_copies"] for r in doc["rungs"]]
    assert copies[0]["cat"] == copies[-1]["cat"] == 2 * model_config_mla("kimi-linear-tiny")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert doc["plot"] is None
    else:
        assert (out / "ladder_kimi-linear-tiny_fp32.png").stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_smoke_run_counts_kernels_per_rung(main, tmp_path):
    out = tmp_path / "ladder"
    # one batch size, a smoke run: the GPU suite has five minutes in all (issue 10)
    assert main(["bench", "ladder", "--model", "k3-tiny", "--batch", "1", "--steps", "5", "--warmup", "2",
                 "--reps", "2", "--context", "32", "--dtype", "bf16", "--device", "cuda", "--copy-gib", "0.25",
                 "--out", str(out)]) == 0
    doc = json.load(open(out / "ladder_k3-tiny_bf16.json"))
    for r in doc["results"]:
        assert r["status"] == "ok" and r["kernels_per_step"] > 0, r
    # the pinned gate reaches every rung: no pass reads a copy of a router's bias (CUDA kernels included)
    acc = doc["accuracy_gate"]
    assert all(r["router_biases_read"] == acc["routers"] > 0 for r in doc["rungs"] if "error" not in r)
    pinned = acc["per_batch"]["1"]["pinned"]
    assert pinned["probe:reordered-gemms"]["ok"] and pinned["eager"]["calibrated"]
    for b in (1,):
        rows = [next(r for r in doc["results"] if r["arm"] == rung["name"] and r["batch"] == b) for rung in doc["rungs"]]
        assert rows[-1]["kernels_per_step"] < rows[0]["kernels_per_step"]  # the passes remove kernels


def test_failed_pass_reports_on_its_rung_and_later_rungs_go_on_without_it(main, tmp_path, monkeypatch):
    """A pass that raises (here P2, after half rewriting the graph) fails its own rung only; the later rungs
    run from the last good graph without it (they once all died with a KeyError on the failed rung)."""
    import dataclasses

    from k3compile.passes import registry

    spec = registry.get_pass("p02_noop_views")

    def broken(gm, cfg):
        spec.run(gm, cfg)  # leaves the graph rewritten, then fails: the next rungs must not see this
        gm.graph.erase_node(next(n for n in gm.graph.nodes if n.op == "output"))
        raise ValueError("forced failure for the test")
    monkeypatch.setitem(registry._REGISTRY, "p02_noop_views", dataclasses.replace(spec, run=broken))
    out = tmp_path / "ladder"
    assert main(["bench", "ladder", "--model", "kimi-linear-tiny", "--batch", "1", "--steps", "1", "--warmup", "0",
                 "--reps", "1", "--context", "8", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.001",
                 "--passes", "p01,p02,p04", "--gate-steps", "1", "--no-gate-probes", "--out", str(out)]) == 0
    doc = json.load(open(out / "ladder_kimi-linear-tiny_fp32.json"))
    pinned = doc["accuracy_gate"]["per_batch"]["1"]["pinned"]  # no probes: the floor, uncalibrated
    assert not doc["accuracy_gate"]["probes"] and not any(n.startswith("probe:") for n in pinned)
    assert pinned["eager"]["tolerance"] == 1e-4 and not pinned["eager"]["calibrated"]
    rungs = {r["name"]: r for r in doc["rungs"]}
    failed, after = rungs[rung_name(2, "p02_noop_views")], rungs[rung_name(3, "p04_fused_routing")]
    assert "forced failure for the test" in failed["error"] and "p02_noop_views" in failed["error"]
    assert after["passes"] == ["p01_gemm_merge", "p04_fused_routing"] and after["failed_passes"] == ["p02_noop_views"]
    assert "error" not in after and after["pass_reports"][0]["passes"][0]["matches"] > 0
    rows = {r["arm"]: r for r in doc["results"]}
    assert rows[failed["name"]]["status"] == "failed"
    assert "forced failure for the test" in rows[failed["name"]]["reason"]
    for arm in ("eager", rung_name(0, None), rung_name(1, "p01_gemm_merge"), after["name"]):
        assert rows[arm]["status"] == "ok" and rows[arm]["max_abs_diff_vs_eager"] < 1e-4, arm
    assert rows[after["name"]]["cpu_ops_per_step"] < rows[rung_name(1, "p01_gemm_merge")]["cpu_ops_per_step"]
    md = (out / "ladder_kimi-linear-tiny_fp32.md").read_text()
    assert f"- {failed['name']}: FAILED (" in md and "(without failed p02_noop_views)" in md


def _ladder_args(*argv):
    import argparse

    from k3compile.bench import ladder
    return ladder.register(argparse.ArgumentParser().add_subparsers()).parse_args(["--model", "k3-tiny", *argv])


def test_variant_flags_are_checked_before_any_work():
    """A malformed, unknown or duplicate --variant is refused with the reason; where a variant starts."""
    from k3compile.bench.ladder import first_difference, parse_variants
    from k3compile.passes.pipeline import PassConfigError

    base = PipelineConfig.default()
    for spec, words in (("nocolon", "NAME:PASS.OPT=VALUE"), ("a:p08_small_m_gemm.nosuch=1", "no option 'nosuch'"),
                        ("a:p99_nothing.x=1", "p99"), ("a:p08_small_m_gemm.min_gain=2", "min_gain"),
                        ("a:p08_small_m_gemm", "not PASS.OPT=VALUE")):
        with pytest.raises(PassConfigError, match=words):
            parse_variants([spec], base)
    with pytest.raises(PassConfigError, match="used twice"):
        parse_variants(["a:p08_small_m_gemm.min_gain=0.1", "a:p08_small_m_gemm.min_gain=0.2"], base)
    (v,) = parse_variants(["g:p08_small_m_gemm.choice=gemv"], base)
    order = base.enabled_passes()
    assert v["name"] == "v-g" and first_difference(base, v["pipeline"]) == order.index("p08_small_m_gemm")
    assert base.config("p08_small_m_gemm").choice == "auto"  # the base pipeline is not touched
    (off,) = parse_variants(["off:p15_mla_decode.enabled=false"], base)
    assert first_difference(base, off["pipeline"]) == order.index("p15_mla_decode")


def test_quick_changes_only_the_defaults():
    args = _ladder_args("--quick", "--reps", "7")
    apply_quick(args)
    assert (args.steps, args.warmup, args.reps, args.max_rep_seconds, args.gate_steps) == (40, 20, 7, 0.5, 3)
    full = _ladder_args()
    apply_quick(full)
    assert (full.steps, full.reps, full.max_rep_seconds, full.gate_steps) == (200, 5, None, 4)


def test_repetition_cap_and_compile_budget():
    args = _ladder_args("--max-rep-seconds", "0.5", "--compile-budget", "100", "--compile")
    apply_quick(args)
    bench = LadderBench(args, [1], torch.device("cpu"))
    assert bench.steps_per_rep(None) == 200  # no warm-up timing: no cap
    assert bench.steps_per_rep(1.0) == 200  # 200 x 1 ms fits in 0.5 s? no: 500 steps would; capped at --steps
    assert bench.steps_per_rep(5.0) == 100  # 0.5 s / 5 ms
    assert bench.steps_per_rep(60.0) == 10  # eager at 48B: never fewer than 10
    arm = "compile-reduce-overhead"
    assert bench.compile_skip_reason(arm) is None  # the first compile always starts
    bench.compile_spent, bench.last_compile_s[arm] = 70.0, 70.0
    assert "compile budget (100 s) spent: 70 s" in bench.compile_skip_reason(arm)  # 70 + 70 > 100
    bench.args.compile_budget = 200
    assert bench.compile_skip_reason(arm) is None
    bench.deadline = bench.t0 + 10  # less time left than the last compile took
    assert "time budget" in bench.compile_skip_reason(arm)


def test_transformers_anchor_refused_for_k3_without_starting_a_process():
    args = _ladder_args("--hf")
    apply_quick(args)
    bench = LadderBench(args, [1], torch.device("cpu"))
    bench._run_hf()
    assert bench.hf["results"] == [] and "transformers has no K3 architecture" in bench.hf["error"]
    bench.bytes, bench.bandwidth = {1: {"total": 1}}, {"bytes_per_s": 1.0}
    row = bench._hf_row(1)
    assert row["arm"] == HF_ARM and row["status"] == "failed" and "no K3" in row["reason"]
