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


def test_serve_flag_turns_it_on():
    parse = serve.register(__import__("argparse").ArgumentParser().add_subparsers()).parse_args
    assert serve.engine_args(parse(["k3-tiny", "--step-timing"])).step_timing is True
    assert serve.engine_args(parse(["k3-tiny"])).step_timing is False
