"""`k3compile bench ladder` on CPU at tiny sizes: one rung per enabled pass in pipeline order, anchors, JSON +
markdown (+ plot when matplotlib is there). Numbers are structure checks only (CPU, BENCHMARKS.md rule 7)."""
import json

import pytest
import torch

from k3compile import cli
from k3compile.bench.ladder import LadderBench, rung_name
from k3compile.passes.pipeline import PipelineConfig


@pytest.fixture
def main(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, *(c for c in ("bench",) if c not in cli.COMMANDS)])
    return cli.main


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
    out = tmp_path / "ladder"
    rc = main(["bench", "ladder", "--model", "kimi-linear-tiny", "--batch", "1", "--steps", "1", "--warmup", "0",
               "--reps", "1", "--context", "8", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.001",
               "--passes", "p01,p04", "--out", str(out)])
    assert rc == 0
    doc = json.load(open(out / "ladder_kimi-linear-tiny_fp32.json"))
    rungs = [rung_name(0, None), rung_name(1, "p01_gemm_merge"), rung_name(2, "p04_fused_routing")]
    assert [r["name"] for r in doc["rungs"]] == rungs
    assert doc["config"]["arms"] == ["eager"] + rungs
    # engine-before: the rung after the pipeline's P1-P4 passes (here all of it)
    assert doc["anchors"] == {"eager": "eager", "engine-after": rungs[-1], "engine-before": rungs[-1]}
    rows = {r["arm"]: r for r in doc["results"]}
    assert set(rows) == {"eager", *rungs}
    for arm, r in rows.items():
        assert r["status"] == "ok" and len(r["samples_ms"]) == 1 and r["roofline_pct"] > 0, arm
        assert r["max_abs_diff_vs_eager"] < 1e-4, arm  # every rung computes the same step
    # each pass removes ops: CPU ops per step fall along the ladder (the GPU run counts kernels instead)
    ops = [rows[n]["cpu_ops_per_step"] for n in rungs]
    assert ops[0] > ops[1] > ops[2]
    assert doc["rungs"][1]["pass_reports"][0]["passes"][0]["matches"] > 0
    # traces: only the last rung's kept by default
    assert rows[rungs[-1]]["trace"] and rows[rungs[0]]["trace"] is None
    md = (out / "ladder_kimi-linear-tiny_fp32.md").read_text()
    assert f"| {rungs[-1]} | engine-after, engine-before |" in md and "% HBM roofline" in md
    assert "- batch 1: eager / engine-after = " in md
    assert md in capsys.readouterr().out
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
    assert main(["bench", "ladder", "--model", "k3-tiny", "--batch", "1,4", "--steps", "5", "--warmup", "2",
                 "--reps", "2", "--context", "32", "--dtype", "bf16", "--device", "cuda", "--copy-gib", "0.25",
                 "--out", str(out)]) == 0
    doc = json.load(open(out / "ladder_k3-tiny_bf16.json"))
    for r in doc["results"]:
        assert r["status"] == "ok" and r["kernels_per_step"] > 0, r
    for b in (1, 4):
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
                 "--passes", "p01,p02,p04", "--out", str(out)]) == 0
    doc = json.load(open(out / "ladder_kimi-linear-tiny_fp32.json"))
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
