"""How a prefill step's time scales with the number of requests at a fixed token count (session 6, prefill6).

    python tools/prefill_scaling.py --engine /tmp/engines/mini --shapes 1x128,8x128,64x128,1x8192 \
        [--serve-shapes 1x128,64x128] [--profile 64x128] [--json OUT.json]

1. The engine's prefill step, as the runtime's executor runs it (Executor.run on a prefill ForwardBatch, fresh
   requests): per shape BxT, the first call (Triton JIT / autotune included) and the median of warm calls, with
   the device synchronized around each; ms per 1k tokens shows whether per-token cost grows with B.
2. `--profile BxT`: one warm step under torch.profiler: kernel launches, host reads of device values
   (aten::_local_scalar_dense, cudaStreamSynchronize / cudaMemcpy D->H), and the top ops by device time.
3. `--serve-shapes`: the path `serve` runs: an LLMEngine over the same engine object (unified memory, the
   given token budget, default prefix cache and overlap), B prompts of T random tokens, 1 output token each:
   time from adding them to the last first token, and each step's forward time (synchronized).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, (s.strip() for s in text.split(","))):
        b, _, t = part.partition("x")
        out.append((int(b), int(t)))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_batch(b: int, t: int, page: int, first_page: int, vocab: int, device, ForwardBatch):
    per = -(-t // page)
    table = [[first_page + i * per + j for j in range(per)] for i in range(b)]
    rng = random.Random(b * 100003 + t)
    ids = [[rng.randrange(10, min(vocab, 250)) for _ in range(t)] for _ in range(b)]
    return ForwardBatch.build("prefill", ids, [0] * b, table, list(range(1, b + 1)), page, device=device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default="1x128,8x128,64x128,1x8192")
    p.add_argument("--warm", type=int, default=3, help="warm calls per shape (median reported)")
    p.add_argument("--profile", default="64x128", help="BxT profiled under torch.profiler ('' for none)")
    p.add_argument("--serve-shapes", default="1x128,64x128", help="BxT through an LLMEngine ('' for none)")
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--memory-bytes", type=int, default=20_000_000_000)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)

    from k3compile.engine.engine import Engine
    from k3compile.model_def.batch import ForwardBatch
    from k3compile.model_def.cache import CacheTensors
    from k3compile.model_def.ops.cuda_backend import BACKENDS
    from k3compile.runtime.executor import Executor

    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    device = torch.device(a.device)
    engine = Engine.load(a.engine, device=device)
    log(f"loaded {engine}; backends {BACKENDS}")
    shapes = parse_shapes(a.shapes)
    page = engine.page_size
    max_b = max(b for b, _ in shapes)
    pages = max(b * -(-t // page) for b, t in shapes) + 2
    cache = CacheTensors.allocate(engine.cache_spec(), max_b + 2, pages, page, device)
    ex = Executor(engine, cache, cuda_graphs=False, max_context=max(t for _, t in shapes) + page)
    vocab = engine.config.vocab_size
    doc = {"engine": a.engine, "device": str(device), "backends": dict(BACKENDS), "steps": [], "serve": []}

    print(f"{'shape':>9} {'tokens':>6} {'first ms':>9} {'warm ms':>9} {'ms/1k tok':>9}")
    for b, t in shapes:
        fb = step_batch(b, t, page, 1, vocab, device, ForwardBatch)
        sync(device)
        s = time.perf_counter()
        ex.run(fb)
        sync(device)
        first = (time.perf_counter() - s) * 1e3
        warm = []
        for _ in range(a.warm):
            s = time.perf_counter()
            ex.run(fb)
            sync(device)
            warm.append((time.perf_counter() - s) * 1e3)
        med = statistics.median(warm)
        doc["steps"].append({"requests": b, "tokens_each": t, "first_ms": first, "warm_ms": med, "warm_all": warm})
        print(f"{b:>4}x{t:<4} {b * t:>6} {first:>9.1f} {med:>9.1f} {med / (b * t) * 1e3:>9.2f}", flush=True)

    if a.profile:
        (b, t), = parse_shapes(a.profile)
        from torch.profiler import ProfilerActivity, profile
        fb = step_batch(b, t, page, 1, vocab, device, ForwardBatch)
        ex.run(fb)
        sync(device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            ex.run(fb)
            sync(device)
        names: dict[str, int] = {}
        for e in prof.events():
            names[e.name] = names.get(e.name, 0) + 1
        launches = sum(v for k, v in names.items() if k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                            "cudaLaunchKernelExC"))
        reads = {k: v for k, v in names.items() if k in ("aten::_local_scalar_dense", "aten::item",
                                                          "cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                          "cudaMemcpyAsync")}
        print(f"\nprofile {b}x{t}: {launches} kernel launches; host reads / syncs {reads}")
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=20)
        print(table)
        doc["profile"] = {"shape": a.profile, "launches": launches, "reads": reads, "table": table}

    del ex, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if a.serve_shapes:
        from k3compile.runtime.engine import EngineArgs, LLMEngine
        from k3compile.runtime.sampling import SamplingParams
        llm = LLMEngine(EngineArgs(engine_dir=a.engine, device=str(device), enable_unified_memory=True,
                                   memory_bytes=a.memory_bytes, max_batch_tokens=a.max_batch_tokens,
                                   max_running=256, cuda_graph_buckets=(1, 8, 64)), model=engine)
        llm.warmup()
        inner, steps = llm.runner.executor.run, []

        def counted(fb):   # each forward timed with the device synchronized around it (diagnosis, not overlap)
            sync(device)
            s = time.perf_counter()
            out = inner(fb)
            sync(device)
            steps.append((fb.mode, fb.batch_size, fb.num_tokens, round((time.perf_counter() - s) * 1e3, 1)))
            return out

        llm.runner.executor.run = counted
        print(f"\nserve path (LLMEngine, unified memory, max_batch_tokens {a.max_batch_tokens}): B prompts of T "
              f"tokens at once, 1 output token each")
        print(f"{'shape':>9} {'all first tokens ms':>20} {'steps':>6}  steps (mode, requests, tokens, forward ms)")
        for rep in range(2):   # the first round may compile; the second is the warm figure
            for b, t in parse_shapes(a.serve_shapes):
                rng = random.Random(7 * b + t + rep)
                steps.clear()
                s = time.perf_counter()
                llm.generate([[rng.randrange(10, 250) for _ in range(t)] for _ in range(b)],
                             SamplingParams(max_new_tokens=1, ignore_eos=True))
                sync(device)
                ms = (time.perf_counter() - s) * 1e3
                doc["serve"].append({"round": rep, "requests": b, "tokens_each": t, "ms": ms, "steps": list(steps)})
                print(f"{b:>4}x{t:<4} {ms:>20.1f} {len(steps):>6}  {'' if rep else '(cold) '}{steps[:6]}", flush=True)
        llm.close()

    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
