"""`bench serve` against our own server (k3-tiny on CPU, in-process): every request completes, the
timings are consistent with each other and with the token counts, the summary has vLLM's keys, the
engine-step mode gives the goal ratio, and the shipped length set regenerates from its seed."""
import argparse

import pytest

from k3compile.bench import serve as bench_serve
from k3compile.bench.serve_dataset import load_shipped, make_requests, synthesize
from tests.runtime.server.conftest import start_server


def test_shipped_set_is_what_the_seeded_generator_makes():
    assert load_shipped() == synthesize()
    reqs = make_requests("sharegpt-synth", 5, seed=1)
    assert [len(r.prompt) for r in reqs] == [r.prompt_len for r in reqs]
    fixed = make_requests("fixed", 3, seed=0, input_len=7, output_len=2, prompt_kind="words")
    assert all(len(r.prompt.split()) == 7 and r.output_len == 2 for r in fixed)
    with pytest.raises(ValueError, match="unknown dataset"):
        make_requests("sharegpt", 1, 0)


def test_bench_serve_against_our_server(tmp_path):
    server = start_server(api_key=None, memory_bytes=16 << 20)
    try:
        args = argparse.Namespace(
            base_url=server.base_url, model=None, api_key=None, dataset="fixed", input_len=12, output_len=4,
            prompt_kind="ids", id_range="10,250", num_prompts=2, prompts_per_concurrency=1, request_rate="inf,50", max_concurrency="1,3",
            percentiles="50,99", seed=0, timeout=300.0, warmup_requests=1, engine_step="k3-tiny",
            engine_device="cpu", engine_memory_bytes=16 << 20, label="tiny", out=str(tmp_path))
        assert bench_serve.run(args) == 0
    finally:
        server.stop()
    import json
    doc = json.loads((tmp_path / "serve_tiny.json").read_text())
    assert doc["model"] == "k3-tiny" and len(doc["runs"]) == 4
    for run in doc["runs"]:
        n = max(2, run["max_concurrency"])
        assert run["num_prompts"] == run["completed"] == n and run["failed"] == 0
        assert run["total_output_tokens"] == 4 * n and run["total_input_tokens"] == 12 * n
        for key in ("request_throughput", "output_throughput", "total_token_throughput", "median_ttft_ms",
                    "p99_ttft_ms", "mean_tpot_ms", "median_itl_ms", "p99_e2el_ms"):
            assert run[key] > 0, key
        assert run["p99_ttft_ms"] <= run["p99_e2el_ms"] and run["median_ttft_ms"] <= run["median_e2el_ms"]
        assert run["engine_step_ms"] > 0 and run["itl_p50_over_engine_step"] > 0
        assert run["ttft_p99_over_single_prefill"] > 0
    steps = doc["engine_step"]["batches"]
    assert set(steps) == {"1", "3"} and all(s["decode_steps"] >= 1 for s in steps.values())
    assert (tmp_path / "serve_tiny.png").stat().st_size > 1000


def test_bench_serve_stand_in_needs_no_endpoint(tmp_path, server_flags="--max-batch-tokens 64"):
    """--stand-in: the real server over the timed stand-in in a child process (with extra serve flags),
    the sweep, and the same stand-in's engine step (same budget) for the ratios."""
    import json

    args = argparse.Namespace(
        base_url="unused", model=None, api_key=None, dataset="fixed", input_len=12, output_len=5,
        prompt_kind="ids", id_range="10,250", num_prompts=2, prompts_per_concurrency=1, request_rate="inf",
        max_concurrency="1,3", percentiles="50,99", seed=0, timeout=300.0, warmup_requests=1, engine_step=None,
        engine_device=None, engine_memory_bytes=None, stand_in="1.0,0.01", stand_in_tokens="no-text",
        stand_in_server_flags=server_flags, label="stand", out=str(tmp_path))
    assert bench_serve.run(args) == 0
    doc = json.loads((tmp_path / "serve_stand.json").read_text())
    assert doc["stand_in"]["step_ms"] == 1.0 and doc["stand_in"]["server_flags"] == server_flags.split()
    for run in doc["runs"]:
        assert run["failed"] == 0 and run["total_output_tokens"] == 5 * run["completed"]
        assert run["chunks_per_output_token"] == 1.0   # a chunk per step, though the tokens have no text
        assert run["itl_p50_over_engine_step"] > 0 and run["ttft_p99_over_engine_prefill"] > 0
    assert set(doc["engine_step"]["batches"]) == {"1", "3"}
    with pytest.raises(ValueError, match="--stand-in"):
        bench_serve._stand_in_times("1,2,3")


def test_serve_table_ratios_and_fallback_steps(tmp_path):
    """The issue-14 table: ratios against the result's own engine step, or --steps-from's."""
    import json

    from k3compile.bench.serve_table import table

    run = {"max_concurrency": 8, "num_prompts": 8, "median_itl_ms": 12.0, "chunks_per_output_token": 1.0,
           "median_ttft_ms": 300.0, "p99_ttft_ms": 400.0, "output_throughput": 500.0}
    with_steps = {"runs": [run], "warmup": [{"ttft_ms": 50.0}],
                  "engine_step": {"batches": {"1": {"prefill_ms": 100.0}, "8": {"device_step_ms": 10.0,
                                                                                   "prefill_ms": 200.0}}}}
    (tmp_path / "serve_a.json").write_text(json.dumps(with_steps))
    (tmp_path / "serve_b.json").write_text(json.dumps({"runs": [{**run, "median_itl_ms": float("nan")}]}))
    out = table([str(tmp_path / "serve_a.json"), str(tmp_path / "serve_b.json")], str(tmp_path / "serve_a.json"))
    rows = [line for line in out.splitlines() if line.startswith("| a ") or line.startswith("| b ")]
    assert "| 1.20x | 1.00 | 300 | 400 | 4.00x | 2.00x | 500 |" in rows[0]
    assert "| n/a | 10.00 | n/a |" in rows[1]   # no ITL (nan): no ratio


def test_openai_client_repeat_run_and_server_forwards(tmp_path):
    """--client openai: the same summary through the official package; --repeat-first-run: the first run's prompts
    come back as prefix-cache hits; against `serve --step-timing` each run carries the server's decode forwards."""
    import json

    server = start_server(api_key=None, memory_bytes=16 << 20, step_timing=True)
    try:
        args = argparse.Namespace(
            base_url=server.base_url, model=None, api_key=None, dataset="fixed", input_len=40, output_len=6,
            prompt_kind="ids", id_range="10,250", num_prompts=2, prompts_per_concurrency=None, request_rate="inf",
            max_concurrency="1,2", percentiles="50", seed=0, timeout=300.0, warmup_requests=1, engine_step=None,
            engine_device=None, engine_memory_bytes=None, label="oai", out=str(tmp_path), client="openai",
            repeat_first_run=True)
        assert bench_serve.run(args) == 0
    finally:
        server.stop()
    doc = json.loads((tmp_path / "serve_oai.json").read_text())
    assert doc["client"] == "openai" and [r.get("repeat", False) for r in doc["runs"]] == [False, False, True]
    for run in doc["runs"]:
        assert run["completed"] == 2 and run["failed"] == 0 and run["total_output_tokens"] == 12
        assert run["median_itl_ms"] > 0 and run["chunks_per_output_token"] == 1.0
        assert run["server_forward_ms"] > 0 and run["itl_p50_over_server_forward"] > 0
    first, repeat = doc["runs"][0], doc["runs"][2]
    for run in (first, repeat):   # one at a time: 2 requests x 5 decode forwards (the first token is the prefill's)
        assert {b: v["forwards"] for b, v in run["server_decode_forward"].items()} == {"1": 10}
        assert run["server_forward_batch"] == 1
    assert first["total_cached_tokens"] == 0   # fresh prompts
    assert repeat["total_cached_tokens"] >= 2 * 32   # 40-token prompts: at least two full pages each came back
