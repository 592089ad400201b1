"""`k3compile bench decode` runs end to end on CPU at tiny sizes: JSON + markdown + traces, CUDA-only arms
reported as skipped with the reason; the roofline's byte count follows its formula."""
import json

import pytest
import torch

from k3compile import cli
from k3compile.bench.roofline import roofline_pct, routed_experts, step_bytes
from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.loader import load_model
from k3compile.passes.pipeline import PipelineConfig
from k3compile.report.trace import load_trace


@pytest.fixture
def main(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, *(c for c in ("bench",) if c not in cli.COMMANDS)])
    return cli.main


def test_cpu_smoke_run_writes_json_markdown_and_traces(main, tmp_path, capsys):
    out = tmp_path / "traces"
    rc = main(["bench", "decode", "--model", "k3-tiny", "--batch", "1,2", "--steps", "3", "--warmup", "1",
               "--reps", "2", "--context", "16", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.01",
               "--out", str(out)])
    assert rc == 0
    doc = json.load(open(out / "decode_k3-tiny_fp32.json"))
    assert doc["protocol"]["meets_benchmarks_md"] is False  # a smoke run says so
    assert doc["environment"]["torch"] == torch.__version__ and "git_commit" in doc["environment"]
    assert doc["copy_bandwidth"]["bytes_per_s"] > 0
    rows = {(r["arm"], r["batch"]): r for r in doc["results"]}
    assert set(rows) == {(a, b) for a in ("eager", "compile-max-autotune", "compile-reduce-overhead", "graphs",
                                          "engine") for b in (1, 2)}
    for b in (1, 2):
        for arm in ("compile-max-autotune", "compile-reduce-overhead", "graphs"):
            assert rows[arm, b]["status"] == "skipped" and "needs CUDA" in rows[arm, b]["reason"]
        for arm in ("eager", "engine"):
            r = rows[arm, b]
            assert r["status"] == "ok" and len(r["samples_ms"]) == 2
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
            assert r["tok_s"] == pytest.approx(b / (r["median_ms"] / 1e3))
            total = doc["bytes_per_step"][str(b)]["total"]
            assert r["roofline_pct"] == pytest.approx(roofline_pct(total, doc["copy_bandwidth"]["bytes_per_s"],
                                                                   r["median_ms"]))
            assert r["cpu_ops_per_step"] > 0 and r["profiled_steps"] == 3
            assert load_trace(r["trace"]).events  # a trace `k3compile report` can read
        assert rows["engine", b]["max_abs_diff_vs_eager"] < 1e-4
        # the engine (P1-P4) runs fewer ops per step than eager model_def
        assert rows["engine", b]["cpu_ops_per_step"] < rows["eager", b]["cpu_ops_per_step"]
    assert [p["name"] for p in doc["engine_passes"]["decode"]["passes"]] == PipelineConfig.default().enabled_passes()
    md = open(out / "decode_k3-tiny_fp32.md").read()
    assert "| engine | 2 |" in md and "skipped: needs CUDA" in md and "% HBM roofline" in md
    assert "| engine | 2 |" in capsys.readouterr().out


def test_engine_directory_arm(main, tmp_path):
    from k3compile.engine.build import BuildOptions, build_engine

    engine_dir = str(tmp_path / "engine")
    build_engine(BuildOptions("k3-tiny", dtype=torch.float32, seed=3, pipeline=PipelineConfig.default()), engine_dir,
                 log=lambda m: None)
    out = tmp_path / "out"
    assert main(["bench", "decode", "--engine", engine_dir, "--batch", "2", "--steps", "2", "--warmup", "1",
                 "--reps", "2", "--context", "16", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.01",
                 "--arms", "eager,engine,engine-served", "--out", str(out)]) == 0
    doc = json.load(open(out / "decode_k3-tiny_fp32.json"))
    engine = next(r for r in doc["results"] if r["arm"] == "engine")
    # the model arms were loaded with the engine's build seed: same weights, same logits
    assert engine["status"] == "ok" and engine["max_abs_diff_vs_eager"] < 1e-4
    # the engine through the executor `serve` makes: same logits; its buckets and context recorded
    served = next(r for r in doc["results"] if r["arm"] == "engine-served")
    assert served["status"] == "ok" and served["max_abs_diff_vs_eager"] < 1e-4
    manifest = json.load(open(f"{engine_dir}/engine.json"))
    assert doc["config"]["compile"]["engine-served"] == {"buckets": manifest["decode_buckets"], "max_context": 4096}
    assert doc["config"]["executor_context"] == 16   # the engine arm's executor: capacity --context


def test_executor_context_served_sizes_the_executors_as_serve_does(main, tmp_path, monkeypatch):
    """--executor-context served: the executor arms get the page-table capacity `serve` gives the engine."""
    from k3compile.bench import decode_arms

    made = []
    real = decode_arms.Executor

    def spy(*a, **kw):
        made.append(kw["max_context"])
        return real(*a, **kw)
    monkeypatch.setattr(decode_arms, "Executor", spy)
    out = tmp_path / "out"
    assert main(["bench", "decode", "--model", "k3-tiny", "--batch", "1", "--steps", "2", "--warmup", "1", "--reps",
                 "1", "--context", "16", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.01", "--arms",
                 "eager,engine", "--executor-context", "served", "--out", str(out)]) == 0
    doc = json.load(open(out / "decode_k3-tiny_fp32.json"))
    assert made == [4096] and doc["config"]["executor_context"] == 4096   # k3-tiny: max_position_embeddings 4096
    assert next(r for r in doc["results"] if r["arm"] == "engine")["status"] == "ok"
    assert doc["engine_passes"]["decode"]["passes"][0]["name"] == "p01_gemm_merge"


def test_bad_arguments_are_reported(main, tmp_path, capsys):
    assert main(["bench", "decode", "--model", "k3-tiny", "--arms", "eager,warp-drive", "--out", str(tmp_path)]) == 2
    assert "unknown arm(s) ['warp-drive']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--batch: expected positive integers"):
        main(["bench", "decode", "--model", "k3-tiny", "--batch", "0", "--out", str(tmp_path)])


def test_step_bytes_follow_the_formula():
    model = load_model("k3-tiny", dtype=torch.float32)
    spec = model.cache_spec()
    cache = CacheTensors.allocate(spec, 3, 9, 4)
    batch = ForwardBatch.build("decode", [[5], [5]], [6, 9], [[1, 2], [3, 4, 5]], [1, 2], 4)
    routed = routed_experts(model, lambda: model.step(batch, cache))
    moe_layers = [i for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i)]
    assert sorted(routed) == moe_layers and all(2 <= n <= 4 for n in routed.values())  # top-2 of 2 tokens
    got = step_bytes(model, spec, 2, 10, 1, routed)
    layer = model.model.layers[moe_layers[0]].block_sparse_moe.experts
    per_expert = (layer.w13[0].numel() + layer.w2[0].numel()) * 4
    assert got["routed_expert_weights"] == per_expert * sum(routed.values())
    assert got["embedding_rows"] == 1 * model.config.hidden_size * 4  # one distinct token
    assert got["kv_read"] == 2 * 10 * spec.kv_bytes_per_token
    assert got["state_read_write"] == 2 * 2 * (spec.ssm_bytes_per_slot + spec.conv_bytes_per_slot)
    all_weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    experts_all = sum(t.numel() * 4 for n, t in model.named_parameters() if ".experts." in n)
    embed_all = model.model.embed_tokens.weight.numel() * 4
    assert got["dense_weights"] == all_weights - experts_all - embed_all
    assert got["total"] == sum(got[k] for k in ("dense_weights", "routed_expert_weights", "embedding_rows",
                                                "kv_read", "kv_write", "state_read_write"))


@pytest.mark.gpu
def test_gpu_smoke_run_counts_kernels_inside_graph_replays(main, tmp_path):
    out = tmp_path / "traces"
    assert main(["bench", "decode", "--model", "k3-tiny", "--batch", "1", "--steps", "10", "--warmup", "3",
                 "--reps", "2", "--context", "64", "--dtype", "bf16", "--device", "cuda", "--copy-gib", "0.5",
                 "--arms", "eager,graphs,engine,engine-served", "--out", str(out)]) == 0
    doc = json.load(open(out / "decode_k3-tiny_bf16.json"))
    rows = {(r["arm"], r["batch"]): r for r in doc["results"]}
    for b in (1,):
        assert all(rows[a, b]["status"] == "ok" for a in ("eager", "graphs", "engine")), rows
        eager_kernels = rows["eager", b]["kernels_per_step"]
        assert eager_kernels > 100
        for arm in ("graphs", "engine"):
            r = rows[arm, b]
            assert r["graph_replayed_per_step"] > 0  # CUPTI saw the kernels inside the replay
            assert r["kernels_per_step"] > 100
            assert r["max_abs_diff_vs_eager"] < 0.1
        assert rows["engine", b]["kernels_per_step"] < rows["graphs", b]["kernels_per_step"]  # P1-P4 fewer launches
        # the served executor replays the same graph (its launches differ in grid sizes only)
        served = rows["engine-served", b]
        assert served["status"] == "ok" and served["kernels_per_step"] == rows["engine", b]["kernels_per_step"]
        assert served["max_abs_diff_vs_eager"] < 0.1


def test_a_compile_that_outlasts_its_budget_is_stopped_and_the_other_arms_are_timed(main, tmp_path, monkeypatch):
    """--compile-budget bounds a compile already running (session 13: torch.compile's first call took the whole
    call and no arm was timed), also when the compile catches Exception: the arm is stopped, skipped with the reason, not retried at the next batch size,
    and the arms after it are set up and timed."""
    import time

    from k3compile.bench import decode_arms

    calls = []

    def slow_compile(ctx, batch):
        calls.append(batch.input_ids.shape[0])
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 30:  # a compile far over its budget
            try:
                time.sleep(0.05)
            except Exception:  # as an autotuner scores a raising candidate as slow and goes on (session 14)
                pass
        raise RuntimeError("not stopped")  # (the arm would then read 'failed', not 'skipped')
    arm = decode_arms.Arm("compile-reduce-overhead", "a stand-in compile", None, slow_compile)
    monkeypatch.setitem(decode_arms.ARMS, "compile-reduce-overhead", arm)
    out = tmp_path / "out"
    assert main(["bench", "decode", "--model", "k3-tiny", "--batch", "1,2", "--steps", "2", "--warmup", "1",
                 "--reps", "1", "--context", "16", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.01",
                 "--arms", "eager,compile-reduce-overhead,engine", "--compile-budget", "1", "--out", str(out)]) == 0
    doc = json.load(open(out / "decode_k3-tiny_fp32.json"))
    rows = {(r["arm"], r["batch"]): r for r in doc["results"]}
    assert calls == [1]  # stopped once, never started again
    assert rows["compile-reduce-overhead", 1]["status"] == "skipped"
    assert "still running after 1 s" in rows["compile-reduce-overhead", 1]["reason"]
    assert rows["compile-reduce-overhead", 2]["status"] == "skipped"
    assert all(rows[a, b]["status"] == "ok" for a in ("eager", "engine") for b in (1, 2))


def test_the_timings_are_written_before_the_profiles(main, tmp_path, monkeypatch):
    """A run stopped while it profiles (session 14, call 2: killed by its time-out after the time budget) keeps every
    arm's timings: the results file is written between the timed repetitions and the profiles."""
    from k3compile.bench import timing

    class Killed(BaseException):
        pass

    def stopped(*args, **kwargs):
        raise Killed  # the run is killed here
    monkeypatch.setattr(timing, "profile_steps", stopped)
    out = tmp_path / "out"
    with pytest.raises(Killed):
        main(["bench", "decode", "--model", "k3-tiny", "--batch", "1", "--steps", "2", "--warmup", "1", "--reps", "2",
              "--context", "16", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.01", "--arms", "eager,engine",
              "--out", str(out)])
    doc = json.load(open(out / "decode_k3-tiny_fp32.json"))
    rows = {r["arm"]: r for r in doc["results"]}
    assert set(rows) == {"eager", "engine"}
    assert all(r["status"] == "ok" and len(r["samples_ms"]) == 2 and r["median_ms"] > 0 for r in rows.values())
    assert "kernels_per_step" not in rows["engine"]  # no profile was taken


def test_arms_set_up_after_the_budget_still_get_one_repetition(main, tmp_path, monkeypatch):
    """Set-up that spends the time budget (session 19: 20 arms set up in 149 of 150 s on a cold H100, then no arm
    timed) leaves the arms set up with one repetition each, marked as cut short; an arm not yet set up is skipped."""
    from k3compile.bench import decode, decode_arms

    spent = {"now": False}
    eager = decode_arms.ARMS["eager"]

    def slow_set_up(ctx, batch):  # an arm whose set-up (a cold Triton compile) uses up the budget
        spent["now"] = True
        return eager.make(ctx, batch)
    monkeypatch.setitem(decode_arms.ARMS, "compile-reduce-overhead",
                        decode_arms.Arm("compile-reduce-overhead", "a slow set-up", None, slow_set_up))
    monkeypatch.setattr(decode.DecodeBench, "out_of_time", lambda self: spent["now"])
    out = tmp_path / "out"
    assert main(["bench", "decode", "--model", "k3-tiny", "--batch", "1", "--steps", "2", "--warmup", "1",
                 "--reps", "3", "--context", "16", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.01",
                 "--arms", "eager,compile-reduce-overhead,engine", "--out", str(out)]) == 0
    doc = json.load(open(out / "decode_k3-tiny_fp32.json"))
    rows = {r["arm"]: r for r in doc["results"]}
    for arm in ("eager", "compile-reduce-overhead"):
        assert rows[arm]["status"] == "ok" and len(rows[arm]["samples_ms"]) == 1 and rows[arm]["median_ms"] > 0
    assert rows["engine"]["status"] == "skipped" and "before this arm was set up" in rows["engine"]["reason"]
    assert doc["protocol"]["fewest_reps_timed"] == 1 and doc["protocol"]["meets_benchmarks_md"] is False
    assert "[1 of 3 reps]" in (out / "decode_k3-tiny_fp32.md").read_text()


def test_layers_times_a_presets_first_layers(main, tmp_path):
    """--layers N builds only a preset's first N layers (the 48B shape's own kernels on an 80 GB card): the results
    are named <preset>-<N>l and count that many layers' bytes."""
    out = tmp_path / "out"
    args = ["bench", "decode", "--model", "k3-tiny", "--batch", "1", "--steps", "2", "--warmup", "1", "--reps", "1",
            "--context", "16", "--dtype", "fp32", "--device", "cpu", "--copy-gib", "0.01", "--arms", "eager,engine"]
    assert main(args + ["--out", str(out)]) == 0
    assert main(args + ["--layers", "5", "--out", str(out)]) == 0
    whole = json.load(open(out / "decode_k3-tiny_fp32.json"))
    short = json.load(open(out / "decode_k3-tiny-5l_fp32.json"))
    assert short["config"]["model"] == "k3-tiny-5l"
    assert all(r["status"] == "ok" for r in short["results"])
    dense = [d["dense_weights"] for d in (whole["bytes_per_step"]["1"], short["bytes_per_step"]["1"])]
    assert dense[1] < dense[0]  # fewer layers' weights


@pytest.mark.parametrize("extra, match", [
    (["--layers", "0"], "--layers must be in 1..9"),
    (["--layers", "10"], "--layers must be in 1..9"),
    (["--layers", "3"], "--layers 3 keeps no MLA layer of 'k3-tiny' (the first is layer 4): use --layers >= 4"),
])
def test_bad_layers_are_refused(main, tmp_path, capsys, extra, match):
    assert main(["bench", "decode", "--model", "k3-tiny", "--device", "cpu", "--out", str(tmp_path)] + extra) == 2
    assert match in capsys.readouterr().err


def test_layers_refuses_a_checkpoint():
    from k3compile.bench.decode import truncated_preset
    from k3compile.model_def.config import ConfigError
    with pytest.raises(ConfigError, match="--layers takes a preset"):
        truncated_preset("checkpoints/spec-tiny/target", 2)
    cfg = truncated_preset("kimi-linear-48b", 14)  # meta-only preset: the config alone
    assert (cfg.name, cfg.num_hidden_layers) == ("kimi-linear-48b-14l", 14)
    assert cfg.layer_types == ("kda",) * 3 + ("mla",) + ("kda",) * 3 + ("mla",) + ("kda",) * 3 + ("mla",) + ("kda",) * 2
