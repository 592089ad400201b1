"""`serve --step-timing`: /metrics exports the engine's decode forwards and their seconds per batch bucket, as
counters a scraper differences between two scrapes (what `bench serve` does around each run)."""
import httpx
from prometheus_client.parser import text_string_to_metric_families

from k3compile.commands import serve

from .conftest import MODEL, start_server


def _samples(base_url: str) -> dict:
    text = httpx.get(f"{base_url}/metrics").text
    return {(s.name, s.labels.get("batch")): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def test_decode_forwards_per_bucket_on_metrics():
    s = start_server(api_key=None, memory_bytes=16 << 20, step_timing=True)
    try:
        assert ("k3compile_decode_forwards_total", "1") not in _samples(s.base_url)   # nothing timed yet
        r = s.client().completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        s.wait_idle()
        got = _samples(s.base_url)
        assert got[("k3compile_decode_forwards_total", "1")] == 4   # the first token came from the prefill
        assert got[("k3compile_decode_forward_seconds_total", "1")] > 0
    finally:
        s.stop()


def test_prefill_forwards_and_first_tokens_on_metrics():
    """The prefill counters a scraper differences into tokens per forward, host/device ms per forward and forwards
    per first token (bench serve's "server_prefill")."""
    from k3compile.bench.serve import _add_server_prefill, scrape_prefill

    s = start_server(api_key=None, memory_bytes=16 << 20, step_timing=True)
    try:
        before = scrape_prefill(s.base_url)
        assert before["prefill_forwards"] == 0 and before["first_token_requests"] == 0
        r = s.client().completions.create(model=MODEL, prompt="abcdef", max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        s.wait_idle()
        after = scrape_prefill(s.base_url)
        n = r.usage.prompt_tokens
        assert after["prefill_forwards"] == 1 and after["prefill_forward_tokens"] == n
        assert after["first_token_requests"] == 1 and after["first_token_prefill_forwards"] == 1
        assert after["prefill_forward_host_seconds"] > 0 and after["first_token_engine_seconds"] > 0
        run = {}
        _add_server_prefill(run, before, after)
        p = run["server_prefill"]
        assert (p["forwards"], p["tokens_per_forward"], p["forwards_per_first_token"]) == (1, n, 1.0)
        assert p["device_ms_per_forward"] > 0 and p["engine_ttft_mean_ms"] > 0
    finally:
        s.stop()


def test_serve_flag_turns_it_on():
    parse = serve.register(__import__("argparse").ArgumentParser().add_subparsers()).parse_args
    assert serve.engine_args(parse(["k3-tiny", "--step-timing"])).step_timing is True
    assert serve.engine_args(parse(["k3-tiny"])).step_timing is False
