"""Profile decode steps of an engine replayed from CUDA graphs, with the attribution run and the peak
measurements, into one trace that `k3compile report` attributes kernel by kernel.

    python tools/profile_engine_step.py --model k3-mini-6b --dtype bf16 --batch 1 --context 512 \
        --out $OUT/engine_step.json.gz [--engine DIR] [--no-passes]

Setup as `k3compile bench decode` does it: random pools, every request at the same position, so
the attribution run (which executes the step once more, on the same inputs) rewrites the same rows.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="k3-mini-6b")
    p.add_argument("--engine", help="engine directory (default: build the decode graph in memory)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-passes", action="store_true", help="profile the captured graph without passes")
    p.add_argument("--layers", type=int, default=None,
                   help="only the preset's first N layers (bench --layers: the 48B shape on an 80 GB card)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, help="trace path (.json or .json.gz)")
    a = p.parse_args(argv)

    from k3compile.capture import step_args
    from k3compile.engine.build import compile_graphs
    from k3compile.engine.engine import Engine
    from k3compile.model_def.dtypes import DTYPES as DTYPES_BY_NAME
    from k3compile.engine.profiling import AttributionRun, profile_steps
    from k3compile.model_def.batch import ForwardBatch
    from k3compile.model_def.cache import CacheTensors
    from k3compile.bench.decode import load_bench_model
    from k3compile.passes.pipeline import PipelineConfig
    from k3compile.runtime.executor import Executor

    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    device, dtype = torch.device(a.device), DTYPES_BY_NAME[a.dtype]
    if device.type == "cuda":
        from k3compile.bench.timing import init_profiler_for_cuda_graphs
        init_profiler_for_cuda_graphs()  # before any capture, or replays show no kernels
    if a.engine:
        engine = Engine.load(a.engine, device=device)
        config, page = engine.config, engine.page_size
        graph = engine.graphs["decode"]
    else:
        log(f"loading {a.model} ({a.dtype}) on {device}")
        # as the benches load it: a full-size preset (kimi-linear-48b) gets random weights on CUDA, which load_model
        # refuses (it builds those on the meta device only)
        model = load_bench_model(a.model, dtype, device, 0, a.layers)
        graphs, _ = compile_graphs(model, None if a.no_passes else PipelineConfig.default(), ("decode",), log=log)
        graph, config, page = graphs["decode"], model.config, 16
        engine = Engine(config, graphs, dtype, page_size=page)
    spec = engine.cache_spec()
    pages = -(-a.context // page)
    b = a.batch
    cache = CacheTensors.allocate(spec, b + 1, b * pages + 1, page, device)
    gen = torch.Generator(device=device).manual_seed(0)
    cache.kv.normal_(generator=gen)
    cache.ssm.normal_(0.0, 0.05, generator=gen)
    cache.conv.normal_(0.0, 0.5, generator=gen)
    tokens = torch.randint(0, min(config.vocab_size, 256), (b,), generator=gen, device=device).tolist()
    batch = ForwardBatch.build("decode", [[t] for t in tokens], [a.context - 1] * b,
                               [list(range(1 + r * pages, 1 + (r + 1) * pages)) for r in range(b)],
                               list(range(1, b + 1)), page, device=device)
    log("capturing the CUDA graph" if device.type == "cuda" else "CPU: eager steps")
    ex = Executor(engine, cache, device=device, buckets=(b,), max_context=a.context)
    for _ in range(5):
        ex.run(batch)
    log(f"profiling {a.steps} steps (attribution run first)")
    run = AttributionRun(f"decode bs={b}", graph, step_args(batch, cache))
    profile_steps(lambda: ex.run(batch), a.steps, a.out, device, attribution=[run],
                  pools=(cache.ssm, cache.conv, cache.kv))
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
