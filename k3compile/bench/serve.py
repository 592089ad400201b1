"""k3compile bench serve: an open-loop load generator against any OpenAI-compatible endpoint.

    k3compile bench serve --base-url http://127.0.0.1:30000 --model NAME \
        --dataset fixed --input-len 128 --output-len 128 --max-concurrency 1,8,64 --num-prompts 64 \
        --request-rate inf --engine-step ENGINE_DIR --out traces/serve

Each run of the sweep (every --request-rate x --max-concurrency pair) sends --num-prompts streamed
completions: arrivals are a Poisson process at the request rate (inf: all at once), at most
--max-concurrency in flight. Per request it records the time to first token (TTFT), the gaps
between streamed chunks (ITL; one chunk per token on servers that stream every token; unlike vLLM's
bench, chunks whose text is empty count too, as they carry tokens whose text is held back), TPOT
((E2E - TTFT) / (output tokens - 1)) and end-to-end latency (E2E). The summary has the shape of
`vllm bench serve` / `sglang.bench_serving` (request/output/total token throughput, mean / median
/ std / pXX of ttft, tpot, itl, e2el in ms), so results compare.

`--engine-step SOURCE` also measures the engine's own decode step in this process, at batch sizes
equal to the concurrencies, on the same lengths (serve_engine_step.py), and adds the goal ratio
served ITL p50 / engine step per concurrency, and TTFT p99 over one prompt's prefill and over the
engine's own prefill of the same wave of prompts. `chunks_per_output_token` says whether tokens
arrived a chunk per step (1.0) or in bursts, which ITL and TTFT would then time instead of steps.

`--client openai` sends the requests through the official `openai` package (AsyncOpenAI, streamed completions)
instead of the built-in standard-library client: what an OpenAI user's program measures. `--repeat-first-run`
sends the first run's prompts once more at the end (a run marked "repeat"): with a prefix cache the server
reports them as cached (`total_cached_tokens`, from the usage's prompt_tokens_details). Against a server
started with `--step-timing`, each run also records the server's own decode forwards over the run (its
/metrics counters before and after): per batch bucket the forwards and their mean device time, the bucket
most forwards ran at (`server_forward_batch`, `server_forward_ms`) and served ITL p50 over it.

`--stand-in STEP_MS,TOKEN_MS` benches no endpoint: it starts `k3compile serve k3-tiny` with the
model's forward replaced by a timed stand-in (bench/stand_in_step.py, bench/serve_stand_in.py) in a
child process, runs the sweep against it, and times the same stand-in's engine loop -- the served
path at device-like step times on a CPU. Results: OUT/serve_<label>.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0   # streamed chunks that carried tokens
    e2e: float | None = None
    start: float = 0.0
    error: str | None = None
    cached_tokens: int = 0   # prompt tokens the server reports served from its prefix cache


def register(sub) -> None:
    p = sub.add_parser("serve", help="open-loop load generator against an OpenAI endpoint (TTFT, ITL, E2E)")
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (…/v1/completions is added)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", default="sharegpt-synth", choices=["sharegpt-synth", "fixed"])
    p.add_argument("--input-len", type=int, default=128, help="fixed dataset: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="fixed dataset: output tokens")
    p.add_argument("--prompt-kind", default="ids", choices=["ids", "words"],
                   help="ids: random token ids (exact lengths); words: text for text-only endpoints")
    p.add_argument("--id-range", default="10,250", help="token ids of id prompts: LOW,HIGH (HIGH excluded)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run of the sweep")
    p.add_argument("--prompts-per-concurrency", type=int, default=None, metavar="K",
                   help="instead: each run sends max(--num-prompts, K x its concurrency) requests "
                   "(K=1, --num-prompts 4: 4 at concurrency 1, 64 at 64: one wave of simultaneous prompts)")
    p.add_argument("--request-rate", default="inf", help="comma-separated requests/s (Poisson), inf = all at once")
    p.add_argument("--max-concurrency", default="64", help="comma-separated limits of requests in flight")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup-requests", type=int, default=1, help="requests sent (and not counted) before the sweep")
    p.add_argument("--client", default="sse", choices=["sse", "openai"],
                   help="sse: the built-in standard-library client; openai: the official openai package")
    p.add_argument("--repeat-first-run", action="store_true",
                   help="end with the first run's prompts again (prefix-cache hits on a server with a cache)")
    p.add_argument("--engine-step", default=None, metavar="ENGINE_DIR|MODEL",
                   help="also time the engine's own decode step at the concurrencies (same lengths)")
    p.add_argument("--engine-device", default=None, help="device for --engine-step (default: cuda if available)")
    p.add_argument("--engine-memory-bytes", type=int, default=None, help="pools for --engine-step")
    p.add_argument("--stand-in", default=None, metavar="STEP_MS,TOKEN_MS",
                   help="no endpoint: serve k3-tiny with a timed stand-in forward (STEP_MS + TOKEN_MS x tokens "
                   "per step; bench/stand_in_step.py) in a child process, bench it, and time the same stand-in's "
                   "engine loop (implies --engine-step): the served path on a CPU at device-like step times")
    p.add_argument("--stand-in-tokens", default="no-text", choices=["no-text", "text"],
                   help="what the stand-in generates (bench/stand_in_step.py)")
    p.add_argument("--stand-in-server-flags", default="", metavar="'FLAGS'",
                   help="extra `k3compile serve` flags for the stand-in server, with '=' (--stand-in-server-flags='--engine-process')")
    p.add_argument("--label", default=None, help="file name label (default: the model name)")
    p.add_argument("--out", default="traces", help="output folder for JSON and PNG")
    p.set_defaults(func=run)
    return p


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 or math.isnan(v) for v in vals):
        raise ValueError(f"{what}: expected positive numbers, got {text!r}")
    return vals


# ---------------------------------------------------------------------------------------------- requests

async def _one(url: str, headers: dict, payload: dict, prompt_len: int, timeout: float) -> RequestResult:
    res = RequestResult(False, prompt_len)
    try:
        await asyncio.wait_for(_stream(res, url, headers, payload), timeout)
    except Exception as e:   # a dropped connection or timeout fails this request only
        res.error = res.error or repr(e)[:200]
    return res


async def _stream(res: RequestResult, url: str, headers: dict, payload: dict) -> None:
    from .sse_client import post_lines

    t0 = time.perf_counter()
    res.start = t0
    clock, usage, status, body = _TokenClock(res), None, None, []
    async for st, line in post_lines(url, payload, headers):
        if st is not None:
            status = st
            continue
        if status != 200:
            body.append(line)
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if obj.get("error"):
            res.error = str(obj["error"])[:200]
            return
        if obj.get("usage"):
            usage = obj["usage"]
        if not obj.get("choices"):
            continue   # a usage-only chunk carries no token to time
        clock.tick()  # a chunk with empty text still brought tokens (a multi-byte character held back)
    if status != 200:
        res.error = f"HTTP {status}: {' '.join(body)[:200]}"
        return
    _finish(res, t0, clock.chunks, usage)


class _TokenClock:
    """TTFT and inter-token latencies from the arrival times of the chunks that carry tokens."""

    def __init__(self, res: RequestResult):
        self.res, self.last, self.chunks = res, None, 0

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.res.ttft = now - self.res.start
        else:
            self.res.itl.append(now - self.last)
        self.last = now
        self.chunks += 1


def _finish(res: RequestResult, t0: float, chunks: int, usage: dict | None) -> None:
    """End-to-end time, token counts and cached tokens once a stream ended (`usage`: its usage object)."""
    res.e2e = time.perf_counter() - t0
    res.output_tokens = usage["completion_tokens"] if usage and usage.get("completion_tokens") else chunks
    res.cached_tokens = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    res.chunks = chunks
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "no token streamed"


async def _stream_openai(res: RequestResult, client, payload: dict) -> None:
    """`_stream` through the official openai package: the same timings from its streamed chunks."""
    body = dict(payload)
    extra = {k: body.pop(k) for k in ("ignore_eos",) if k in body}
    body.pop("stream", None)
    t0 = time.perf_counter()
    res.start = t0
    clock, usage = _TokenClock(res), None
    stream = await client.completions.create(**body, stream=True, extra_body=extra)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        if not chunk.choices:
            continue   # a usage-only chunk carries no token to time
        clock.tick()
    _finish(res, t0, clock.chunks, usage)


async def _one_openai(client, payload: dict, prompt_len: int, timeout: float) -> RequestResult:
    res = RequestResult(False, prompt_len)
    try:
        await asyncio.wait_for(_stream_openai(res, client, payload), timeout)
    except Exception as e:   # an API error, a dropped connection or a timeout fails this request only
        res.error = res.error or repr(e)[:200]
    return res


def _openai_client(base_url: str, api_key: str | None, timeout: float):
    import openai

    return openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0,
                              timeout=timeout)


async def _run_load(base_url, model, api_key, reqs, rate, concurrency, seed, timeout,
                    client: str = "sse") -> tuple[list, float]:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    oai = _openai_client(base_url, api_key, timeout) if client == "openai" else None

    async def send(req):
        payload = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
                   "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with sem:
            if oai is not None:
                return await _one_openai(oai, payload, req.prompt_len, timeout)
            return await _one(url, headers, payload, req.prompt_len, timeout)

    t0 = time.perf_counter()
    tasks = []
    for req in reqs:   # open loop: arrivals do not wait for completions
        tasks.append(asyncio.ensure_future(send(req)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    if oai is not None:
        await oai.close()
    return results, duration


# ---------------------------------------------------------------------------------------------- summary

def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    doc = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
           "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
           "request_throughput": len(ok) / duration if duration else 0.0,
           "output_throughput": out_tokens / duration if duration else 0.0,
           "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
           "errors": sorted({r.error for r in results if r.error})[:5],
           "total_cached_tokens": sum(r.cached_tokens for r in ok),
           # 1.0: every token reached the client in a chunk of its own (one per engine step); far below:
           # tokens arrive in bursts, and ITL / TTFT time the bursts, not the steps
           "chunks_per_output_token": sum(r.chunks for r in ok) / out_tokens if out_tokens else float("nan")}
    series = {"ttft": [r.ttft for r in ok], "e2el": [r.e2e for r in ok],
              "itl": [g for r in ok for g in r.itl],
              "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]}
    for name, vals in series.items():
        ms = [v * 1000.0 for v in vals]
        doc[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else float("nan")
        doc[f"median_{name}_ms"] = statistics.median(ms) if ms else float("nan")
        doc[f"std_{name}_ms"] = statistics.pstdev(ms) if len(ms) > 1 else 0.0
        for q in percentiles:
            doc[f"p{q:g}_{name}_ms"] = _pct(ms, q)
    return doc


# ---------------------------------------------------------------------------------------------- driver

def _first_model(base_url: str, api_key: str | None) -> str:
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def _stand_in_times(text: str) -> tuple[float, float]:
    vals = [float(x) for x in text.split(",") if x.strip()]
    if not 1 <= len(vals) <= 2 or any(v < 0 or math.isnan(v) for v in vals):
        raise ValueError(f"--stand-in: expected STEP_MS[,TOKEN_MS] (ms, >= 0), got {text!r}")
    return vals[0], vals[1] if len(vals) == 2 else 0.0


def bench(args) -> dict:
    """Run the sweep (and the engine step if asked); returns the result document. With --stand-in,
    against a stand-in server started (and stopped) here."""
    if not getattr(args, "stand_in", None):
        return _bench(args)
    import shlex

    from .serve_stand_in import StandInServer

    step_ms, token_ms = _stand_in_times(args.stand_in)
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, f"serve_{args.label or 'stand-in'}_server.log")
    flags = shlex.split(args.stand_in_server_flags or "")
    server = StandInServer(step_ms, token_ms, args.stand_in_tokens, flags, log_path)
    try:
        inner = argparse.Namespace(**{**vars(args), "base_url": server.base_url, "model": None,
                                      "engine_step": None})
        doc = _bench(inner)
    finally:
        server.stop()
    doc["stand_in"] = {"step_ms": step_ms, "token_ms": token_ms, "tokens": args.stand_in_tokens,
                       "server_flags": flags, "server_log": log_path}
    from .serve_engine_step import engine_steps
    from .stand_in_step import TimedStandInModel

    concs = sorted({int(c) for c in _floats(args.max_concurrency, "--max-concurrency")})
    model = TimedStandInModel(step_ms, token_ms, args.stand_in_tokens)
    doc["engine_step"] = engine_steps("k3-tiny", concs, args.input_len, args.output_len, device="cpu",
                                      memory_bytes=200 << 20,
                                      log=_log, provider=model, engine_flags=_engine_flags(flags))
    _add_ratios(doc)
    return doc


def _engine_flags(flags: list[str]) -> dict:
    """The EngineArgs the stand-in server's scheduling flags set, for the offline loop to match."""
    out, i = {}, 0
    names = {"--max-batch-tokens": "max_batch_tokens", "--max-num-batched-tokens": "max_batch_tokens",
             "--chunk-size": "chunk_size", "--chunked-prefill-size": "chunk_size"}
    while i < len(flags):
        if flags[i] in names and i + 1 < len(flags):
            out[names[flags[i]]] = int(flags[i + 1])
            i += 1
        i += 1
    return out


def _bench(args) -> dict:
    from .serve_dataset import make_requests

    rates = _floats(args.request_rate, "--request-rate")
    concs = [int(c) for c in _floats(args.max_concurrency, "--max-concurrency")]
    pcts = _floats(args.percentiles, "--percentiles")
    lo, hi = (int(x) for x in args.id_range.split(","))
    model = args.model or _first_model(args.base_url, args.api_key)
    k = getattr(args, "prompts_per_concurrency", None)

    def requests_for(conc: int, run: int = 0):
        """Fresh prompts for every run (seeded by its index): a prompt repeated from an earlier run
        would be a prefix-cache hit and flatter the TTFT."""
        n = args.num_prompts if not k else max(args.num_prompts, k * conc)
        return make_requests(args.dataset, n, args.seed + 1000 * run, args.input_len, args.output_len,
                             args.prompt_kind, (lo, hi))

    reqs = requests_for(max(concs))
    doc = {"bench": "serve", "base_url": args.base_url, "model": model, "dataset": args.dataset,
           "num_prompts": args.num_prompts, "prompt_kind": args.prompt_kind,
           "input_len": args.input_len if args.dataset == "fixed" else None,
           "output_len": args.output_len if args.dataset == "fixed" else None,
           "percentiles": pcts, "runs": []}
    client = getattr(args, "client", "sse")
    doc["client"] = client
    if args.warmup_requests:
        warm = make_requests(args.dataset, args.warmup_requests, args.seed + 99, args.input_len, args.output_len,
                             args.prompt_kind, (lo, hi))
        res, _ = asyncio.run(_run_load(args.base_url, model, args.api_key, warm, math.inf, len(warm), args.seed,
                                       args.timeout, client))
        doc["warmup"] = [{"ttft_ms": r.ttft * 1000 if r.ttft else None, "error": r.error} for r in res]

    def one_run(rate, conc, run_reqs, **extra):
        _log(f"rate {rate:g} req/s, concurrency {conc}: {len(run_reqs)} requests" + (" (repeat)" if extra else ""))
        before = _metric_samples(args.base_url)   # the server's counters, read once before and once after
        results, duration = asyncio.run(_run_load(args.base_url, model, args.api_key, run_reqs, rate, conc,
                                                  args.seed, args.timeout, client))
        run = {"request_rate": rate if math.isfinite(rate) else "inf", "max_concurrency": conc,
               "num_prompts": len(run_reqs), **extra, **summarize(results, duration, pcts)}
        if before is not None:
            time.sleep(0.2)   # the engine publishes its figures after the iteration that ran the last step
            after = _metric_samples(args.base_url)
            _add_server_forwards(run, _decode_forwards(before), after and _decode_forwards(after))
            _add_server_prefill(run, _prefill_counters(before), after and _prefill_counters(after))
        _log(f"  {run['completed']} ok, {run['failed']} failed; output {run['output_throughput']:.1f} tok/s, "
             f"TTFT p50 {run['median_ttft_ms']:.1f} ms p99 {run.get('p99_ttft_ms', float('nan')):.1f} ms, "
             f"ITL p50 {run['median_itl_ms']:.2f} ms, {run['chunks_per_output_token']:.2f} chunks per token, "
             f"{run['total_cached_tokens']} cached prompt tokens"
             + (f", server decode forward {run['server_forward_ms']:.3f} ms at batch {run['server_forward_batch']}"
                if "server_forward_ms" in run else "") + _prefill_line(run.get("server_prefill")))
        doc["runs"].append(run)

    first = None
    for rate in rates:
        for conc in concs:
            run_reqs = requests_for(conc, len(doc["runs"]) + 1)
            first = first or (rate, conc, run_reqs)
            one_run(rate, conc, run_reqs)
    if getattr(args, "repeat_first_run", False) and first is not None:
        one_run(*first, repeat=True)
    if args.engine_step:
        from .serve_engine_step import engine_steps

        in_len = args.input_len if args.dataset == "fixed" else int(statistics.median(r.prompt_len for r in reqs))
        out_len = args.output_len if args.dataset == "fixed" else int(statistics.median(r.output_len for r in reqs))
        doc["engine_step"] = engine_steps(args.engine_step, sorted(set(concs)), in_len, out_len,
                                          device=args.engine_device, memory_bytes=args.engine_memory_bytes, log=_log)
        _add_ratios(doc)
    return doc


def _metric_samples(base_url: str) -> list | None:
    """The samples of the server's /metrics (prometheus text format), None when it cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except Exception:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for fam in text_string_to_metric_families(text) for sample in fam.samples]


def _decode_forwards(samples: list) -> dict:
    """{bucket: (forwards, seconds)} of the decode forwards `serve --step-timing` counts ({} without them)."""
    out: dict[str, list] = {}
    for sample in samples:
        i = {"k3compile_decode_forwards_total": 0, "k3compile_decode_forward_seconds_total": 1}.get(sample.name)
        if i is not None and "batch" in sample.labels:
            out.setdefault(sample.labels["batch"], [0.0, 0.0])[i] = sample.value
    return {b: (int(n), s) for b, (n, s) in out.items()}


_PREFILL_SAMPLES = ("prefill_forwards", "prefill_forward_tokens", "prefill_forward_host_seconds",
                    "prefill_forward_device_forwards", "prefill_forward_device_seconds", "first_token_requests",
                    "first_token_prefill_forwards", "first_token_engine_seconds")


def _prefill_counters(samples: list) -> dict:
    """The prefill-forward and first-token counters ({name: value}, names without the k3compile_ prefix and
    _total; runtime/server/metrics.py)."""
    out = {}
    for sample in samples:
        name = sample.name.removeprefix("k3compile_").removesuffix("_total")
        if name in _PREFILL_SAMPLES:
            out[name] = sample.value
    return out


def scrape_prefill(base_url: str) -> dict | None:
    """The server's prefill-forward and first-token counters; None when /metrics cannot be read."""
    samples = _metric_samples(base_url)
    return None if samples is None else _prefill_counters(samples)


def _add_server_prefill(run: dict, before: dict | None, after: dict | None) -> None:
    """What the run's first tokens cost on the server (the counters' increase): prefill forwards, tokens per
    forward, host and device ms per forward, forwards per first token, engine-side TTFT."""
    if before is None or not after:
        return
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _PREFILL_SAMPLES}
    out = {}
    if d["first_token_requests"] > 0:
        out["first_tokens"] = int(d["first_token_requests"])
        out["forwards_per_first_token"] = d["first_token_prefill_forwards"] / d["first_token_requests"]
        out["engine_ttft_mean_ms"] = d["first_token_engine_seconds"] / d["first_token_requests"] * 1e3
    if d["prefill_forwards"] > 0:
        n = d["prefill_forwards"]
        out["forwards"] = int(n)
        out["tokens_per_forward"] = d["prefill_forward_tokens"] / n
        out["host_ms_per_forward"] = d["prefill_forward_host_seconds"] / n * 1e3
        if d["prefill_forward_device_forwards"] > 0:
            out["device_ms_per_forward"] = d["prefill_forward_device_seconds"] / d["prefill_forward_device_forwards"] * 1e3
    if out:
        run["server_prefill"] = out


def _prefill_line(p: dict | None) -> str:
    if not p:
        return ""
    parts = []
    if "forwards_per_first_token" in p:
        parts.append(f"{p['forwards_per_first_token']:.2f} prefill forwards per first token, engine TTFT "
                     f"{p['engine_ttft_mean_ms']:.1f} ms")
    if "forwards" in p:
        parts.append(f"prefill forward: {p['tokens_per_forward']:.0f} tokens, host {p['host_ms_per_forward']:.1f} ms"
                     + (f", device {p['device_ms_per_forward']:.1f} ms" if "device_ms_per_forward" in p else ""))
    return "; " + "; ".join(parts)


def _add_server_forwards(run: dict, before: dict, after: dict | None) -> None:
    """The server's decode forwards during the run (the counters' increase), per bucket and at the bucket most of
    them ran at, and served ITL p50 over that forward."""
    per = {}
    for b, (n, s) in (after or {}).items():
        n0, s0 = before.get(b, (0, 0.0))
        if n > n0:
            per[b] = {"forwards": n - n0, "mean_ms": (s - s0) / (n - n0) * 1e3}
    if not per:
        return
    run["server_decode_forward"] = per
    top = max(per, key=lambda b: per[b]["forwards"])
    run["server_forward_batch"], run["server_forward_ms"] = int(top), per[top]["mean_ms"]
    if math.isfinite(run.get("median_itl_ms", float("nan"))):
        run["itl_p50_over_server_forward"] = run["median_itl_ms"] / per[top]["mean_ms"]


def _add_ratios(doc: dict) -> None:
    """The goal ratios of each run against the engine's own step (doc["engine_step"])."""
    batches = doc["engine_step"]["batches"]
    single = batches.get("1", {}).get("prefill_ms")
    for run in doc["runs"]:
        step = batches.get(str(min(run["max_concurrency"], run["num_prompts"])))
        if step and step.get("device_step_ms"):
            run["engine_step_ms"] = step["device_step_ms"]
            run["itl_p50_over_engine_step"] = run["median_itl_ms"] / step["device_step_ms"]
        if step and step.get("prefill_ms"):   # what the engine itself takes to prefill the same wave
            run["ttft_p99_over_engine_prefill"] = run.get("p99_ttft_ms", float("nan")) / step["prefill_ms"]
        if single:   # the goal: TTFT p99 of simultaneous prompts within 4x one prompt's prefill
            run["ttft_p99_over_single_prefill"] = run.get("p99_ttft_ms", float("nan")) / single


def _log(msg: str) -> None:
    print(f"bench serve: {msg}", file=sys.stderr, flush=True)


def run(args) -> int:
    from .results import write_json
    from .serve_plot import plot

    doc = bench(args)
    os.makedirs(args.out, exist_ok=True)
    label = args.label or doc["model"].replace("/", "_")
    path = os.path.join(args.out, f"serve_{label}.json")
    write_json(path, doc)
    png = plot(doc, os.path.join(args.out, f"serve_{label}.png"))
    _log(f"wrote {path}" + (f" and {png}" if png else " (no PNG: matplotlib is not installed)"))
    return 0 if all(r["failed"] == 0 for r in doc["runs"]) else 1
