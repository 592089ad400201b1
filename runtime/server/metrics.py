"""/metrics: the engine's metrics and the server's request counters in Prometheus text format.

Uses its own CollectorRegistry (not the process-global one), so several servers in one process,
as in the tests, don't collide. Engine figures are read at scrape time from the snapshot the
engine thread publishes after each iteration (`AsyncEngine.metrics()`); nothing here touches the
engine itself.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "k3compile"

# engine metrics key (LLMEngine.metrics() plus the front's own) -> (name without prefix, kind, help)
ENGINE_METRICS = {
    "running": ("requests_running", "gauge", "requests in the running batch"),
    "queued": ("requests_queued", "gauge", "requests waiting to be scheduled"),
    "max_running": ("requests_max_running", "gauge", "the running-requests limit"),
    "in_flight": ("requests_in_engine", "gauge", "requests the engine holds (running, queued or finishing)"),
    "tokens_per_s": ("generation_tokens_per_second", "gauge", "generated tokens per second, last 10 s"),
    "generated_tokens": ("generation_tokens", "counter", "tokens generated"),
    "prompt_tokens": ("prompt_tokens", "counter", "prompt tokens admitted (cache hits included)"),
    "prefill_tokens": ("prefill_tokens", "counter", "tokens computed by prefill (cache hits excluded)"),
    "cache_hit_tokens": ("cache_hit_tokens", "counter", "prompt tokens served from the prefix cache"),
    "cache_hit_rate": ("cache_hit_rate", "gauge", "cache hit tokens / prompt tokens, since start"),
    "pages_used": ("kv_pages_used", "gauge", "KV pages in use (requests and prefix cache)"),
    "pages_total": ("kv_pages_total", "gauge", "KV pages the memory holds"),
    "kv_pool_usage": ("kv_pool_usage", "gauge", "fraction of KV pages in use"),
    "slots_used": ("state_slots_used", "gauge", "KDA state slots in use (requests and checkpoints)"),
    "slots_total": ("state_slots_total", "gauge", "KDA state slots the memory holds"),
    "state_pool_usage": ("state_pool_usage", "gauge", "fraction of KDA state slots in use"),
    "tree_pages": ("cache_pages", "gauge", "KV pages held by the prefix cache"),
    "checkpoints": ("cache_checkpoints", "gauge", "KDA state checkpoints held by the prefix cache"),
    "checkpoint_bytes": ("cache_checkpoint_bytes", "gauge", "bytes of KDA state checkpoints held"),
    "retractions": ("retractions", "counter", "requests retracted under memory pressure"),
}


class _EngineCollector:
    def __init__(self, front):
        self.front = front

    def collect(self):
        snap = self.front.metrics()
        yield GaugeMetricFamily(f"{PREFIX}_engine_healthy", "1 when the engine serves requests, else 0",
                                value=0.0 if self.front.health() else 1.0)
        for key, (name, kind, help_) in ENGINE_METRICS.items():
            value = snap.get(key)
            if not _is_number(value):
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"{PREFIX}_{name}", help_, value=float(value))
        yield from _decode_forward_families(snap.get("decode_forward"))
        yield from _prefill_families(snap.get("prefill_forward"), snap.get("first_token"))


def _decode_forward_families(per_bucket):
    """`serve --step-timing`: decode forwards and their device seconds per batch bucket (the engine's
    "decode_forward" figures), as two counters labelled `batch`: the mean forward at a bucket is the
    seconds' increase over the forwards' increase between two scrapes."""
    if not isinstance(per_bucket, dict):
        return
    forwards = CounterMetricFamily(f"{PREFIX}_decode_forwards", "decode forwards run, by batch bucket "
                                   "(serve --step-timing)", labels=["batch"])
    seconds = CounterMetricFamily(f"{PREFIX}_decode_forward_seconds", "device seconds of those decode forwards "
                                  "(CUDA events around input copies + graph replay; wall clock on a CPU)",
                                  labels=["batch"])
    for bucket, v in sorted(per_bucket.items(), key=lambda kv: int(kv[0])):
        forwards.add_metric([str(bucket)], float(v["forwards"]))
        seconds.add_metric([str(bucket)], float(v["seconds"]))
    yield forwards
    yield seconds


# (snapshot key, counter name without prefix and _total, help) of what a first token costs
_PREFILL_COUNTERS = (
    ("prefill_forward", "forwards", "prefill_forwards", "prefill forwards run (serve --step-timing)"),
    ("prefill_forward", "tokens", "prefill_forward_tokens", "tokens those prefill forwards computed"),
    ("prefill_forward", "host_seconds", "prefill_forward_host_seconds",
     "wall seconds of the calls that launched them (op dispatch, launches, host syncs inside)"),
    ("prefill_forward", "device_forwards", "prefill_forward_device_forwards",
     "prefill forwards whose device time is counted (finished)"),
    ("prefill_forward", "device_seconds", "prefill_forward_device_seconds",
     "device seconds of those (CUDA events around the forward; wall clock on a CPU)"),
    ("first_token", "requests", "first_token_requests", "requests that got their first token"),
    ("first_token", "prefill_forwards", "first_token_prefill_forwards",
     "prefill forwards those requests rode in until their first token, summed"),
    ("first_token", "seconds", "first_token_engine_seconds",
     "engine-side seconds from add_request to the first token, summed"),
)


def _prefill_families(prefill, first):
    """Counters of the prefill forwards (with --step-timing) and of what first tokens cost: a scraper differences
    two scrapes to get tokens per forward, host and device ms per forward, forwards per first token."""
    snaps = {"prefill_forward": prefill, "first_token": first}
    for key, field, name, help_ in _PREFILL_COUNTERS:
        snap = snaps[key]
        if isinstance(snap, dict) and _is_number(snap.get(field)):
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_, value=float(snap[field]))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Per-request latencies as vLLM and SGLang export them (bucket bounds in seconds from vLLM's).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
LATENCIES = {  # AsyncEngine's latency kinds -> (name without prefix, help, buckets)
    "ttft": ("time_to_first_token_seconds", "time from arrival to the first output token", _TTFT_BUCKETS),
    "itl": ("inter_token_latency_seconds", "time between consecutive output tokens", _ITL_BUCKETS),
    "e2e": ("e2e_request_latency_seconds", "time from arrival to the last output", _REQUEST_BUCKETS),
    "queue": ("request_queue_time_seconds", "time from arrival to first admission into the running batch",
              _REQUEST_BUCKETS),
}


class ServerMetrics:
    def __init__(self, front):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(front))
        self.requests = Counter(f"{PREFIX}_requests", "finished requests by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.errors = Counter(f"{PREFIX}_request_errors", "requests answered with an error, by HTTP status "
                              "(499: the client disconnected first)", ["status"], registry=self.registry)
        self.latency = {kind: Histogram(f"{PREFIX}_{name}", help_, buckets=buckets, registry=self.registry)
                        for kind, (name, help_, buckets) in LATENCIES.items()}

    def observe_latency(self, kind: str, seconds: float) -> None:
        self.latency[kind].observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
